"""Training checkpoints of draft distillation and EAGLE-head training: written atomically and durably, read back
without running any code from the file.

Layout of ``out/checkpoints``::

    LATEST                        the name of the newest complete checkpoint (one plain name, one line)
    step-000050/                  weights (safetensors) + trainer_state.json + trainer_state.safetensors

**No code from a file.** A checkpoint or a feature cache someone hands you is data: tensors are read with
safetensors (a JSON header and raw bytes; there is no code path in the format) and everything else is JSON. The
trainer state (optimizer moments, RNG states, step, losses, ...) is flattened by :func:`save_state`: each tensor is
stored in ``trainer_state.safetensors`` under a generated key and replaced by ``{"__tensor__": key}`` in
``trainer_state.json``; tuples and dicts with non-string keys (the optimizer's per-parameter state is keyed by int)
are tagged so that :func:`load_state` rebuilds the very same structure. Not ``torch.load(weights_only=True)`` with
an allow-list: that is still an unpickler, whose restrictions have been bypassed before (CVE-2025-32434), and
safetensors + JSON need no allow-list to maintain. A checkpoint in the old pickle format (``trainer_state.pt``) is
refused with a clear error, never opened.

**Confinement.** ``LATEST`` is followed only when it names an entry directly inside ``checkpoints/`` that still
resolves there once symlinks are followed: ``../../etc``, an absolute path or a symlink leading out raise
:class:`ConfigError` (field ``resume``).

**Atomicity.** :func:`write_checkpoint` fills a temporary directory, fsyncs every file and directory, renames it to
a name no other checkpoint has, fsyncs ``checkpoints/``, and only then switches ``LATEST`` (an atomic, durable file
replace): that switch is the commit point. An interrupt or a kill -9 anywhere before it leaves ``LATEST`` on the
previous complete checkpoint; stale temporary directories are deleted by the next save. :func:`deferred_interrupts`
holds Ctrl-C while an optimizer step and its bookkeeping are applied, so a checkpoint never records half a step.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from toolkit.errors import ConfigError
from toolkit.io import atomic_write, atomic_write_text, fsync_dir, fsync_tree

STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"
LEGACY_STATE = "trainer_state.pt"
_TENSOR, _TUPLE, _ITEMS = "__tensor__", "__tuple__", "__items__"


# ------------------------------------------------------------------------------------------------ state files
def _encode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` as JSON-able data; tensors moved into ``tensors`` (CPU, contiguous copies) under generated keys."""
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value.detach().to("cpu", copy=True).contiguous()
        return {_TENSOR: key}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_encode(v, tensors) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v, tensors) for k, v in value.items()}
        return {_ITEMS: [[_encode(k, tensors), _encode(v, tensors)] for k, v in value.items()]}
    raise TypeError(f"cannot store a {type(value).__name__} in a trainer state (tensors, numbers, strings, lists, "
                    "tuples and dicts only)")


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {_TENSOR}:
        if value[_TENSOR] not in tensors:
            raise KeyError(value[_TENSOR])
        return tensors[value[_TENSOR]]
    if set(value) == {_TUPLE}:
        return tuple(_decode(v, tensors) for v in value[_TUPLE])
    if set(value) == {_ITEMS}:
        return {_hashable(_decode(k, tensors)): _decode(v, tensors) for k, v in value[_ITEMS]}
    return {k: _decode(v, tensors) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def save_state(directory: Path, state: dict) -> None:
    """Write ``state`` (nested dicts / lists / tuples of tensors, numbers, strings, None) as ``trainer_state.json``
    + ``trainer_state.safetensors`` in ``directory`` (each file atomically)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(state, tensors)
    directory = Path(directory)
    atomic_write(directory / STATE_TENSORS, lambda tmp: save_file(tensors, str(tmp)), suffix=".safetensors")
    atomic_write(directory / STATE_JSON, lambda tmp: tmp.write_text(json.dumps(skeleton) + "\n", encoding="utf-8"))


def load_state(directory: Path, field: str = "resume") -> dict:
    """Read back what :func:`save_state` wrote; never unpickles.

    Raises:
        ConfigError (``field``): no state, a state in the old pickle format (``trainer_state.pt``, refused: loading
            it could run code), or files that are not what :func:`save_state` writes.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    skeleton_path, tensors_path = directory / STATE_JSON, directory / STATE_TENSORS
    if not skeleton_path.is_file() or not tensors_path.is_file():
        if (directory / LEGACY_STATE).exists():
            raise ConfigError(field, f"{directory} holds a trainer state in the old pickle format ({LEGACY_STATE}), "
                              "which is never loaded (unpickling a file can run code); start over with --force")
        raise ConfigError(field, f"{directory} has no {STATE_JSON} + {STATE_TENSORS}: not a checkpoint")
    try:
        skeleton = json.loads(skeleton_path.read_text(encoding="utf-8"))
        tensors = load_file(str(tensors_path))
        state = _decode(skeleton, tensors)
    except (ValueError, KeyError, TypeError, OSError, SafetensorError) as exc:
        raise ConfigError(field, f"{directory}: unreadable trainer state ({type(exc).__name__}: {exc}); start over "
                          "with --force") from exc
    if not isinstance(state, dict):
        raise ConfigError(field, f"{skeleton_path} does not hold a trainer state (a JSON object)")
    return state


# ------------------------------------------------------------------------------------------------ LATEST
def _confined(root: Path, name: str, pointer: Path) -> Path:
    """``root / name`` when ``name`` is a plain entry of ``root`` that resolves inside it; else ConfigError."""
    escape = (not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name
              or os.path.isabs(name))
    path = root / name
    if not escape:
        real_root = root.resolve()
        escape = path.resolve().parent != real_root or not real_root.is_relative_to(root.parent.resolve())
    if escape:
        raise ConfigError("resume", f"{pointer} names {name!r}, which is not a checkpoint inside {root}; refusing to "
                          "follow it (a run reads checkpoints only from its own directory)")
    return path


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint directory under ``out/checkpoints`` (named by ``LATEST``), or None when there
    is none yet.

    Raises:
        ConfigError (``resume``): ``LATEST`` is a symlink, or names a path outside ``out/checkpoints`` (``..``, an
            absolute path, a symlink out), or a checkpoint that does not exist.
    """
    root = Path(out) / "checkpoints"
    pointer = root / "LATEST"
    if pointer.is_symlink():
        raise ConfigError("resume", f"{pointer} is a symlink; refusing to follow it")
    if not pointer.is_file():
        return None
    name = pointer.read_text(encoding="utf-8", errors="replace").strip()
    path = _confined(root, name, pointer)
    if not path.is_dir():
        raise ConfigError("resume", f"{pointer} names {name!r}, which does not exist; start over with --force")
    return path


def _free_name(root: Path, name: str) -> str:
    """``name``, or ``name.1``, ``name.2``... when taken (re-saving a step never deletes the checkpoint in use)."""
    candidate, n = name, 0
    while (root / candidate).exists():
        n += 1
        candidate = f"{name}.{n}"
    return candidate


def write_checkpoint(out: Path, step: int, write: Callable[[Path], None]) -> Path:
    """``out/checkpoints/step-NNNNNN`` filled by ``write(tmp_dir)`` in a temporary directory, made durable and
    renamed into place; then ``LATEST`` switched to it (the commit point) and every other entry deleted (older
    checkpoints, temporary directories of interrupted saves). Shared by draft distillation and EAGLE training."""
    root = Path(out) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = _free_name(root, f"step-{step:06d}")
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}."))
    try:
        write(tmp)
        fsync_tree(tmp)
        os.replace(tmp, root / name)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(root / "LATEST", name + "\n", durable=True)
    for old in root.iterdir():
        if old.name in (name, "LATEST"):
            continue
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    return root / name


# ------------------------------------------------------------------------------------------------ logs, signals
def trim_log(path: Path, step: int) -> None:
    """Keep, of the JSON-lines log ``path``, the complete lines whose ``step`` is at most ``step`` (the checkpoint a
    run resumes from): a kill -9 may have cut the last line, and the steps after the checkpoint are redone."""
    path = Path(path)
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True):
        if not line.endswith("\n"):
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("step"), int) and entry["step"] <= step:
            kept.append(line)
    atomic_write_text(path, "".join(kept), durable=True)


@contextlib.contextmanager
def deferred_interrupts():
    """Hold SIGINT (Ctrl-C) for the duration of the block and deliver it right after: an optimizer step and its
    bookkeeping (step counter, losses) are applied entirely or not at all, so the checkpoint an interrupted run
    saves never records half a step. A no-op outside the main thread (signals reach only the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received and callable(previous):
        previous(signal.SIGINT, None)
    elif received and previous == signal.SIG_DFL:
        raise KeyboardInterrupt
