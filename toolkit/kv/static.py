"""The engine's KV cache: preallocated per layer, written by slot index, rolled back by moving per-row lengths.

gpt-fast's layout for ``B`` rows (:class:`StaticKV`): per decoder layer one key and one value buffer of shape
``(rows, kv_heads, capacity, head_dim)``, allocated once. Row ``r`` represents ``lengths[r]`` tokens (``lengths``
is a ``(rows,)`` device tensor: the absolute position of the row's next token). A forward over ``(B, W)`` new tokens
writes each token's key and value at its slot (a ``scatter_`` along the sequence dimension; buffer addresses never
change, which is what compiled graphs and CUDA graphs need) and attends under a boolean mask built from ``lengths``
alone. Nothing is moved afterwards: the decoder then calls :meth:`StaticKV.accept` with how many of the ``W`` tokens
each row keeps (``1 + accepted``), which only adds to ``lengths``. Entries of rejected draft tokens stay in slots past
a row's length, invisible to every later query, and the row's next forward overwrites them — rollback is exact and
costs nothing. Token trees write a row's next slots too, and keep their path in place (:mod:`toolkit.kv.static_tree`).

Two slot maps, one mask rule (a query at position ``q`` sees the slot holding position ``p`` iff ``p <= q`` and the
policy keeps ``p`` for ``q``):

* **plain** (``kv: {policy: none}``): slot = position; capacity = the longest request + the widest forward.
* **StreamingLLM ring** (Xiao et al., ICLR 2024; :class:`~toolkit.kv.streaming.StreamingLLM` with absolute positions
  and the exact window): the first ``sink_tokens`` positions keep their slots; every later position ``p`` goes to
  slot ``sinks + (p - sinks) mod R`` of a ring of ``R = window + widest`` slots. The position a ring slot holds is
  computed, not stored (the newest ``p`` written that maps to it); a query sees the sinks and its own last ``window``
  positions, exactly what the single-sequence policy keeps. ``R`` leaves room for a whole verify forward, so no
  position a query needs is ever overwritten by a draft token that is later rejected. Capacity is fixed whatever
  the generation length: ``sinks + window + widest`` slots. On a GPU long prompts fill it in chunks
  (:mod:`~.window_prefill`).

Policies that change what they hold at commit points subclass it with buffers of their own, still fixed in size and
moved only at commit points: L2-norm and head-aware eviction as fixed-budget tiers compacted there
(:mod:`toolkit.kv.static_evict`), StreamingLLM with reindexed positions or without the exact window the same way
(:mod:`toolkit.kv.static_stream`), KIVI quantization (standalone, or composed with StreamingLLM) as packed groups, fp
sinks and a fixed fp residual whose whole groups are packed there (:mod:`toolkit.kv.static_quant`,
:mod:`toolkit.kv.static_stream_quant`). Every policy declares its static form (``static_cache``; :func:`static_form`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from toolkit.kv.static_tree import TreeRows
from toolkit.kv.window_prefill import WindowedPrompt, prompt_cache

#: capacities are rounded up to a multiple of this many tokens (one compiled graph serves requests up to it)
CAPACITY_STEP = 256
#: the attended span (slots a forward reads) is rounded up to a multiple of this many tokens on CPU
SPAN_STEP = 64


def capacity_for(tokens: int, step: int = CAPACITY_STEP) -> int:
    """The smallest multiple of ``step`` that holds ``tokens`` positions. Raises ``ValueError`` for ``tokens < 1``."""
    if tokens < 1:
        raise ValueError(f"tokens: must be >= 1, got {tokens}")
    return -(-tokens // step) * step


def spare_rows(rows: int, static_span: bool) -> int:
    """Rows a static cache allocates beyond ``rows``: one where shapes are dynamic and it holds a batch, so that a
    batch of every allocated row never makes the batch size equal the buffers' first size (torch.compile would
    specialise that case into a graph of its own); none for one row (a static size of its own) or bucketed shapes."""
    return 0 if static_span or rows == 1 else 1


def static_form(policy) -> str | None:
    """Why ``policy`` has no static form (``None``: it has one). :class:`StaticKV` holds no policy (``None``); a
    policy declares its own form by its ``static_cache(model, rows, capacity, widest, static_span)`` (every torch
    policy does: StreamingLLM's ring or :mod:`toolkit.kv.static_stream`, L2-norm and head-aware eviction
    :mod:`toolkit.kv.static_evict`, KIVI :mod:`toolkit.kv.static_quant` and :mod:`toolkit.kv.static_stream_quant`)."""
    if policy is None or getattr(policy, "static_cache", None) is not None:
        return None
    return f"the {policy.name} policy (it has no static form)"


class StaticLayer(CacheLayerMixin):
    """One decoder layer's buffers ``(rows, kv_heads, capacity, head_dim)``; writes where its :class:`StaticKV` says.

    ``update`` scatters the new ``(B, kv_heads, W, head_dim)`` states at the slots of the current forward
    (``owner.write_index`` ``(B, W)``, rows ``owner.first .. owner.first + B - 1``) and returns the first ``span``
    slots of those rows, ``span`` being the last size of the forward's mask (``owner.attention_mask``).
    """

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: StaticKV, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.owner, self.keys, self.values = owner, keys, values
        self.is_initialized = True
        self.dtype, self.device = keys.dtype, keys.device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Never lazy: the buffers exist from the start (their addresses must not change)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        owner = self.owner
        rows = slice(owner.first, owner.first + key_states.shape[0])
        write_index, span = self.where()
        # one index_put_ on the whole buffer (not on a slice of it): inductor then writes in place; a scatter into a
        # slice made it copy every layer's whole buffer in and out of each compiled forward
        heads = torch.arange(key_states.shape[1], device=key_states.device).view(1, -1, 1)
        index = (owner.row_index.view(-1, 1, 1), heads, write_index[:, None, :])
        self.keys.index_put_(index, key_states.to(self.keys.dtype))
        self.values.index_put_(index, value_states.to(self.values.dtype))
        return self.keys[rows, :, :span], self.values[rows, :, :span]

    def where(self) -> tuple[torch.Tensor, int]:
        """``(slots (B, W) the current forward writes, slots it reads)``: the owner's (a ring layer of
        :mod:`toolkit.kv.static_sliding` has its own)."""
        return self.owner.write_index, self.owner.attention_mask.shape[-1]

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        return self.where()[1], 0

    def buffers(self):
        """The layer's preallocated buffers ``(rows, kv_heads, slots, head_dim)`` (moved with rows, counted in
        :meth:`StaticKV.kv_bytes`)."""
        yield self.keys
        yield self.values

    def get_seq_length(self) -> int:
        return self.owner.longest

    def get_max_length(self) -> int:
        return self.keys.shape[-2]


class StaticKV(TreeRows, Cache):
    """The static KV cache of ``rows`` rows (see the module docstring).

    Args:
        model: the HF causal LM whose layers write into it (its text config gives layers, KV heads, head size).
        rows: rows allocated (the batch size; a single sequence is 1).
        capacity: slots per row (tokens); with ``window`` the ring's size is fixed by the policy instead.
        widest: the widest forward after the prefill (tokens per row; the ring keeps room for it).
        window: a :class:`~toolkit.kv.streaming.StreamingLLM` (absolute positions, exact window), or ``None``.
        dtype / device: of the buffers (default: the model's device, and its compute dtype — float32 on a CPU for
            half-precision models, whose attention runs in float32 there: see
            :func:`toolkit.kv.attention.static_attention`).
        static_span: attend to every slot (CUDA graphs need fixed shapes); otherwise the forward reads only the
            slots in use, rounded up to :data:`SPAN_STEP` (a dynamic dimension of a compiled graph on CPU).

    Attributes:
        lengths: ``(rows,)`` long, on ``device``: tokens each row represents (the next token's position).
        held: the same on the host (kept in step by :meth:`accept`; no device read).

    Raises:
        ValueError: ``rows`` or ``capacity`` < 1, or a ``window`` policy the ring does not hold.
    """

    compressions = 0
    static = True
    #: whether :meth:`load_row` takes a :class:`~toolkit.kv.window_prefill.WindowedPrompt` (a ring's long prompt)
    chunks_prompts = True

    def __init__(self, model, rows: int, capacity: int, widest: int = 1, window=None, dtype=None, device=None,
                 static_span: bool = False):
        if rows < 1 or capacity < 1:
            raise ValueError(f"rows and capacity: must be >= 1, got {rows} and {capacity}")
        if window is not None and (not getattr(window, "ring", False) or hasattr(window, "quant_bits")):
            raise ValueError(f"window: the ring holds StreamingLLM with absolute positions and the exact window only, "
                             f"not this {window.name} policy (its static_cache builds a cache of its own)")
        num_layers, kv_heads, head_dim, dtype, device = kv_geometry(model, dtype, device)
        self.policy, self.window, self.widest = window, window, widest
        self.sinks = window.sink_tokens if window is not None else 0
        self.ring = window.window + widest if window is not None else 0
        self.capacity = self.sinks + self.ring if window is not None else capacity
        self.static_span = static_span
        # a forward reads a span of at most `capacity` slots; the buffers are one SPAN_STEP longer when the span is a
        # dynamic size of a compiled graph, so that it never equals the buffer's own length (torch.compile would
        # specialise that case into a graph of its own); likewise the batch size (spare_rows)
        shape = (rows + spare_rows(rows, static_span), kv_heads, self.capacity + (0 if static_span else SPAN_STEP),
                 head_dim)
        layers = [StaticLayer(self, static_buffer(shape, dtype, device), static_buffer(shape, dtype, device))
                  for _ in range(num_layers)]
        self._adopt(layers, rows, static_span, device)
        self.write_index = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.attention_mask = torch.ones(1, 1, 1, min(self.capacity, SPAN_STEP), dtype=torch.bool, device=device)

    def _adopt(self, layers: list, rows: int, static_span: bool, device) -> None:
        """The cache takes ``layers`` and the row state every static cache keeps: ``rows`` allocated (plus
        :func:`spare_rows`), none in use, the per-row ``lengths`` (device) and ``held`` (host) at 0."""
        Cache.__init__(self, layers=layers)
        self.allocated, self.active = rows, 0
        self.first = 0  # first row of the current forward
        self.lengths = torch.zeros(rows + spare_rows(rows, static_span), dtype=torch.long, device=device)
        self.held = [0] * rows
        self.row_index = torch.zeros(1, dtype=torch.long, device=device)

    @property
    def dynamic_span(self) -> bool:
        """Whether the forward's ``attention_mask`` has a dynamic last size where shapes are not bucketed (the plain
        layers' span; a cache whose mask spans fixed slots says no)."""
        return True

    @property
    def bounded(self) -> bool:
        """Whether a row holds at most :attr:`capacity` positions (a plain cache; the ring holds any length)."""
        return self.window is None

    @property
    def ringed(self) -> bool:
        """Whether some layer is a ring: a forward may then append at most :attr:`widest` tokens per row."""
        return self.window is not None

    def fits(self, capacity: int) -> bool:
        """Whether a request of ``capacity`` positions fits."""
        return not self.bounded or self.capacity >= capacity

    # ------------------------------------------------------------------------------------------------ a forward
    @property
    def rows(self) -> int:
        """Rows in use (the first ``rows`` of the :attr:`allocated`)."""
        return self.active

    @property
    def longest(self) -> int:
        """Tokens represented by the longest row (host-side)."""
        return max(self.held, default=0)

    def span_for(self, width: int, rows: range | None = None) -> int:
        """Slots a forward of ``width`` tokens per row over ``rows`` must read: every slot with ``static_span``,
        else the highest slot written + 1, rounded up to :data:`SPAN_STEP` (within capacity)."""
        if self.static_span:
            return self.capacity
        held = self.held if rows is None else [self.held[r] for r in rows]
        need = max(held, default=0) + width
        if self.window is not None:
            need = min(need, self.capacity)
        return min(self.capacity, -(-need // SPAN_STEP) * SPAN_STEP)

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """The slot of each absolute position (``positions`` any shape, long)."""
        if self.window is None:
            return positions
        return torch.where(positions < self.sinks, positions,
                           self.sinks + torch.remainder(positions - self.sinks, self.ring))

    def visibility(self, positions: torch.Tensor, span: int) -> torch.Tensor:
        """Boolean ``(B, 1, W, span)``: whether query ``(b, i)`` at ``positions[b, i]`` sees slot ``s`` — the slot's
        position is at most the query's and, under a window, a sink or one of the query's last ``window``."""
        slot = torch.arange(span, device=positions.device).view(1, 1, -1)
        query = positions[:, :, None]
        if self.window is None:
            return (slot <= query)[:, None]
        newest = positions[:, -1:, None]  # the last position written by this forward, per row
        held_at = newest - torch.remainder(newest - slot, self.ring)  # the newest position of the slot's residue
        held_at = torch.where(slot < self.sinks, slot, held_at)
        written = (slot < self.sinks) | (held_at >= self.sinks)  # a ring slot below the sinks was never written
        visible = written & self.window.sees(held_at, query)
        return visible[:, None]

    def prepare(self, width: int, rows: range | None = None, span: int | None = None) -> dict:
        """Model inputs of a forward appending ``width`` tokens to each of ``rows`` (default: all): ``position_ids``
        ``(B, width)`` and the boolean ``attention_mask`` ``(B, 1, width, span)``; sets where the layers write.
        Reads no device value (the span comes from the host-side :attr:`held`)."""
        rows = rows if rows is not None else range(self.active)
        span = span if span is not None else self.span_for(width, rows)
        self.first = rows.start
        self.row_index = torch.arange(rows.start, rows.stop, device=self.lengths.device)
        lengths = self.lengths[rows.start:rows.stop]
        positions = lengths[:, None] + torch.arange(width, device=lengths.device)[None, :]
        self.write_index = self.slots(positions)
        self.attention_mask = self.visibility(positions, span)
        return {"position_ids": positions, "attention_mask": self.attention_mask, "past_key_values": self}

    def dynamic_inputs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(masks, write indices)`` of the current forward, whose sizes a compiled graph treats as dynamic."""
        return [self.attention_mask], [self.write_index]

    def accept(self, kept: torch.Tensor, kept_host: list[int], rows: range | None = None) -> None:
        """After a forward: row ``r`` keeps the first ``kept[r]`` of its new tokens (``(B,)`` long on the device, the
        same values on the host as ``kept_host``); the rest lie past its length and are overwritten later."""
        rows = rows if rows is not None else range(self.active)
        self.lengths[rows.start:rows.stop] += kept
        for r, k in zip(rows, kept_host):
            self.held[r] += k
            if self.bounded and self.held[r] + self.widest > self.capacity:
                raise ValueError(f"StaticKV: row {r} holds {self.held[r]} tokens; capacity {self.capacity} "
                                 f"leaves no room for a {self.widest}-token forward")

    # ------------------------------------------------------------------------------------------------ rows
    def begin_row(self, length: int) -> tuple[Cache, dict]:
        """Where a new request's prompt of ``length`` tokens is prefilled alone
        (:func:`~toolkit.kv.window_prefill.prompt_cache`: every position, or in chunks under a ring's window).

        Raises:
            ValueError: every allocated row is in use.
        """
        if self.active >= self.allocated:
            raise ValueError(f"StaticKV: all {self.allocated} rows are in use")
        return prompt_cache(self.window, length, self.lengths.device, self.ring if self.chunks_prompts else None)

    def add_row(self, prefilled: Cache, length: int) -> None:
        """The prompt prefilled by :meth:`begin_row` becomes the last row in use."""
        self.load_row(self.active, prefilled, length)
        self.active += 1

    def keep_rows(self, keep: list[int]) -> None:
        """Only the rows ``keep`` stay in use, in that order (their buffers move to the front)."""
        self.move_rows(keep)
        self.active = len(keep)

    def load_row(self, row: int, source: Cache, length: int) -> None:
        """Row ``row`` takes a prompt prefilled alone: ``source`` (batch 1) holds positions ``0 .. length - 1`` in
        every layer. The plain cache copies them all; the ring its sinks and the newest positions it has room for
        (the oldest of which no later query sees)."""
        if self.window is None:
            if length + self.widest > self.capacity:
                raise ValueError(f"StaticKV: a {length}-token prompt leaves no room in capacity {self.capacity} "
                                 f"for a {self.widest}-token forward")
            kept = torch.arange(length)
        else:
            start = max(self.sinks, length - self.ring)
            kept = torch.cat([torch.arange(min(self.sinks, length)), torch.arange(start, length)])
        kept = kept.to(self.lengths.device)
        slots = self.slots(kept)
        held = source.index_of(kept) if isinstance(source, WindowedPrompt) else kept  # entries of `source`
        for layer, single in zip(self.layers, source.layers):
            layer.keys[row].index_copy_(1, slots, single.keys[0].index_select(1, held).to(layer.keys.dtype))
            layer.values[row].index_copy_(1, slots, single.values[0].index_select(1, held).to(layer.values.dtype))
        self.lengths[row] = length
        self.held[row] = length

    def row_counters(self) -> tuple[list[torch.Tensor], list[list[int]]]:
        """Per-row state moved and reset with the rows: ``(device tensors (rows,), host lists)`` — the lengths
        (:attr:`lengths`, :attr:`held`); subclasses add their own."""
        return [self.lengths], [self.held]

    def reset_row(self, row: int) -> None:
        """Row ``row`` represents nothing (its slots are overwritten by its next prefill)."""
        tensors, lists = self.row_counters()
        for counter in (*tensors, *lists):
            counter[row] = 0

    def move_rows(self, order: list[int]) -> None:
        """Row ``i`` takes what row ``order[i]`` held, for ``i < len(order)`` (rows leaving a batch: the ones that
        stay move to the front). Rows past ``len(order)`` are reset."""
        if order != list(range(len(order))):
            index = torch.tensor(order, dtype=torch.long, device=self.lengths.device)
            tensors, lists = self.row_counters()
            for buffer in (*(b for layer in self.layers for b in layer.buffers()), *tensors):
                buffer[: len(order)] = buffer.index_select(0, index)
            for counter in lists:
                counter[: len(order)] = [counter[i] for i in order]
        for r in range(len(order), self.allocated):
            self.reset_row(r)

    # ------------------------------------------------------------------------------------------------ reports
    def commit(self) -> None:
        """A commit point: nothing to compress (the ring drops positions by overwriting their slots)."""

    def kv_bytes(self) -> int:
        """Bytes of the key and value buffers (all slots: the memory really held)."""
        return sum(buffer.nbytes for layer in self.layers for buffer in layer.buffers())

    def needed_bytes(self) -> int:
        """Bytes of the entries the rows in use hold now (at most a layer's slots): what a cache sized to them needs."""
        held = self.held[: self.active]
        return sum(slot_bytes(buffer) * sum(min(h, self.capacity, buffer.shape[2]) for h in held)
                   for layer in self.layers for buffer in layer.buffers())

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.longest


def slot_bytes(buffer: torch.Tensor) -> int:
    """Bytes of one row's slot of a buffer ``(rows, kv_heads, slots, head_dim)``, without a view (read every round)."""
    return buffer.nbytes // (buffer.shape[0] * buffer.shape[2])


def kv_geometry(model, dtype=None, device=None) -> tuple[int, int, int, torch.dtype, torch.device]:
    """``(layers, kv_heads, head_dim, dtype, device)`` of a static cache for ``model``: by default on the model's
    device in its compute dtype, float32 on a CPU for half-precision models (whose attention runs in float32 there:
    see :func:`toolkit.kv.attention.static_attention`; stored so, not converted at each read)."""
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    device = device or next(model.parameters()).device
    dtype = dtype or _compute_dtype(model)
    if torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        dtype = torch.float32
    return config.num_hidden_layers, kv_heads, head_dim, dtype, device


def static_buffer(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed buffer whose address compiled graphs and CUDA graphs may bake in (``mark_static_address``)."""
    buffer = torch.zeros(shape, dtype=dtype, device=device)
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(buffer)
    return buffer


def _compute_dtype(model) -> torch.dtype:
    """The dtype activations run in: that of the first floating-point parameter that is not a quantized
    tensor subclass's storage (torchao int4 weights report their compute dtype as ``dtype``)."""
    for p in model.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return torch.float32
