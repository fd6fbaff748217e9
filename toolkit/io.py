"""Atomic file writes: a reader, an interrupted run or a second process never sees a half-written file.

Every writer goes through :func:`atomic_write`: the content is written to a uniquely named temporary sibling
(``mkstemp`` in the same directory, so two processes writing the same path never share a temporary file), flushed
and, with ``durable``, fsynced, then renamed over the target with ``os.replace`` (atomic on POSIX), with the mode
``open()`` would have given it. On any error, ``KeyboardInterrupt`` included, the temporary file is removed and the
target is left as it was.

Directories (checkpoints, a model directory) are written the same way: filled in a temporary sibling, made durable
with :func:`fsync_tree`, renamed into place; :func:`replace_dir` swaps a new directory in for an existing one and
:func:`recover_dir` undoes a swap an interrupt cut in half.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of the file at ``path``, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


#: the mode a plainly created file gets under this process's umask (0644 under the usual 022)
_CREATE_MODE = 0o666 & ~_umask()


def atomic_write(path: Path, write: Callable[[Path], None], suffix: str = ".tmp", durable: bool = False) -> None:
    """Create ``path`` by calling ``write(temporary_path)`` and renaming the result into place.

    ``suffix`` is the temporary file's extension (some writers pick the format from it, e.g. ``np.save``).
    ``durable`` fsyncs the file and its directory, for the user's work (checkpoints, found recipes).

    Raises:
        OSError: creating, writing or renaming failed (a missing or read-only directory, a full disk), with
            ``filename`` ``path`` (not the temporary file, which is removed); nothing is left at ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    except OSError as exc:  # the error names the file the user asked for, not the temporary one
        raise _about(exc, path) from None
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.chmod(tmp, _CREATE_MODE)  # mkstemp makes the file 0600; a result file gets the mode open() would give it
        if durable:
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.filename == str(tmp):
            raise _about(exc, path) from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _about(exc: OSError, path: Path) -> OSError:
    """``exc`` (same type, errno and reason) about ``path`` instead of the temporary file next to it."""
    return type(exc)(exc.errno, exc.strerror, str(path))


def fsync_dir(directory: Path) -> None:
    """fsync a directory (its entries: a rename into it survives a power loss); errors are ignored (some file
    systems cannot fsync a directory)."""
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


def fsync_tree(root: Path) -> None:
    """fsync every regular file under ``root``, then every directory bottom-up (``root`` included)."""
    root = Path(root)
    directories = []
    for dirpath, _, filenames in os.walk(root):
        directories.append(Path(dirpath))
        for name in filenames:
            path = Path(dirpath) / name
            if path.is_symlink() or not path.is_file():
                continue
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    for directory in reversed(directories):
        fsync_dir(directory)


def _old_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.old")


def replace_dir(tmp: Path, final: Path) -> None:
    """Put the complete directory ``tmp`` (a sibling of ``final``) in place of ``final``, durably.

    POSIX cannot rename a directory over a non-empty one, so an existing ``final`` is first renamed to
    ``.NAME.old``, ``tmp`` renamed to ``final``, then the old one deleted. Killed between the two renames, ``final``
    is missing and ``.NAME.old`` complete: :func:`recover_dir` puts it back.
    """
    tmp, final = Path(tmp), Path(final)
    fsync_tree(tmp)
    old = _old_name(final)
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def recover_dir(final: Path) -> None:
    """Undo a :func:`replace_dir` cut between its two renames: restore ``.NAME.old`` when ``final`` is missing."""
    final = Path(final)
    old = _old_name(final)
    if not final.exists() and old.is_dir():
        os.replace(old, final)
        fsync_dir(final.parent)
