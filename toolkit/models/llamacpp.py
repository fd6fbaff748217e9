"""A GGUF target on llama.cpp (``target.backend: llama.cpp``): the file's own weights on ggml's CPU kernels, driven by
the toolkit's decoder through :mod:`toolkit.engine.llamacpp_forward`.

What is loaded, and why so little on the torch side:

* **llama.cpp** (llama-cpp-python, the optional extra ``[llamacpp]``, ``make llamacpp``) loads the GGUF file itself,
  memory-mapped, and holds the KV cache; every target forward runs there.
* **torch / transformers** load no weights at all: the config, the generation config and the tokenizer are read from
  the GGUF's metadata (transformers' GGUF reader, ``gguf_file=``) once and cached as a metadata-only directory
  (``<cache_dir>/<name>-meta``: ``config.json``, ``generation_config.json``, tokenizer files; no weights), through
  the same locked, manifest-checked conversion as the dequantized copies (:func:`toolkit.models.embedded.
  convert_gguf`). The tokenizer is the one the torch path uses for the same file (identical vocabulary and chat
  template), so prompts encode to the same ids on both backends.

:class:`LlamaCppTarget` stands where the decoder, the request checks and the reports expect the target model: it is
a :class:`torch.nn.Module` with the HF ``config`` and ``generation_config``, one empty CPU parameter (the device the
decoder's tensors live on) and ``toolkit_weight_bytes`` (the GGUF file's size). It has no torch forward: calling it
raises, so nothing can silently run a torch path on it (the HF baselines). An EAGLE-1 head runs beside it on torch:
its features are llama.cpp's embeddings output (the final norm's hidden state per position) and its token embedding
and LM head rows are the torch path's modules of the same file (:meth:`LlamaCppTarget.shared_modules`).

llama.cpp contexts (KV cache types and flash attention are fixed when a context is created) are made on demand per
setting (:meth:`LlamaCppTarget.context`): the weights are memory-mapped once and shared by every context.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import weakref
from pathlib import Path

import torch

from toolkit.errors import ConfigError, ModelLoadError

log = logging.getLogger("toolkit.models")

#: the ``target.backend`` value of this backend (``toolkit.quant.llamacpp`` registers it)
LLAMACPP = "llama.cpp"
#: the Python package of the optional extra ``[llamacpp]``
PACKAGE = "llama_cpp"
#: the version the extra pins (``pyproject.toml``), built natively (``make llamacpp``)
VERSION = "0.3.36"
#: tokens of a llama.cpp context: the model's context, at most this (KV bytes grow with it: 8192 positions of the
#: embedded model at f16 are 180 MiB)
N_CTX_MAX = 8192
#: positions past the model's context a llama.cpp context holds: a request may fill the context, and the last verify
#: forward then writes up to K (<= 64) draft positions past it, which are never kept
VERIFY_HEADROOM = 64
#: tokens per ``llama_decode`` of a prompt (and the widest verify forward)
N_BATCH = 512
#: whether llama.cpp contexts run flash attention (:func:`cache_kwargs`; the verify cost curve's key names it)
FLASH_ATTN = True
#: what a metadata-only copy holds (``convert_gguf``'s log line)
META_LAYOUT = "config, generation config and tokenizer only (no weights)"


#: what ``llama_print_system_info`` says of a build with ggml's AMX kernels (``GGML_NATIVE`` on an AMX CPU)
AMX_BUILT = "AMX_INT8 = 1"
#: ``1``: use a build with AMX kernels anyway (a llama.cpp where they are fixed)
AMX_ENV = "TOOLKIT_LLAMACPP_AMX"


def amx_refusal(system_info: str) -> str | None:
    """Why a llama.cpp build whose ``llama_print_system_info()`` is ``system_info`` is not used, or ``None``.

    ggml's AMX kernels (compiled in by a native build on an AMX CPU: Sapphire Rapids and later Xeons) build their
    tile configuration on the stack, where GCC leaves half of it unwritten, and the first matrix product on the
    AMX buffer dies in ``ldtilecfg`` (a general protection fault in ``ggml_backend_amx_mul_mat``; llama.cpp issue
    20824, fix pending in PR 26954). Seen here with llama-cpp-python 0.3.36 built by GCC 12 on a Xeon with
    amx_int8: every decode crashed the process. ``make llamacpp`` builds without them (``-mno-amx-*``).
    ``TOOLKIT_LLAMACPP_AMX=1`` uses such a build anyway."""
    if AMX_BUILT not in system_info or os.environ.get(AMX_ENV) == "1":
        return None
    return ("this llama-cpp-python was built with ggml's AMX kernels, which crash the process at the first matrix "
            "product (general protection fault in ggml_backend_amx_mul_mat: llama.cpp issue 20824); rebuild it "
            f"without them with `make llamacpp` (or set {AMX_ENV}=1 to use it anyway)")


def importable() -> bool:
    """Whether llama-cpp-python is installed (not imported; whether its build can run: :func:`unusable`)."""
    return importlib.util.find_spec(PACKAGE) is not None


@functools.cache
def unusable() -> str | None:
    """Why llama.cpp cannot run here (not installed, or a build that crashes: :func:`amx_refusal`), or ``None``.
    Imports llama-cpp-python where it is installed (once; ~0.1 s)."""
    if not importable():
        return (f"llama-cpp-python=={VERSION} (the optional extra [llamacpp]) is not installed; install it with "
                "`make llamacpp` (a native build, once)")
    import llama_cpp

    why = amx_refusal(llama_cpp.llama_print_system_info().decode(errors="replace"))
    if why:
        log.warning("llama.cpp not used: %s", why)
    return why


def installed() -> bool:
    """Whether llama-cpp-python is installed and can run here (:func:`unusable` says why not)."""
    return unusable() is None


def require(field: str = "target.backend"):
    """The ``llama_cpp`` module, its log routed through :mod:`logging` at llama.cpp's own levels
    (:mod:`toolkit.models.llamacpp_log`). Raises :class:`ModelLoadError` naming ``field`` and why llama.cpp cannot
    run (:func:`unusable`: the install command, or the rebuild)."""
    why = unusable()
    if why:
        raise ModelLoadError(f"{field}: llama.cpp cannot run: {why}")
    import llama_cpp

    from toolkit.models.llamacpp_log import route

    route(llama_cpp)
    return llama_cpp


def cache_kwargs(type_k: str = "f16", type_v: str = "f16") -> dict:
    """``llama_cpp.Llama`` keyword arguments of a KV cache storing keys as ``type_k`` and values as ``type_v``
    (``f16``, ``q8_0``, ``q4_0``): their ggml types, and flash attention on whatever the types (llama.cpp's own
    default on a CPU, ``-fa auto``; llama-cpp-python's is off). With it a verify forward of ``W`` tokens gives the
    same logits, bit for bit, as ``W`` one-token steps on a q8_0 cache at any length and on an f16 cache while it
    holds at most 256 positions (past them ggml's one-query and batched f16 attention sum in another order; without
    flash attention they did from the first position: up to ~1.4 in a logit, and greedy texts part from llama.cpp's
    own AR where the top-2 margin is smaller; ``bench/reports/llamacpp-width``), and llama.cpp quantizes V only
    inside it. Our contexts and the llama.cpp AR baselines beside them are made with it, so both run the same cache
    and attention. Raises :class:`ModelLoadError` without llama-cpp-python."""
    llama_cpp = require()
    return {"type_k": getattr(llama_cpp, f"GGML_TYPE_{type_k.upper()}"),
            "type_v": getattr(llama_cpp, f"GGML_TYPE_{type_v.upper()}"), "flash_attn": FLASH_ATTN}


def is_llamacpp(model) -> bool:
    """Whether ``model`` is a llama.cpp target (:class:`LlamaCppTarget`)."""
    return getattr(model, "toolkit_backend", None) == LLAMACPP


def _write_metadata(gguf_path: Path, out: Path, dtype=None) -> None:
    """Write ``config.json``, ``generation_config.json`` and the tokenizer of ``gguf_path`` (its metadata, read by
    transformers' GGUF reader) into ``out``; no weights."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(out)


_write_metadata.layout = META_LAYOUT


def metadata_dir(source: str, field: str = "target.source") -> tuple[Path, Path]:
    """``(GGUF path, metadata directory)`` of a GGUF source (see the module docstring; written once, cached).

    Raises:
        ConfigError: ``source`` is not a GGUF source (named ``target.backend``).
        ModelLoadError: a missing or unreadable file (named ``field``).
    """
    from toolkit.models.embedded import convert_gguf, gguf_source
    from toolkit.resources import cache_dir

    found = gguf_source(source, field)
    if found is None:
        raise ConfigError("target.backend", f"llama.cpp runs GGUF files; source {source!r} is not one (embedded or "
                          "a .gguf path)", ["auto", "bitsandbytes", "torchao"])
    path, name = found
    return path, convert_gguf(path, cache_dir() / f"{name}-meta", field, convert=_write_metadata)


class LlamaCppTarget(torch.nn.Module):
    """The target of ``target.backend: llama.cpp`` (see the module docstring).

    Args:
        gguf_path: the GGUF file llama.cpp runs.
        meta: the metadata directory (:func:`metadata_dir`).
        spec: the recipe's :class:`~toolkit.models.spec.ModelSpec` (``toolkit_spec``).
        threads: llama.cpp's threads (decode and batch); default torch's (one per physical core).

    Attributes:
        config / generation_config: the HF configs of the file.
        gguf_path, threads: the file and llama.cpp's threads.
        n_ctx: tokens per context: the model's context (at most :data:`N_CTX_MAX`) + :data:`VERIFY_HEADROOM`.
        toolkit_weight_bytes: the GGUF file's bytes (what llama.cpp maps).
    """

    def __init__(self, gguf_path: Path, meta: Path, spec=None, threads: int | None = None):
        super().__init__()
        from transformers import AutoConfig, GenerationConfig

        self.llama_cpp = require()
        self.gguf_path = Path(gguf_path)
        self.config = AutoConfig.from_pretrained(meta)
        self.generation_config = GenerationConfig.from_pretrained(meta)
        self.anchor = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # the decoder's device: the CPU
        self.threads = threads or torch.get_num_threads()
        limit = getattr(self.config, "max_position_embeddings", None) or N_CTX_MAX
        self.n_ctx = min(limit, N_CTX_MAX) + VERIFY_HEADROOM
        self.toolkit_spec, self.toolkit_backend = spec, LLAMACPP
        self.toolkit_weight_bytes = self.gguf_path.stat().st_size
        self._contexts: dict[tuple, object] = {}
        self._shared: tuple[torch.nn.Module, torch.nn.Module] | None = None  # see shared_modules

    def context(self, type_k: str = "f16", type_v: str = "f16", embeddings: bool = False):
        """The ``llama_cpp.Llama`` (model + context) whose KV cache stores keys as ``type_k`` and values as
        ``type_v`` (``f16``, ``q8_0``, ``q4_0``; :func:`cache_kwargs`), with ``embeddings`` also handing out each
        output position's final-norm hidden state (``llama_get_embeddings``: pooling none): made on first use, then
        kept."""
        key = (type_k, type_v, embeddings)
        if key not in self._contexts:
            from llama_cpp import Llama

            self._contexts[key] = Llama(
                model_path=str(self.gguf_path), n_ctx=self.n_ctx, n_batch=N_BATCH, n_ubatch=N_BATCH,
                n_threads=self.threads, n_threads_batch=self.threads, verbose=False, **cache_kwargs(type_k, type_v),
                **({"embedding": True, "pooling_type": self.llama_cpp.LLAMA_POOLING_TYPE_NONE} if embeddings else {}))
            # closed with the target, or at exit while llama_cpp is whole (its own __del__ at interpreter teardown
            # prints "Exception ignored ... 'NoneType' object is not callable")
            weakref.finalize(self, self._contexts[key].close)
        return self._contexts[key]

    @property
    def vocab_size(self) -> int:
        return int(self.context().n_vocab())

    def get_input_embeddings(self) -> torch.nn.Module:
        """The file's token embedding as the torch path reads it, for a drafter that shares it (an EAGLE head):
        :meth:`shared_modules`' first."""
        return self.shared_modules()[0]

    def get_output_embeddings(self) -> torch.nn.Module:
        """The file's LM head as the torch path runs it (:meth:`shared_modules`' second)."""
        return self.shared_modules()[1]

    def shared_modules(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        """``(input embedding, LM head)`` of the file's ``precision: native`` copy (:mod:`toolkit.models.gguf_native`:
        the file's own blocks, converted once and cached; the embedding a ``BlockEmbedding`` that dequantizes only the
        rows looked up): the same modules an EAGLE head shares with the torch target of the same file. Loaded on first
        use; the copy's other layers are dropped. Raises ``ModelLoadError`` as :func:`~toolkit.models.gguf_native.
        resolve_native`."""
        if self._shared is None:
            from toolkit.models.gguf_native import load_native, resolve_native

            source = self.toolkit_spec.source if self.toolkit_spec is not None else str(self.gguf_path)
            native = load_native(resolve_native(source, "target.source"))
            self._shared = (native.get_input_embeddings(), native.get_output_embeddings())
        return self._shared

    def forward(self, *args, **kwargs):
        raise TypeError("a llama.cpp target has no torch forward: it runs through toolkit.engine.llamacpp_forward "
                        "(the decoder, the verify cost curve and the evaluator's perplexity use it)")

    def set_attn_implementation(self, name: str) -> None:
        """Nothing to switch: llama.cpp runs its own attention (a KV policy's hook has no torch layers here)."""

    def describe(self) -> str:
        """One line for logs and reports: file, version, threads."""
        return (f"llama.cpp {self.llama_cpp.__version__} on {self.gguf_path.name} "
                f"({self.toolkit_weight_bytes / 2**20:.0f} MiB), {self.threads} threads")


def load_llamacpp(spec, field: str = "target"):
    """``(LlamaCppTarget, tokenizer)`` of a GGUF ``spec`` (``backend: llama.cpp``); the tokenizer is the HF one of
    the file's metadata.

    Raises:
        ConfigError: a non-GGUF source or a CUDA device (named ``{field}.backend``).
        ModelLoadError: llama-cpp-python is not installed, or the file cannot be read.
    """
    from transformers import AutoTokenizer

    from toolkit.quant.llamacpp import check_llamacpp_spec

    check_llamacpp_spec(spec, field)
    require(f"{field}.backend")
    path, meta = metadata_dir(spec.source, f"{field}.source")
    target = LlamaCppTarget(path, meta, spec, threads=int(os.environ.get("TOOLKIT_LLAMACPP_THREADS", 0)) or None)
    log.info("target on %s", target.describe())
    return target, AutoTokenizer.from_pretrained(meta)
