"""The target's forward over the decoder's cache: eager, or compiled with ``torch.compile`` on the static cache.

A round's verify forward runs ``(B, W)`` tokens (``B`` rows, ``W`` = 1 + the draft tokens verified) through the HF
model on the cache's ``prepare(W)`` inputs and returns logits ``(B, W, vocab)``. On the static cache
(:class:`~toolkit.kv.static.StaticKV`) the forward may be compiled (gpt-fast's decode step; ``docs/design.md``,
"The static engine"); what a graph is specialised to depends on the device:

* **CPU** (inductor): one graph for single-token steps ``(1, 1)`` and one for verify forwards ``(1, W >= 2)`` with
  ``W`` a dynamic size, and the same two for ``B >= 2`` rows; the attended span of the cache is a dynamic size too.
  So a process compiles at most four graphs whatever the widths and lengths (about 90 s each cold on a 2-core
  machine, seconds from inductor's on-disk cache), and no forward is padded.
* **CUDA** (``mode="reduce-overhead"``: CUDA graphs): every shape is static — ``W`` is padded to the next of
  :attr:`TargetForward.widths` and ``B`` to the next of :attr:`TargetForward.batch_sizes` (padding rows are unused rows
  of the static cache), and the span is the whole cache. Inductor compiles the same graphs as on CPU (rows and width
  dynamic past 1: four per cache shape, the cache's buffers being static), and the CUDA graph trees record one CUDA
  graph per (batch bucket, width bucket) from them at its first call; the cost model's curve then has the buckets'
  steps, which the verify planner reads.

Eager forwards (no compile, or a cache that is not static) call the model as it is. A padded forward's extra positions
are never kept (the caller's :meth:`accept` counts only real tokens; padding rows are never accepted into). Token
trees run through the same graphs, on the static cache's tree inputs (:mod:`toolkit.kv.static_tree`).

Compiled code is cached on disk by inductor (``TORCHINDUCTOR_CACHE_DIR``, the toolkit's cache directory unless the user
set it), so a second process starts warm. A graph's first call compiles it: the engine logs one INFO line on the
``toolkit.engine`` logger before it (what is compiled, how long it may take) and one after (how long it took), and
adds the time to :attr:`TargetForward.compile_ms`, which the decoder keeps out of a generation's timings.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import time
import weakref

import torch

from toolkit.engine.guards import call_compiled, skip_guards_default
from toolkit.kv.attention import STATIC_NAME, attached
from toolkit.kv.window_prefill import WindowedPrompt
from toolkit.resources import inductor_cache
from toolkit.threads import warn_passive_wait

log = logging.getLogger("toolkit.engine")

#: CUDA graph buckets: verify widths and batch sizes a forward is padded up to
CUDA_WIDTHS = (1, 2, 4, 8, 16, 32, 64)
CUDA_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
#: compile modes: CPU -> inductor's default; CUDA -> CUDA graphs
MODES = {"cpu": "default", "cuda": "reduce-overhead"}
#: inductor options of ``compile: max`` on CPU: the weights frozen into the graph (torchao's int4 tensors are then
#: unpacked once, not flattened and checked at every call) and the graph's wrapper generated in C++ instead of
#: Python. Measured on the embedded int4 model, 2-core AVX2 CPU: a decode step 24.5 -> 19.5-21 ms (the Python
#: wrapper's per-kernel work and the subclass checks), but the first compile ~11 min instead of ~2.5 min and a warm
#: start from the on-disk cache ~75 s instead of ~20 s (frozen graphs are only partly cached) -- so opt-in
TUNED_CPU_OPTIONS = {"freezing": True, "cpp_wrapper": True}
#: inductor options of every CPU compile: no size / stride / alignment / scalar checks in the generated wrapper (they
#: only raise on a shape bug; the wrapper checks each of a decode step's ~211 int4 matmul outputs in Python).
#: Measured on the native int4 decode step, 2-core AMD EPYC, four alternating process pairs of 96-token AR
#: generations: target ms per round 10.4-10.9 -> 9.8-10.2 (paired 1.05-1.10x); cold compile unchanged (~70 s)
LEAN_CPU_OPTIONS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
#: what a graph's first compile takes (cold: inductor's on-disk cache does not hold it yet), for the log line
COLD_COMPILE = {"cpu": "about 20-100 s on a 2-core CPU", "cpu-tuned": "several minutes (compile: max)",
                "cuda": "tens of seconds"}


def bucketed(device: torch.device) -> bool:
    """Whether compiled forwards on ``device`` pad to static shapes (CUDA graphs: :data:`CUDA_WIDTHS` x
    :data:`CUDA_BATCH_SIZES`); on CPU widths and spans are dynamic sizes."""
    return device.type == "cuda"


def _graphs() -> int:
    """Graphs dynamo has compiled in this process (a call that raises it compiled; recompiles for a new cache shape
    included)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def model_kwargs(model, kwargs: dict) -> dict:
    """``kwargs`` with the cache under the name ``model.forward`` takes: ``cache`` from transformers 5.24 on (which
    warns about ``past_key_values``, a graph break inside a compiled region), ``past_key_values`` before."""
    if "past_key_values" in kwargs and _takes_cache(type(model)):
        kwargs = dict(kwargs)
        kwargs["cache"] = kwargs.pop("past_key_values")
    return kwargs


@functools.cache
def _takes_cache(model_class) -> bool:
    return "cache" in inspect.signature(model_class.forward).parameters


def _step(model, input_ids, position_ids, attention_mask, cache_kwargs: dict, hidden: tuple[int, ...] = ()):
    """One forward (the compiled region): logits ``(B, W, vocab)``, or with ``hidden`` (indices into HF's
    ``hidden_states``, see :func:`select_hidden`) ``(logits, features (B, W, F))``."""
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=True,
                output_hidden_states=bool(hidden), **cache_kwargs)
    return (out.logits, select_hidden(out, hidden)) if hidden else out.logits


# ---------------------------------------------------------------------------------- the target's hidden states
def select_hidden(out, hidden: tuple[int, ...]) -> torch.Tensor:
    """The hidden states a drafter reads from a forward's output (``output_hidden_states=True``): HF's
    ``hidden_states`` at the indices ``hidden`` (0 = the embeddings, ``i + 1`` = decoder layer ``i``'s output, the last
    = the final norm's output), concatenated on the last dimension: ``(B, W, len(hidden) * H)``. Inside the compiled
    graph the unused layers' outputs are dead code: returning features costs no extra compute. transformers collects
    them with hooks of its own, installed at the first forward that asks (the eager prefill: never inside a trace)."""
    states = out.hidden_states
    return states[hidden[0]] if len(hidden) == 1 else torch.cat([states[i] for i in hidden], dim=-1)


def _foreign(hook) -> bool:
    """A hook that is not transformers' own output capturing (installed once ``output_hidden_states`` was asked
    for; it records only when asked, and compiles as part of the model)."""
    return not getattr(getattr(hook, "__func__", hook), "__module__", "").startswith("transformers.")


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest of ``buckets`` (ascending) that holds ``n``. Raises ``ValueError`` past the largest."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} is past the largest bucket {buckets[-1]}")


class TargetForward:
    """The target's forward of the decoder (see the module docstring).

    Args:
        model: the HF causal LM (any weights: fp32, bf16, torchao int4/int8, bitsandbytes).
        compile: compile forwards on the static cache (``False``: always eager).
        backend / mode: ``torch.compile``'s (``eager`` traces without code generation: tests); ``mode`` defaults
            to :data:`MODES` for the model's device.
        buckets: pad to static shapes (default: on CUDA); ``False``: dynamic sizes (CPU).
        tuned: on CPU, compile with :data:`TUNED_CPU_OPTIONS` (the recipe's ``compile: max``).
        name: what the model is in log lines (``target``; ``draft`` for a draft model's forward, the same engine over
            the draft's own static cache).

    Attributes:
        compile_s: first-call seconds (compile + run) per graph key.
        compile_ms: milliseconds spent in calls that compiled (a graph's first call, a recompile for a new cache
            shape, a CUDA graph's capture), cumulative over the engine's life.
        static_span: whether static caches built for it must attend to every slot (bucketed shapes).
    """

    def __init__(self, model, compile: bool = False, backend: str = "inductor", mode: str | None = None,
                 buckets: bool | None = None, tuned: bool = False, name: str = "target"):
        self.model, self.name = model, name
        self.device = next(model.parameters()).device
        if self.device.type == "cpu":
            warn_passive_wait()
        self.buckets = bucketed(self.device) if buckets is None else buckets
        self.widths, self.batch_sizes = CUDA_WIDTHS, CUDA_BATCH_SIZES
        self.mode = mode or MODES.get(self.device.type, "default")
        self.compile_s: dict[tuple, float] = {}
        self.compile_ms = 0.0
        self.backend, self.tuned = backend, tuned
        self._compiled = None
        self._cache = None  # the last static cache built, reused by requests it can hold (addresses stay fixed)
        self._checked = weakref.WeakKeyDictionary()  # cache -> graph keys that ran on it once with every guard
        self.skip_guards = skip_guards_default()
        self._modules = None  # the model's modules, read for forward hooks (see _hooked)
        self._said_hooked = False
        if compile:
            inductor_cache()
            # one graph per shape key and cache capacity: more than dynamo's default of 8 per function
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            options = None
            if backend == "inductor" and self.mode == "default":
                options = LEAN_CPU_OPTIONS | (TUNED_CPU_OPTIONS if tuned else {})
            self._compiled = torch.compile(_step, dynamic=False, backend=backend, options=options,
                                           mode=None if self.mode == "default" else self.mode)

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    @property
    def static_span(self) -> bool:
        return self.compiled and self.buckets

    def width_for(self, width: int) -> int:
        """Tokens per row a forward of ``width`` really runs (its bucket when shapes are bucketed)."""
        return bucket(width, self.widths) if self.compiled and self.buckets else width

    def rows_for(self, rows: int, allocated: int) -> int:
        """Rows a forward over ``rows`` rows really runs (its bucket, within the cache's allocated rows)."""
        if self.compiled and self.buckets:
            return min(bucket(rows, self.batch_sizes), allocated)
        return rows

    def cache_for(self, policy, rows: int, capacity: int, widest: int, keep: bool = True):
        """The target's cache for ``rows`` rows of up to ``capacity`` positions and forwards of up to ``widest``
        tokens (:func:`toolkit.kv.rows.rows_cache`). A static cache is kept and reused by later calls it can hold
        (capacities only grow, so compiled graphs and captured CUDA graphs keep their buffers); with ``keep=False`` a
        cache built for this call is not kept (a one-off use whose size later requests should not inherit)."""
        from toolkit.kv.rows import rows_cache
        from toolkit.kv.static import StaticKV

        rows = self.rows_for(rows, self.batch_sizes[-1])
        cached = self._cache
        if cached is not None and cached.allocated >= rows and cached.policy is policy and cached.widest >= widest \
                and cached.fits(capacity):
            cached.keep_rows([])
            return cached
        if cached is not None and cached.policy is policy and cached.bounded:
            capacity = max(capacity, cached.capacity)
        cache = rows_cache(policy, self.model, rows, capacity, widest, static_span=self.static_span)
        if isinstance(cache, StaticKV) and keep:
            self._cache = cache
        return cache

    def attached(self):
        """The static engine's attention function on the model for a ``with`` block (see
        :func:`toolkit.kv.attention.static_attention`)."""
        return attached(self.model, STATIC_NAME)

    def prefill(self, input_ids: torch.Tensor, kwargs: dict, hidden: tuple[int, ...] = ()):
        """Eager forward of a prompt ``(1, n)`` on ``kwargs`` (a cache's ``begin_row``); logits ``(vocab,)`` of the
        last position, or with ``hidden`` ``(logits, features (1, n, F))`` (:func:`select_hidden`). A
        :class:`~toolkit.kv.window_prefill.WindowedPrompt` cache runs the prompt in its chunks."""
        cache = kwargs.get("past_key_values")
        if isinstance(cache, WindowedPrompt):
            return cache.prefill(lambda ids, chunk: self._prefill_once(ids, chunk, hidden), input_ids)
        return self._prefill_once(input_ids, kwargs, hidden)

    def _prefill_once(self, input_ids: torch.Tensor, kwargs: dict, hidden: tuple[int, ...]):
        out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1, output_hidden_states=bool(hidden),
                         **model_kwargs(self.model, kwargs))
        return (out.logits[0, -1], select_hidden(out, hidden)) if hidden else out.logits[0, -1]

    def __call__(self, cache, input_ids: torch.Tensor, hidden: tuple[int, ...] = (), tree=None):
        """Forward over ``input_ids`` ``(B, W)`` appending ``W`` tokens to each of the cache's ``B`` rows; returns
        logits ``(B, W, vocab)``, or with ``hidden`` (indices into HF's ``hidden_states``: what a drafter reading the
        target's features asked for, :func:`select_hidden`) ``(logits, features (B, W, F))`` from the same graph.
        ``tree``: a token tree's region on row 0 (:class:`~toolkit.kv.static_tree.TreeInputs`). Compiled where the
        cache is static and compiling is on (padded to buckets where shapes are bucketed; the padding is cut from the
        outputs), else eager."""
        rows, width = input_ids.shape
        if not (self.compiled and getattr(cache, "static", False)) or self._hooked():
            kwargs = cache.prepare(width) if tree is None else cache.prepare_tree(tree, width)
            out = self.model(input_ids=input_ids, use_cache=True, output_hidden_states=bool(hidden),
                             **model_kwargs(self.model, kwargs))
            return (out.logits, select_hidden(out, hidden)) if hidden else out.logits
        run_rows, run_width = self.rows_for(rows, cache.allocated), self.width_for(width)
        if (run_rows, run_width) != (rows, width):
            padded = input_ids.new_zeros(run_rows, run_width)
            padded[:rows, :width] = input_ids
            padded[:rows, width:] = input_ids[:, -1:]
            input_ids = padded
        kwargs = cache.prepare(run_width, range(run_rows)) if tree is None else cache.prepare_tree(tree, run_width)
        kwargs["position_ids"] = kwargs["position_ids"].clone()  # not the write index (a chain's): a tree's is not
        self._mark_dynamic(input_ids, kwargs, cache, span=not self.buckets and cache.dynamic_span)
        key = (run_rows if self.buckets else min(run_rows, 2), run_width if self.buckets else min(run_width, 2))
        key += (hidden,) if hidden else ()  # a graph returning features is a graph of its own
        first = key not in self._checked.get(cache, ())  # this graph on this cache: guards not yet run in full
        new_key, graphs = key not in self.compile_s, _graphs()
        if new_key:
            self._announce(key)
        began = time.perf_counter()
        if self.device.type == "cuda" and self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # the previous round's outputs were consumed
        args = (self.model, input_ids, kwargs["position_ids"], kwargs["attention_mask"],
                model_kwargs(self.model, {"past_key_values": kwargs["past_key_values"]}), hidden)
        out = self._run(args, first)
        self._checked.setdefault(cache, set()).add(key)
        if new_key or _graphs() != graphs:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - began
            self.compile_ms += seconds * 1000
            self.compile_s.setdefault(key, seconds)
            what = "compiled" if new_key else "recompiled (a new cache shape)"
            log.info("%s the %s's %s forward in %.1f s", what, self.name, self._shape(key), seconds)
        return (out[0][:rows, :width], out[1][:rows, :width]) if hidden else out[:rows, :width]

    def _shape(self, key: tuple) -> str:
        """A graph key in words: rows x width, ``2+`` where the size is dynamic past 1 (unbucketed shapes)."""
        shape = "x".join(str(n) if self.buckets or n == 1 else "2+" for n in key[:2]) + " (rows x tokens)"
        return shape + (" with hidden states" if len(key) > 2 else "")

    def _announce(self, key: tuple) -> None:
        """The INFO line before a graph's first call: what is compiled and what it may take."""
        if self.backend != "inductor":
            expected = f"seconds ({self.backend} backend)"
        else:
            kind = "cpu-tuned" if self.tuned and self.device.type == "cpu" else self.device.type
            expected = COLD_COMPILE.get(kind, "minutes")
        log.info("compiling the %s's %s forward with torch.compile: %s the first time on this machine, seconds "
                 "once inductor's on-disk cache (%s) holds it; SpeculativeLM.warm_up() compiles before timing",
                 self.name, self._shape(key), expected, os.environ.get("TORCHINDUCTOR_CACHE_DIR", "inductor's default"))

    def _hooked(self) -> bool:
        """Whether a forward hook is on the model (a user's: drafters read features without any): such forwards run
        eager. A graph traced without the hook would not call it (and the guards that notice are the ones skipped)."""
        if self._modules is None:
            self._modules = list(self.model.modules())
        from torch.nn.modules import module as nn_module

        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return True
        hooked = any(_foreign(h) for m in self._modules if m._forward_hooks or m._forward_pre_hooks
                     for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values()))
        if hooked and not self._said_hooked:
            self._said_hooked = True
            log.info("forward hooks on the target: its forwards run eager")
        return hooked

    def _run(self, args: tuple, first: bool) -> torch.Tensor:
        """Call the compiled forward; the first call of a graph on a new cache runs every guard, later ones only
        those that tell the compiled graphs apart (:mod:`toolkit.engine.guards`)."""
        return call_compiled(self._compiled, args, full_guards=first or not self.skip_guards)

    @staticmethod
    def _mark_dynamic(input_ids, kwargs: dict, cache, span: bool) -> None:
        """The rows and width where they exceed 1 (sizes of 1 get graphs of their own), and on CPU the span: inductor
        then compiles at most four graphs. With CUDA graphs the span is the whole cache, and each bucket is a
        shape of its own that the CUDA graph trees record once from the same compiled code (a capture, not a
        compile: seconds in all instead of a compile per bucket)."""
        masks, indices = cache.dynamic_inputs()
        if span and cache.attention_mask is not None:  # the plain layers' span (tiers and rings: static spans)
            torch._dynamo.mark_dynamic(cache.attention_mask, 3)
        rows, width = input_ids.shape
        for tensor in (input_ids, kwargs["position_ids"], *indices):
            if width > 1:
                torch._dynamo.mark_dynamic(tensor, 1)
            if rows > 1:
                torch._dynamo.mark_dynamic(tensor, 0)
        if rows > 1:
            torch._dynamo.mark_dynamic(cache.row_index, 0)
        for mask in masks:
            if width > 1:
                torch._dynamo.mark_dynamic(mask, 2)
            if rows > 1:
                torch._dynamo.mark_dynamic(mask, 0)

    def warm_up(self, cache_factory, widths: tuple[int, ...] = (1, 2), rows: tuple[int, ...] = (1,),
                hidden: tuple[int, ...] = ()) -> float:
        """Compile now the graphs forwards of ``widths`` x ``rows`` use (returning the hidden states ``hidden`` too:
        an EAGLE drafter's), on a scratch cache from ``cache_factory(rows)``; returns the seconds it took (seconds
        from inductor's cache, minutes cold)."""
        began = time.perf_counter()
        with torch.inference_mode(), self.attached():
            for r in rows:
                cache = cache_factory(r)
                prompt = torch.zeros(1, 8, dtype=torch.long, device=self.device)
                for _ in range(r):
                    prefilled, kwargs = cache.begin_row(8)
                    self.prefill(prompt, kwargs, hidden)
                    cache.add_row(prefilled, 8)
                for w in widths:
                    self(cache, torch.zeros(r, w, dtype=torch.long, device=self.device), hidden)
        return time.perf_counter() - began


def compile_pays(target) -> bool:
    """Where compiling was measured to pay (``docs/design.md``, "Cost model of a 2-core CPU"): on CUDA, and on CPU
    for every weight format but two. torchao's int4 / int8 tensor subclasses and a GGUF's native blocks
    (:class:`~toolkit.quant.int4_linear.PackedInt4Linear`), where eager per-op overhead dominates, ~1.5x; fp32 / bf16
    / fp16 weights since the engine attends a dynamic span with lean inductor options: one-token steps 1.32x / 1.34x
    / 1.09x eager on a 2-core AVX-512 Xeon (2026-11-29; the matmuls stay ATen's, the rest fuses). Not bitsandbytes'
    weights (opaque kernels that graph-break), nor weights that compile wrongly (:func:`~toolkit.engine.capabilities.
    compile_breaks`)."""
    from toolkit.engine.capabilities import compile_breaks

    if compile_breaks(target):
        return False
    params = list(target.parameters())
    if params[0].device.type == "cuda":
        return True
    return not any(type(p).__module__.startswith("bitsandbytes") or type(p.data).__module__.startswith("bitsandbytes")
                   for p in params)


def forward_for(recipe, target, plan, caps=None) -> tuple[TargetForward, str]:
    """``(TargetForward, why)`` for a :class:`~toolkit.recipe.Recipe`'s ``compile`` field on ``target``, as its
    :class:`~toolkit.engine.capabilities.Capabilities` ``caps`` say (worked out from ``plan`` when not given):
    ``on`` compiles where the static cache holds the recipe (every KV policy has a static form; full-attention and
    sliding-window layers; token trees too, within the widest CUDA graph bucket); ``auto`` also needs
    :func:`compile_pays`; ``max`` is ``on`` with :data:`TUNED_CPU_OPTIONS` on CPU."""
    from toolkit.engine.capabilities import capabilities
    from toolkit.models.loading import kernels_note, weights_note

    caps = caps if caps is not None else capabilities(plan, target)
    if caps.compile:
        return TargetForward(target), f"eager ({caps.compile}){kernels_note(target)}{caps.draft_note()}"
    mode = recipe.compile
    engine = TargetForward(target, compile=True, tuned=mode == "max")
    shapes = "bucketed widths and batch sizes, CUDA graphs" if engine.buckets else "dynamic widths and spans"
    if mode == "max" and not engine.buckets:
        shapes += ", frozen weights, C++ wrapper"
    weights = f"{weights_note(target)} weights{kernels_note(target)}"
    why = f"compiled static engine (compile: {mode}; {shapes}; {weights})"
    return engine, why + caps.draft_note()
