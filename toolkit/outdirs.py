"""Output directories the toolkit may delete: only those it created itself.

``--force`` (``toolkit draft distill``, ``toolkit draft eagle``) starts a run over by deleting its ``--out``. A typo
there (``--out .``, ``--out ~``, the wrong project) must not delete the user's files, so:

* :func:`make_output_dir` creates an output directory (parents too) and writes the marker file :data:`MARKER` in it
  (the command and the time, JSON); an existing directory is marked only when it is empty (everything that will be
  in it is then the toolkit's);
* :func:`check_removable` / :func:`remove_output_dir` refuse, with a :class:`ConfigError` naming the field, to delete
  a directory without that marker, a symbolic link, ``/``, the home directory, the working directory or any
  directory that contains it. An empty directory is left alone (there is nothing to delete).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
from pathlib import Path

from toolkit.errors import ConfigError

#: the marker file of a directory the toolkit created
MARKER = ".toolkit-output"


def make_output_dir(path: str | Path, field: str = "out") -> Path:
    """Create ``path`` (and its parents) as a toolkit output directory and return it; see the module docstring.

    Raises:
        ConfigError: ``path`` exists and is not a directory (``field`` named).
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(field, f"{path} exists and is not a directory")
    if path.is_dir() and (path / MARKER).is_file():
        return path
    if not path.exists() or not any(path.iterdir()):
        path.mkdir(parents=True, exist_ok=True)
        stamp = {"created_by": "llm-spec-toolkit", "command": " ".join(sys.argv[:3]),
                 "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        (path / MARKER).write_text(json.dumps(stamp) + "\n")
    return path


def _protected(resolved: Path) -> str | None:
    """Why ``resolved`` (an absolute path) must never be deleted, or ``None``."""
    if resolved == Path(resolved.anchor):
        return "the file system root"
    home = Path(os.path.expanduser("~")).resolve()
    if resolved == home:
        return "your home directory"
    cwd = Path.cwd().resolve()
    if resolved == cwd:
        return "the working directory"
    if resolved in cwd.parents:
        return "a directory that contains the working directory"
    if resolved in home.parents:
        return "a directory that contains your home directory"
    return None


def check_removable(path: str | Path, field: str = "out") -> None:
    """Raise :class:`ConfigError` naming ``field`` unless ``path`` may be deleted by ``--force`` (see the module
    docstring). A path that does not exist, or an empty directory, passes: nothing would be deleted."""
    path = Path(path)
    if path.is_symlink():
        raise ConfigError(field, f"--force will not delete {path}: it is a symbolic link")
    if not path.exists():
        return
    if not path.is_dir():
        raise ConfigError(field, f"{path} exists and is not a directory")
    reason = _protected(path.resolve())
    if reason is not None:
        raise ConfigError(field, f"--force will not delete {path}: it is {reason}; choose another --out")
    if not any(path.iterdir()):
        return
    if not (path / MARKER).is_file():
        raise ConfigError(field, f"--force will not delete {path}: the toolkit did not create it (no {MARKER} "
                          "marker); delete it yourself or choose another --out")


def remove_output_dir(path: str | Path, field: str = "out") -> None:
    """Delete the toolkit output directory ``path`` (after :func:`check_removable`); an empty or missing one is left
    as it is."""
    path = Path(path)
    check_removable(path, field)
    if path.is_dir() and any(path.iterdir()):
        shutil.rmtree(path)
