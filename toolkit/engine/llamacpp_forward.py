"""llama.cpp as the target forward of the one decoder (``target.backend: llama.cpp``; llama-cpp-python's low-level
API): the same calls as :class:`toolkit.engine.forward.TargetForward`, on :class:`toolkit.kv.llamacpp_cache.
LlamaCppCache`.

* **verify** — one ``llama_decode`` of the round's ``W`` tokens ([last committed token, drafts]) at the next
  positions of sequence 0, every position flagged for logits; ``llama_get_logits`` then holds ``(W, vocab)`` fp32
  logits in host memory, copied once into a torch tensor ``(1, W, vocab)``. The decoder's accept step reads them on
  the CPU, so a round still has one host sync (there is no device here: the logits are host memory already).
* **rollback** — ``llama_memory_seq_rm`` past the kept tokens (the cache's ``accept``).
* **prefill** — the prompt in ``llama_decode`` calls of up to :data:`~toolkit.models.llamacpp.N_BATCH` tokens,
  logits of the last position only.

Greedy and sampling stay lossless: the target distribution is llama.cpp's logits, which the decoder's accept step
(:mod:`toolkit.engine.accept`) treats like any target's. Batched verify (``W`` positions in one ``llama_decode``) runs
the same ggml kernels over more rows as a one-token step; ``tests/test_llamacpp_backend.py`` checks that greedy output
equals llama.cpp's own one-token-at-a-time greedy decoding on the same file.

One row: llama.cpp's sequences could hold a batch (``seq_id`` per row), but its KV cells of several sequences share
one buffer and the decoder's per-row rollback would need a sequence each; the plan refuses ``batch_size > 1``
(:func:`check_plan`). No compiled graphs (``compiled`` is False): llama.cpp has no warm-up beyond loading.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
import weakref

import numpy as np
import torch

from toolkit.errors import ConfigError
from toolkit.kv.llamacpp_cache import LlamaCppCache, LlamaCppForm, bytes_per_token, llamacpp_form
from toolkit.kv.static import CAPACITY_STEP
from toolkit.models.llamacpp import LLAMACPP, N_BATCH
from toolkit.threads import warn_passive_wait


class LlamaCppForward:
    """The decoder's target forward on llama.cpp (see the module docstring).

    Args:
        target: the :class:`~toolkit.models.llamacpp.LlamaCppTarget`.
        policy: the target's KV policy (its :func:`~toolkit.kv.llamacpp_cache.llamacpp_form` picks the context's
            cache types and StreamingLLM's shift).

    Attributes:
        llama: the ``llama_cpp.Llama`` (model + context) the forwards run on.
        compile_ms / compiled / buckets: ``0.0`` / ``False`` / ``False`` (the decoder's bookkeeping of graphs).
    """

    compiled = False
    buckets = False
    static_span = False
    tuned = False
    backend = None  # no torch.compile backend: nothing here compiles (a torch draft beside it runs eager)

    def __init__(self, target, policy=None):
        import llama_cpp

        self.model, self.llama_cpp = target, llama_cpp
        warn_passive_wait()  # ggml's per-operation barriers are OpenMP barriers
        self.form: LlamaCppForm = llamacpp_form(policy)
        self.llama = target.context(self.form.type_k, self.form.type_v)
        self.device = torch.device("cpu")
        self.n_vocab = int(self.llama.n_vocab())
        self.compile_ms = 0.0
        self.widths = (N_BATCH,)
        self._token_bytes = bytes_per_token(target.config, self.form)
        self._row_types: dict[int, type] = {}  # rows -> ctypes array type of (rows, vocab) floats (see _logits)
        self._batch = llama_cpp.llama_batch_init(N_BATCH, 0, 1)
        # freed with the forward, or at exit while llama_cpp is still whole (a __del__ there would find it torn down)
        weakref.finalize(self, llama_cpp.llama_batch_free, self._batch)

    @property
    def cost_tag(self) -> str:
        """What the verify cost curve depends on besides the model's config (:func:`toolkit.engine.cost.
        load_or_measure`'s key): the file, llama.cpp's version, threads and cache types."""
        path = self.model.gguf_path
        return (f"{LLAMACPP}|{self.llama_cpp.__version__}|{path.resolve()}|{path.stat().st_size}|"
                f"{self.model.threads}|{self.form.type_k}|{self.form.type_v}")

    def width_for(self, width: int) -> int:
        return width

    def rows_for(self, rows: int, allocated: int) -> int:
        return rows

    def cache_for(self, policy, rows: int, capacity: int, widest: int, keep: bool = True) -> LlamaCppCache:
        """A cache on this forward's context (``policy`` only decides StreamingLLM's shift: ``None`` for the cost
        curve's measurement). Raises :class:`ConfigError` naming ``batch_size`` for ``rows > 1`` and
        ``generation.max_new_tokens`` for a request past the context."""
        if rows > 1:
            raise ConfigError("batch_size", "target.backend llama.cpp decodes one sequence at a time", [1])
        form = self.form if policy is not None else LlamaCppForm(self.form.type_k, self.form.type_v)
        if not form.shifts and capacity - CAPACITY_STEP >= self.model.n_ctx:  # rounded up: certainly too long
            raise ConfigError("generation.max_new_tokens", f"the request needs {capacity} positions, more than "
                              f"the llama.cpp context of {self.model.n_ctx}")
        return LlamaCppCache(self.llama, form, self._token_bytes)

    def attached(self):
        return contextlib.nullcontext()

    def _decode(self, tokens: list[int], start: int, all_logits: bool) -> None:
        """One ``llama_decode`` of ``tokens`` at positions ``start ..`` of sequence 0 (logits at every position, or
        the last). Raises ``RuntimeError`` when llama.cpp fails (a full context: code 1)."""
        batch = self._batch
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = all_logits
        batch.logits[len(tokens) - 1] = True
        batch.n_tokens = len(tokens)
        code = self.llama_cpp.llama_decode(self.llama.ctx, batch)
        if code != 0:
            why = "the context is full" if code == 1 else "see llama.cpp's log"
            raise RuntimeError(f"llama_decode returned {code} at position {start} ({why}; context of "
                               f"{self.model.n_ctx} tokens)")

    def _logits(self, rows: int) -> np.ndarray:
        """The last decode's ``rows`` output rows of logits, copied (the buffer is llama.cpp's and the next decode
        overwrites it): ``(rows, vocab)`` fp32 in NumPy, which the callers hand to torch in the shape they return. The
        view goes through a ctypes array type made once per row count (``np.ctypeslib.as_array`` makes a new type
        every call: median 87 against 67 us inside the decode loop on the 2-core AVX2 EPYC, where this is the first
        host work after a decode has flushed the caches; the copy ~32 us)."""
        array = self._row_types.get(rows)
        if array is None:
            array = self._row_types[rows] = ctypes.c_float * (rows * self.n_vocab)
        pointer = self.llama_cpp.llama_get_logits(self.llama.ctx)
        view = np.frombuffer(array.from_address(ctypes.addressof(pointer.contents)), dtype=np.float32)
        return view.reshape(rows, self.n_vocab).copy()

    def prefill(self, input_ids: torch.Tensor, kwargs: dict, hidden: tuple[int, ...] = ()) -> torch.Tensor:
        """The prompt ``(1, n)`` into the cache of ``kwargs`` (a cache's ``begin_row``), in chunks of
        :data:`N_BATCH`; logits ``(vocab,)`` of its last position. ``hidden`` (features a drafter reads) must be
        empty: llama.cpp hands out no hidden states (:func:`check_plan` refuses EAGLE heads)."""
        _no_features(hidden)
        cache: LlamaCppCache = kwargs["llama_cache"]
        ids = input_ids[0].tolist()
        for start in range(0, len(ids), N_BATCH):
            chunk = ids[start:start + N_BATCH]
            self._decode(chunk, cache.held, all_logits=False)
            cache.written(len(chunk))
        cache.written(0)  # the prompt is kept whole (add_row sets the length)
        return torch.from_numpy(self._logits(1)[0])

    def __call__(self, cache: LlamaCppCache, input_ids: torch.Tensor, hidden: tuple[int, ...] = ()) -> torch.Tensor:
        """Verify forward: ``input_ids`` ``(1, W)`` appended to the cache's sequence; logits ``(1, W, vocab)``.
        Raises ``ValueError`` for ``B > 1``, ``W >`` :data:`N_BATCH` or features asked for (``hidden``)."""
        _no_features(hidden)
        rows, width = input_ids.shape
        if rows != 1 or width > N_BATCH:
            raise ValueError(f"input_ids: a llama.cpp forward takes (1, <= {N_BATCH}) tokens, got "
                             f"{tuple(input_ids.shape)}")
        self._decode(input_ids[0].tolist(), cache.held, all_logits=True)
        cache.written(width)
        return torch.from_numpy(self._logits(width).reshape(1, width, self.n_vocab))

    def warm_up(self, cache_factory, widths: tuple[int, ...] = (1, 2), rows: tuple[int, ...] = (1,)) -> float:
        """One prefill and a forward of each width on a scratch cache (llama.cpp compiles nothing; this touches the
        mapped weights and the compute buffers); returns the seconds it took."""
        began = time.perf_counter()
        cache = cache_factory(1)
        prefilled, kwargs = cache.begin_row(8)
        self.prefill(torch.zeros(1, 8, dtype=torch.long), kwargs)
        cache.add_row(prefilled, 8)
        for w in widths:
            self(cache, torch.zeros(1, w, dtype=torch.long))
            cache.accept(None, [0])
        cache.keep_rows([])
        return time.perf_counter() - began


def _no_features(hidden: tuple[int, ...]) -> None:
    if hidden:
        raise ValueError("hidden: a llama.cpp target forward returns logits only (no hidden states for a drafter)")


def check_plan(recipe, policies: dict) -> None:
    """What a recipe may combine with ``target.backend: llama.cpp`` (called by :func:`toolkit.session.plan`).

    Raises:
        ConfigError: the KV policy has no llama.cpp form (``kv.policy`` or the field), an EAGLE head (it reads the
            target's hidden states, which llama.cpp does not hand out: ``spec.drafter``), token trees
            (``spec.tree``), or ``batch_size > 1``.
    """
    from toolkit.speculative.drafters.registry import DRAFT_EAGLE_HEAD

    llamacpp_form(policies["kv"], "kv")
    if recipe.spec.config.draft == DRAFT_EAGLE_HEAD:
        raise ConfigError("spec.drafter", "an EAGLE head drafts from the target's hidden states, which a llama.cpp "
                          "target does not expose; use a draft model (it runs on torch beside it), lookup, suffix or "
                          "ngram", ["lookup", "suffix", "ngram", "draft_model", "self"])
    if recipe.spec.tree:
        raise ConfigError("spec.tree", "token trees need a tree attention mask, which the llama.cpp target forward "
                          "does not take; verify chains", [False])
    if recipe.batch_size not in (None, 1):
        raise ConfigError("batch_size", "target.backend llama.cpp decodes one sequence at a time", [1])


def forward_for(recipe, target, plan) -> tuple[LlamaCppForward, str]:
    """``(LlamaCppForward, why)`` for a llama.cpp target (the ``compile`` field does not apply: nothing compiles)."""
    engine = LlamaCppForward(target, plan.target_policy)
    form = engine.form
    kv = f"KV {form.type_k}/{form.type_v}" + (f", context shift keeping {form.n_keep}" if form.shifts else "")
    return engine, f"llama.cpp target forward ({target.describe()}; {kv}; compile does not apply)"
