"""The target's forward compiled once per verify-width bucket, on a static KV cache (gpt-fast's decode shape).

Why: on this CPU the int4 target is not bytes-bound; eager PyTorch's per-op overhead is most of a decode step, and a
growing cache costs a ``torch.cat`` per layer per round. A compiled forward over a preallocated cache removes both
(see ``../shared/DESIGN.md``, "The static engine"): HF's own static cache + ``torch.compile`` is 1.4-1.5x eager AR
on the same int4 weights.

How:

* the cache is a :class:`~toolkit.kv.static.StaticKVCache` whose capacity only grows: the largest request seen so
  far, rounded up to 512 tokens (a graph is specialised to its capacity: every capacity compiles every bucket
  again, so requests share the largest one; :meth:`CompiledTarget.warm_up` with the longest request first);
* a forward of ``q`` new tokens is padded to the smallest bucket ``b >= q`` of :attr:`CompiledTarget.widths`
  (repeating the last token at the following positions) and runs the graph compiled for ``b``
  (``torch.compile(dynamic=False)``: one graph per bucket and capacity, inductor on CPU; on CUDA the same graphs
  under ``mode="reduce-overhead"`` = CUDA graphs); the ``b - q`` padding entries are rolled back at once, so the
  caller sees exactly ``q`` positions appended;
* forwards wider than the widest bucket (the prompt) run eager on the same cache;
* the verify cost curve of this path (:func:`toolkit.speculative.cost_model.measure_verify_cost` with
  ``engine=``) is therefore a step function: verifying 3 tokens costs the width-4 graph, which the cost-aware
  planner reads like any other curve.

Compiled code is cached on disk by inductor (``TORCHINDUCTOR_CACHE_DIR``, set to ``<cache_dir>/inductor`` unless
the user set it), so a second process compiles from cache: about 17 s a graph here instead of about 55 s.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from toolkit.kv.static import StaticKVCache, capacity_for

log = logging.getLogger("toolkit.speculative")

#: verify widths a graph is compiled for below the recipe's widest forward (K + 1), which gets its own; a plain step
#: runs the width-2 graph: on this CPU the compiled one-row int4 forward is no faster than the two-row one
DEFAULT_WIDTHS = (2, 4, 8)
#: compile modes: CPU -> inductor's default; CUDA -> CUDA graphs
MODES = {"cpu": "default", "cuda": "reduce-overhead"}


def supports_static(model) -> str | None:
    """Why ``model`` cannot run on the static engine (``None`` when it can): every layer must be full attention
    (sliding-window and linear-attention layers keep their own cache semantics)."""
    types = getattr(model.config.get_text_config(decoder=True), "layer_types", None) or ["full_attention"]
    others = sorted(set(types) - {"full_attention"})
    if others:
        return f"layers of type {', '.join(others)} (the static engine holds full-attention layers only)"
    if getattr(model.config, "sliding_window", None) and getattr(model.config, "use_sliding_window", True):
        return "a sliding attention window"
    return None


def _inductor_cache() -> None:
    """Inductor's on-disk cache under the toolkit's cache directory, unless the user chose one. Inductor reads the
    variable at every use but writes its default (``/tmp/torchinductor_<user>``) into it on first use, so a value
    equal to that default counts as unset."""
    from toolkit.resources import cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        default = os.path.abspath(default_cache_dir())
    except (ImportError, OSError):  # a torch without this helper: only an unset variable is replaced
        default = None
    if current is None or os.path.abspath(current) == default:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")


class CompiledTarget:
    """The target's forward on a :class:`StaticKVCache`, compiled per width bucket.

    Args:
        model: the HF causal LM (any weights: fp32, bf16, torchao int4/int8).
        widths: ascending bucket widths (tokens per verify forward); the last is the widest compiled forward.
        backend: ``torch.compile`` backend (``inductor``; ``eager`` traces without code generation: tests).
        mode: ``torch.compile`` mode (default: :data:`MODES` for the model's device).

    Raises:
        ValueError: empty or unsorted ``widths``, or a model :func:`supports_static` refuses.
    """

    def __init__(self, model, widths: tuple[int, ...] = (*DEFAULT_WIDTHS, 16), backend: str = "inductor",
                 mode: str | None = None):
        if not widths or list(widths) != sorted(set(widths)) or widths[0] < 1:
            raise ValueError(f"widths: must be ascending distinct positive ints, got {widths!r}")
        problem = supports_static(model)
        if problem:
            raise ValueError(f"compile: the target has {problem}")
        _inductor_cache()
        # one graph per (bucket, capacity): more than dynamo's default of 8 per function before it falls back to eager
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.model, self.widths = model, tuple(widths)
        self.device = next(model.parameters()).device
        self.mode = mode or MODES.get(self.device.type, "default")
        self._compiled = torch.compile(model.forward, dynamic=False, fullgraph=False, backend=backend,
                                       mode=None if self.mode == "default" else self.mode)
        self.capacity = 0  # tokens: the largest request's, rounded up (see the module docstring)
        self.compile_s: dict[int, float] = {}  # first-call seconds per bucket (compile + run)
        self._cost = None

    @property
    def max_width(self) -> int:
        return self.widths[-1]

    def bucket(self, width: int) -> int:
        """The smallest bucket ``>= width``. Raises ``ValueError`` past the widest."""
        for b in self.widths:
            if b >= width:
                return b
        raise ValueError(f"width: {width} tokens is past the widest compiled forward ({self.max_width})")

    def new_cache(self, tokens: int) -> StaticKVCache:
        """A cache for a request of ``tokens`` positions (prompt + new tokens), with room for the widest forward, of
        the engine's capacity (grown to hold it)."""
        self.capacity = max(self.capacity, capacity_for(tokens + self.max_width))
        return StaticKVCache(self.model, self.capacity)

    def forward(self, cache: StaticKVCache, tokens: torch.Tensor, start: int, logits_to_keep: int) -> torch.Tensor:
        """Forward over ``tokens`` ``(1, q)`` at positions ``start .. start + q - 1``, appending exactly ``q`` entries
        to ``cache``. Returns logits ``(logits_to_keep, vocab)`` of the last ``logits_to_keep`` of the ``q``."""
        q = tokens.shape[1]
        if q > self.max_width:  # the prompt: eager, on the same cache
            positions = torch.arange(start, start + q, device=self.device).unsqueeze(0)
            out = self.model(input_ids=tokens, position_ids=positions, past_key_values=cache, use_cache=True,
                             logits_to_keep=logits_to_keep)
            return out.logits[0]
        b = self.bucket(q)
        if b > q:
            tokens = torch.cat([tokens, tokens[:, -1:].expand(1, b - q)], dim=1)
        positions = torch.arange(start, start + b, device=self.device).unsqueeze(0)
        first = b not in self.compile_s
        began = time.perf_counter()
        logits = self._compiled(input_ids=tokens, position_ids=positions, past_key_values=cache,
                                use_cache=True).logits[0, q - logits_to_keep: q]
        if first:
            self.compile_s[b] = time.perf_counter() - began
            log.info("compiled the width-%d verify forward in %.1f s", b, self.compile_s[b])
        if b > q:
            cache.crop(q - b)
        return logits

    def verify_cost(self):
        """The verify cost curve of these compiled forwards (a step per bucket), read from the user cache or
        measured once (:func:`toolkit.speculative.cost_model.load_or_measure`; measuring compiles every bucket)."""
        if self._cost is None:
            from toolkit.speculative.cost_model import load_or_measure

            self._cost = load_or_measure(self.model, self.max_width, engine=self)
        return self._cost

    def warm_up(self, tokens: int = 64) -> float:
        """Compile every bucket now for requests of ``tokens`` positions (prompt + new tokens: the capacity they
        get); returns the seconds it took (a few with inductor's on-disk cache warm, about a minute a graph cold)."""
        began = time.perf_counter()
        with torch.inference_mode():
            cache = self.new_cache(tokens)
            prompt = torch.randint(0, self.model.config.vocab_size, (1, self.max_width + 1),
                                   generator=torch.Generator().manual_seed(0)).to(self.device)
            self.forward(cache, prompt, 0, 1)
            for b in self.widths:
                self.forward(cache, prompt[:, :b], prompt.shape[1], b)
                cache.crop(-b)
        return time.perf_counter() - began


def compile_pays(target) -> bool:
    """Where compiling was measured to pay (``../shared/DESIGN.md``, cost model): on CUDA, and on CPU for torchao
    weights (int4 / int8 tensor subclasses: eager per-op overhead dominates); fp32 / bf16 / bitsandbytes weights on
    CPU are bytes-bound or opaque kernels, where compiling gained nothing."""
    params = list(target.parameters())
    if params[0].device.type == "cuda":
        return True
    return any(type(p.data).__module__.startswith("torchao") for p in params)


def engine_for(recipe, target, plan) -> tuple:
    """``(CompiledTarget or None, why)`` for a :class:`~toolkit.recipe.Recipe`'s ``compile`` and its
    :class:`~toolkit.session.Plan`: ``on`` compiles where the engine can hold the
    recipe (no KV policy, no token trees, full-attention layers); ``auto`` also needs :func:`compile_pays`."""
    mode = recipe.compile
    if mode == "off":
        return None, "eager (compile: off)"
    if mode == "auto" and not compile_pays(target):
        return None, (f"eager (compile: auto; {recipe.target.precision} weights on CPU are bytes-bound: compiling "
                      "was measured to gain nothing there)")
    why = ("a KV policy" if plan.target_policy is not None else "token trees" if recipe.spec.tree
           else supports_static(target))
    if why:
        return None, f"eager (compile: {mode}, but the static engine does not hold {why})"
    widest = max(plan.max_query_tokens, 2)  # AR: the width-2 graph only (a plain step, padded)
    widths = tuple(w for w in DEFAULT_WIDTHS if w < widest) + (widest,)
    return CompiledTarget(target, widths), f"compiled static engine (compile: {mode}; widths {widths})"
