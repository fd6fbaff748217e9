"""An EAGLE head's forward over the engine's static cache, compiled or eager (the head of
:class:`~toolkit.speculative.drafters.eagle.EagleDrafter`).

The head's KV cache is a :class:`~toolkit.kv.static.StaticKV` of one layer (gpt-fast's layout: per-row buffers
written by slot index, a boolean mask from per-row lengths, rollback by moving lengths), sized by the head's own shape
(:func:`head_cache`). One call of :class:`HeadForward` is one head step over ``(B, W)`` (row ``r``'s first
``counts[r]`` real)::

    x       = fc(cat(embed(tokens), features))   (EAGLE-1 step 1)   | fc(features) (EAGLE-3 step 1)
            | the step input of the head's own outputs                (later steps: ``first=False``)
    out     = the head's decoder layer over x, attending to the row's cache through the static mask
    last    = out at each row's last real input                      (B, H)
    logits  = the head's LM head over last                           (B, draft_vocab)

and is ONE compiled graph per (first step or not) x (one row or more) x (one token or more), compiled as the target's
forward is (:mod:`toolkit.engine.forward`). An EAGLE-1 head's first and later inputs are one computation (its
features and its own outputs have the same width and both go through ``fc`` with the tokens' embeddings), so its
steps share the later steps' graphs: on this CPU (fp32 target, ``compile: on``, four held-out prompts) the shipped
head's K = 3 chain compiled 5 graphs, 3 of them the head's, and now 4, with the same τ on every prompt.

* **CPU** (inductor): the rows, the width and the attended span dynamic, so a process compiles at most eight small
  graphs, seconds each.
* **CUDA** (``mode="reduce-overhead"``: CUDA graphs): the rows and the width padded to the target's buckets
  (:data:`~toolkit.engine.forward.CUDA_BATCH_SIZES` x :data:`~toolkit.engine.forward.CUDA_WIDTHS`) and the span the
  whole head cache (:func:`head_cache` with ``static_span``), so each step replays one captured CUDA graph instead of
  launching its kernels one by one: measured on an H100 before this (``bench/reports/gpu/h100-2026-11-27-3``), three
  eager-launched head steps cost 4.05 ms, more than the target's verify forward (3.31 ms). Padded rows are unused rows
  of the head cache, padded positions lie past the rows' kept entries (never accepted), and each step's outputs are
  copied out of the graph's memory before the next replay overwrites it.

A token tree's expansion step (``tree``: one row, the expanded nodes appended to the head cache's tree region under
a tree mask, :mod:`toolkit.kv.static_tree`) returns every node's output and logits ``(1, W, ...)``: a graph of its
own.
A graph's first call compiles it (logged on ``toolkit.engine``; its time is counted in :attr:`HeadForward.compile_ms`,
which the decoder keeps out of a request's timings).
"""

from __future__ import annotations

import logging
import time
import weakref
from types import SimpleNamespace

import torch

from toolkit.engine.forward import CUDA_BATCH_SIZES, CUDA_WIDTHS, LEAN_CPU_OPTIONS, MODES, bucket, bucketed
from toolkit.engine.guards import call_compiled, skip_guards_default
from toolkit.kv.static import StaticKV
from toolkit.resources import inductor_cache

log = logging.getLogger("toolkit.engine")


class _HeadShape:
    """What :class:`StaticKV` reads of a model, for a head: its text config (one layer, the head's attention shape)
    and its parameters (device and compute dtype)."""

    def __init__(self, head):
        c = head.config
        text = SimpleNamespace(num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                               head_dim=c.head_dim, hidden_size=c.hidden_size, num_hidden_layers=1)
        self.config = SimpleNamespace(get_text_config=lambda decoder=True: text)
        self.parameters = head.parameters


def head_cache(head, rows: int, capacity: int, widest: int, static_span: bool = False) -> StaticKV:
    """The head's static cache: ``rows`` rows of ``capacity`` positions (true pairs, one per committed token) and
    forwards of up to ``widest`` tokens past them; ``static_span``: every forward attends to every slot (CUDA
    graphs)."""
    return StaticKV(_HeadShape(head), rows, capacity, widest, static_span=static_span)


class _StaticLayerCache:
    """The head attention's cache interface (``len``, ``append``) over the static cache's layer: ``append`` writes
    the new keys and values at their slots and returns the attended span, in the head's dtype (on CPU the static
    buffers are float32 whatever the head's dtype)."""

    def __init__(self, cache: StaticKV):
        self.layer = cache.layers[0]

    def __len__(self) -> int:
        return 0  # the head always gets the static mask: its causal default is never built

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.layer.update(k, v)
        return keys.to(k.dtype), values.to(v.dtype)


def _head_step(head, source: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
               cache: _StaticLayerCache, last: torch.Tensor, first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One head step (the compiled region; see the module docstring): the outputs at the inputs ``last`` ``(B, k)``
    picks, ``(B, k, H)``, and their logits ``(B, k, d)``."""
    x = head.input_features(source, tokens) if first else head.step_input(source, tokens)
    out, _ = head(x, tokens, positions, cache, mask)
    out = out.gather(1, last[:, :, None].expand(-1, -1, out.shape[-1]))
    return out, head.logits(out)


class HeadForward:
    """A head's step over its static cache (see the module docstring).

    Args:
        head: the loaded :class:`~toolkit.eagle.head.EagleHead`.
        compile: compile the step with ``torch.compile`` (``False``: eager).
        backend: ``torch.compile``'s (``eager`` traces without code generation: tests).
        buckets: pad rows and widths to the target's buckets over a static span (default: on CUDA, where the step
            is then a CUDA graph; ``True`` on a CPU runs the same padding without graphs: tests).

    Attributes:
        compile_ms: milliseconds spent in calls that compiled (or captured a CUDA graph), cumulative.
    """

    def __init__(self, head, compile: bool = False, backend: str = "inductor", buckets: bool | None = None):
        self.head, self.backend = head, backend
        self.device = head.lm_head.weight.device
        self.dtype = next(head.parameters()).dtype
        self.buckets = bucketed(self.device) if buckets is None else buckets
        self.graphs = compile and backend == "inductor" and MODES.get(self.device.type) == "reduce-overhead"
        self.compile_ms = 0.0
        self._seen: set[tuple] = set()
        self._checked = weakref.WeakKeyDictionary()  # head cache -> graph keys that ran on it once with every guard
        self.skip_guards = skip_guards_default()
        self._compiled = None
        if compile:
            inductor_cache()
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            lean = LEAN_CPU_OPTIONS if backend == "inductor" and self.device.type == "cpu" else None
            self._compiled = torch.compile(_head_step, dynamic=False, backend=backend, options=lean,
                                           mode="reduce-overhead" if self.graphs else None)

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    @property
    def static_span(self) -> bool:
        """Whether the head cache must attend to every slot (compiled over bucketed shapes)."""
        return self.compiled and self.buckets

    def width_for(self, width: int) -> int:
        """Tokens per row a step of ``width`` really runs (its bucket where shapes are bucketed)."""
        return bucket(width, CUDA_WIDTHS) if self.static_span else width

    def __call__(self, cache: StaticKV, source: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor,
                 counts_host: list[int], first: bool, tree=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a step over ``tokens`` ``(B, W)`` with ``source`` ``(B, W, F)`` (the target's features for the first
        step, the head's own outputs after it) appended to the cache's ``B`` rows, which keep their first
        ``counts[r]`` entries (``counts_host`` the same on the host). Returns ``(out (B, H), logits (B, d))`` at each
        row's last real input; with ``tree`` (a token tree's region on row 0,
        :class:`~toolkit.kv.static_tree.TreeInputs`) ``(out (1, W, H), logits (1, W, d))`` at every input."""
        rows, width = tokens.shape
        first = first and self.head.config.variant != "eagle1"  # EAGLE-1: one computation either way (docstring)
        # a catch-up wider than the widest bucket (a long prompt's pairs) runs eager, as the target's prefill does
        compiled = self.compiled and not (self.static_span and width > CUDA_WIDTHS[-1])
        if compiled and self.static_span:
            source, tokens, counts = self._padded(cache, source, tokens, counts)
        run_rows, run_width = tokens.shape
        kwargs = cache.prepare(run_width, range(run_rows)) if tree is None else cache.prepare_tree(tree, run_width)
        last = (counts - 1).clamp_min(0)[:, None] if tree is None else \
            torch.arange(run_width, device=tokens.device)[None]
        args = (self.head, source.to(self.dtype), tokens, kwargs["position_ids"], kwargs["attention_mask"],
                _StaticLayerCache(cache), last, first)
        out = self._run_compiled(args, cache, tree is not None) if compiled else _head_step(*args)
        cache.accept(counts[:rows], counts_host)
        if tree is not None:
            return out[0][:, :width], out[1][:, :width]
        return out[0][:rows, 0], out[1][:rows, 0]

    def _padded(self, cache: StaticKV, source: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor):
        """``(source, tokens, counts)`` padded to the buckets: rows to the next batch size within the cache's
        allocated rows (padding rows are unused rows of the head cache, counting one entry), width to the next
        bucket (each row's last token and source repeated past its end: written past the kept entries, never
        accepted)."""
        rows, width = tokens.shape
        run_rows = min(bucket(rows, CUDA_BATCH_SIZES), cache.allocated)
        run_width = self.width_for(width)
        if (run_rows, run_width) == (rows, width):
            return source, tokens, counts
        padded_tokens = tokens.new_zeros(run_rows, run_width)
        padded_tokens[:rows, :width] = tokens
        padded_tokens[:rows, width:] = tokens[:, -1:]
        padded_source = source.new_zeros(run_rows, run_width, source.shape[-1])
        padded_source[:rows, :width] = source
        padded_source[:rows, width:] = source[:, -1:]
        padded_counts = counts.new_ones(run_rows)
        padded_counts[:rows] = counts
        return padded_source, padded_tokens, padded_counts

    def _run_compiled(self, args: tuple, cache: StaticKV, tree: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The compiled step: a graph per shape class (bucketed: per bucket), announced and timed at its first
        call; once a graph ran on this head cache with every guard, only the guards that tell the graphs apart are
        evaluated, as for the target's forwards (:mod:`toolkit.engine.guards`); outputs copied out of a CUDA graph's
        memory (the next replay overwrites it)."""
        tokens = args[2]
        rows, width = tokens.shape
        self._mark_dynamic(args, cache, span=not self.static_span)
        sizes = (rows, width) if self.static_span else (min(rows, 2), min(width, 2))
        key = (args[-1], *sizes) + (("tree",) if tree else ())  # a tree step is a graph of its own
        began = time.perf_counter()
        if key not in self._seen:
            log.info("compiling the EAGLE head's %s step (%s rows x %s tokens) with torch.compile: seconds",
                     "tree" if tree else "first" if args[-1] else "later",
                     *(str(n) if self.static_span or n == 1 else "2+" for n in sizes))
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        checked = self._checked.setdefault(cache, set())
        out = call_compiled(self._compiled, args, full_guards=key not in checked or not self.skip_guards)
        checked.add(key)
        if self.graphs:
            out = (out[0].clone(), out[1].clone())
        if key not in self._seen:
            self._seen.add(key)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.compile_ms += (time.perf_counter() - began) * 1000
        return out

    @staticmethod
    def _mark_dynamic(args: tuple, cache: StaticKV, span: bool) -> None:
        """Rows and width where they exceed 1, and the attended span unless it is static: one graph per class of
        shapes (with CUDA graphs, one capture per bucket from it)."""
        _, source, tokens, positions, mask, _, last, _ = args
        rows, width = tokens.shape
        if span:
            torch._dynamo.mark_dynamic(mask, 3)
        for tensor in (tokens, positions, cache.write_index, source, *((last,) if last.shape[1] > 1 else ())):
            if width > 1:
                torch._dynamo.mark_dynamic(tensor, 1)
            if rows > 1:
                torch._dynamo.mark_dynamic(tensor, 0)
        if width > 1:
            torch._dynamo.mark_dynamic(mask, 2)
        if rows > 1:
            for tensor in (mask, last, cache.row_index):
                torch._dynamo.mark_dynamic(tensor, 0)
