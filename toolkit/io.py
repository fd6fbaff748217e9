"""Atomic file writes: a reader, an interrupted run or a second process never sees a half-written file.

Every writer goes through :func:`atomic_write`: the content is written to a uniquely named temporary sibling
(``mkstemp`` in the same directory, so two processes writing the same path never share a temporary file), flushed
and, with ``durable``, fsynced, then renamed over the target with ``os.replace`` (atomic on POSIX). On any error,
``KeyboardInterrupt`` included, the temporary file is removed and the target is left as it was.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def atomic_write(path: Path, write: Callable[[Path], None], suffix: str = ".tmp", durable: bool = False) -> None:
    """Create ``path`` by calling ``write(temporary_path)`` and renaming the result into place.

    ``suffix`` is the temporary file's extension (some writers pick the format from it, e.g. ``np.save``).
    ``durable`` fsyncs the file and its directory, for the user's work (checkpoints, found recipes).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        if durable:
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
        if durable:
            _fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str, durable: bool = False) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), durable=durable)


def atomic_write_json(path: Path, data: Any, durable: bool = False) -> None:
    """Serialize ``data`` as indented JSON and write it atomically."""
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n", durable=durable)


def atomic_write_png(path: Path, figure, dpi: int = 100) -> None:
    """Save a matplotlib ``figure`` as PNG atomically."""
    atomic_write(path, lambda tmp: figure.savefig(tmp, dpi=dpi, format="png"), suffix=".png")
