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
* **features for an EAGLE-1 head** — the head reads the target's last layer after the final norm, which is what
  llama.cpp's embeddings output is (pooling none: one ``n_embd`` row per output position, ``llama_get_embeddings``).
  With such a head the context is made with embeddings on, and each verify forward returns ``(logits, features
  (1, W, H))`` from the same decode; the prefill then flags every prompt position as an output (the head needs
  every position's feature), so llama.cpp also runs the LM head over the prompt. An EAGLE-3 head reads three
  intermediate layers, which llama.cpp's API does not return: :func:`check_head` refuses it.

Greedy and sampling stay lossless: the target distribution is llama.cpp's logits, which the decoder's accept step
(:mod:`toolkit.engine.accept`) treats like any target's. Batched verify (``W`` positions in one ``llama_decode``) runs
the same ggml kernels over more rows as a one-token step: with flash attention (every context here,
:func:`toolkit.models.llamacpp.cache_kwargs`) its logits equal ``W`` one-token steps' bit for bit on Q4_0 / Q4_1 /
Q8_0 files (a q8_0 cache at any length, the f16 cache up to 256 positions), so greedy output equals llama.cpp's own
one-token-at-a-time greedy decoding on the same file (``tests/test_llamacpp_backend.py``); past that, and in Q4_K's
repacked batched kernels (from 4 rows), sums run in another order and texts can part at near-ties.

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
from toolkit.models.llamacpp import FLASH_ATTN, LLAMACPP, N_BATCH
from toolkit.threads import warn_passive_wait

#: the hidden states llama.cpp hands out (``hidden_states[-1]`` in HF's indexing: the final norm's output, what an
#: EAGLE-1 head reads; :func:`toolkit.eagle.features.hidden_indices`)
FINAL_NORM = (-1,)


class LlamaCppForward:
    """The decoder's target forward on llama.cpp (see the module docstring).

    Args:
        target: the :class:`~toolkit.models.llamacpp.LlamaCppTarget`.
        policy: the target's KV policy (its :func:`~toolkit.kv.llamacpp_cache.llamacpp_form` picks the context's
            cache types and StreamingLLM's shift).
        features: the hidden states the recipe's drafter reads: ``()`` or :data:`FINAL_NORM` (an EAGLE-1 head: the
            context then hands out llama.cpp's embeddings, each output position's final-norm hidden state).

    Raises:
        ValueError: ``features`` llama.cpp cannot give (:func:`check_head` refuses such a head first).

    Attributes:
        llama: the ``llama_cpp.Llama`` (model + context) the forwards run on.
        compile_ms / compiled / buckets: ``0.0`` / ``False`` / ``False`` (the decoder's bookkeeping of graphs).
    """

    compiled = False
    #: llama.cpp grows its logits buffer on the first decode with more output rows than any before it, and that
    #: decode costs ~2x (233 against 113 ms at 16 rows of Gemma 3's 262,144-token vocabulary, 2-core AVX2 EPYC):
    #: :meth:`toolkit.SpeculativeLM.warm_up` runs the widest verify once (:meth:`warm_up`), before any timed call
    grows_outputs = True
    buckets = False
    static_span = False
    tuned = False
    backend = None  # no torch.compile backend: nothing here compiles (a torch draft beside it runs eager)

    def __init__(self, target, policy=None, features: tuple[int, ...] = ()):
        import llama_cpp

        if features not in ((), FINAL_NORM):
            raise ValueError(f"features: llama.cpp hands out {FINAL_NORM} (the final norm's output) or nothing, not "
                             f"{features} (load_head refuses such a head: check_head)")
        self.model, self.llama_cpp, self.features = target, llama_cpp, features
        warn_passive_wait()  # ggml's per-operation barriers are OpenMP barriers
        self.form: LlamaCppForm = llamacpp_form(policy)
        self.llama = target.context(self.form.type_k, self.form.type_v, embeddings=bool(features))
        self.device = torch.device("cpu")
        self.n_vocab, self.n_embd = int(self.llama.n_vocab()), int(self.llama.n_embd())
        self.compile_ms = 0.0
        self.widths = (N_BATCH,)
        self._token_bytes = bytes_per_token(target.config, self.form)
        self._row_types: dict[int, type] = {}  # floats -> ctypes array type of as many (see _host)
        self._batch = llama_cpp.llama_batch_init(N_BATCH, 0, 1)
        # freed with the forward, or at exit while llama_cpp is still whole (a __del__ there would find it torn down)
        weakref.finalize(self, llama_cpp.llama_batch_free, self._batch)

    @property
    def cost_tag(self) -> str:
        """What the verify cost curve depends on besides the model's config (:func:`toolkit.engine.cost.
        load_or_measure`'s key): the file, llama.cpp's version, threads, cache types and whether flash attention runs
        (:data:`~toolkit.models.llamacpp.FLASH_ATTN`; curves were first cached without it)."""
        path = self.model.gguf_path
        return (f"{LLAMACPP}|{self.llama_cpp.__version__}|{path.resolve()}|{path.stat().st_size}|"
                f"{self.model.threads}|{self.form.type_k}|{self.form.type_v}" + ("|flash-attn" if FLASH_ATTN else ""))

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
        """The last decode's ``rows`` output rows of logits: ``(rows, vocab)`` fp32 in NumPy (:meth:`_host`)."""
        return self._host(self.llama_cpp.llama_get_logits(self.llama.ctx), rows, self.n_vocab)

    def _host(self, pointer, rows: int, width: int) -> np.ndarray:
        """``(rows, width)`` floats of llama.cpp's output buffer at ``pointer``, copied (the next decode overwrites
        it), which the callers hand to torch in the shape they return. The view goes through a ctypes array type made
        once per size (``np.ctypeslib.as_array`` makes a new type every call: median 87 against 67 us inside the
        decode loop on the 2-core AVX2 EPYC, where this is the first host work after a decode has flushed the caches;
        the copy ~32 us)."""
        array = self._row_types.get(rows * width)
        if array is None:
            array = self._row_types[rows * width] = ctypes.c_float * (rows * width)
        view = np.frombuffer(array.from_address(ctypes.addressof(pointer.contents)), dtype=np.float32)
        return view.reshape(rows, width).copy()

    def _features(self, rows: int) -> torch.Tensor:
        """The last decode's ``rows`` output positions' final-norm hidden states ``(1, rows, H)`` (llama.cpp's
        embeddings output, pooling none)."""
        pointer = self.llama_cpp.llama_get_embeddings(self.llama.ctx)
        return torch.from_numpy(self._host(pointer, rows, self.n_embd)).unsqueeze(0)

    def prefill(self, input_ids: torch.Tensor, kwargs: dict, hidden: tuple[int, ...] = ()):
        """The prompt ``(1, n)`` into the cache of ``kwargs`` (a cache's ``begin_row``), in chunks of
        :data:`N_BATCH`; logits ``(vocab,)`` of its last position, or with ``hidden`` (:data:`FINAL_NORM`, what this
        forward was made with) ``(logits, features (1, n, H))``: every position is then an output, so llama.cpp also
        runs the LM head over the whole prompt. Raises ``ValueError`` for other ``hidden``."""
        self._check_features(hidden)
        cache: LlamaCppCache = kwargs["llama_cache"]
        ids, features = input_ids[0].tolist(), []
        for start in range(0, len(ids), N_BATCH):
            chunk = ids[start:start + N_BATCH]
            self._decode(chunk, cache.held, all_logits=bool(hidden))
            if hidden:
                features.append(self._features(len(chunk)))
            cache.written(len(chunk))
        cache.written(0)  # the prompt is kept whole (add_row sets the length)
        last = self.llama_cpp.llama_get_logits_ith(self.llama.ctx, -1)
        logits = torch.from_numpy(self._host(last, 1, self.n_vocab)[0])
        return (logits, torch.cat(features, dim=1)) if hidden else logits

    def __call__(self, cache: LlamaCppCache, input_ids: torch.Tensor, hidden: tuple[int, ...] = ()):
        """Verify forward: ``input_ids`` ``(1, W)`` appended to the cache's sequence; logits ``(1, W, vocab)``, or
        with ``hidden`` ``(logits, features (1, W, H))`` from the same decode. Raises ``ValueError`` for ``B > 1``,
        ``W >`` :data:`N_BATCH` or ``hidden`` other than this forward's features."""
        self._check_features(hidden)
        rows, width = input_ids.shape
        if rows != 1 or width > N_BATCH:
            raise ValueError(f"input_ids: a llama.cpp forward takes (1, <= {N_BATCH}) tokens, got "
                             f"{tuple(input_ids.shape)}")
        self._decode(input_ids[0].tolist(), cache.held, all_logits=True)
        cache.written(width)
        logits = torch.from_numpy(self._logits(width).reshape(1, width, self.n_vocab))
        return (logits, self._features(width)) if hidden else logits

    def _check_features(self, hidden: tuple[int, ...]) -> None:
        if hidden and hidden != self.features:
            raise ValueError(f"hidden: this llama.cpp forward hands out {self.features or 'no hidden states'} "
                             f"(its context was made for them), not {hidden}")

    def warm_up(self, cache_factory, widths: tuple[int, ...] = (1, 2), rows: tuple[int, ...] = (1,),
                features: tuple[int, ...] = ()) -> float:
        """One prefill and a forward of each width on a scratch cache (llama.cpp compiles nothing; this touches the
        mapped weights and grows the logits buffer to the widest forward's rows: :attr:`grows_outputs`); returns the
        seconds it took. ``rows`` and ``features`` are the compiled forwards' arguments (one row here; a forward made
        for an EAGLE head's features hands them out from every decode)."""
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


def check_plan(recipe, policies: dict) -> None:
    """What a recipe may combine with ``target.backend: llama.cpp`` (called by :func:`toolkit.session.plan`).

    Raises:
        ConfigError: the KV policy has no llama.cpp form (``kv.policy`` or the field), token trees (``spec.tree``),
            or ``batch_size > 1``. (An EAGLE head is checked when it is loaded: :func:`check_head`.)
    """
    llamacpp_form(policies["kv"], "kv")
    if recipe.spec.tree:
        raise ConfigError("spec.tree", "token trees need a tree attention mask, which the llama.cpp target forward "
                          "does not take; verify chains", [False])
    if recipe.batch_size not in (None, 1):
        raise ConfigError("batch_size", "target.backend llama.cpp decodes one sequence at a time", [1])


def check_head(target, head, field: str = "draft.source") -> None:
    """Whether an EAGLE ``head`` can draft beside llama.cpp ``target``: it must read what llama.cpp hands out, the
    final norm's output (:data:`FINAL_NORM`: an EAGLE-1 head). :func:`toolkit.eagle.checkpoint.load_head` calls it.

    Raises:
        ConfigError: naming ``field``: a head reading other layers (EAGLE-3's three intermediate layers, which ggml
            computes but llama.cpp's API does not return).
    """
    from toolkit.eagle.features import hidden_indices

    if hidden_indices(target, head.config.feature_layers) != FINAL_NORM:
        raise ConfigError(field, f"this {head.config.variant} head reads the target's layers "
                          f"{list(head.config.feature_layers)}; a llama.cpp target hands out only the final norm's "
                          "output (its embeddings), which an EAGLE-1 head reads",
                          ["an EAGLE-1 head (feature_layers [-1])"])


def forward_for(recipe, target, plan, features: tuple[int, ...] = ()) -> tuple[LlamaCppForward, str]:
    """``(LlamaCppForward, why)`` for a llama.cpp target (the ``compile`` field does not apply: nothing compiles);
    ``features``: the hidden states the recipe's drafter reads (``()`` or :data:`FINAL_NORM`)."""
    engine = LlamaCppForward(target, plan.target_policy, features)
    form = engine.form
    kv = f"KV {form.type_k}/{form.type_v}" + (f", context shift keeping {form.n_keep}" if form.shifts else "")
    embeddings = "; with its embeddings for the EAGLE head" if features else ""
    return engine, f"llama.cpp target forward ({target.describe()}; {kv}{embeddings}; compile does not apply)"
