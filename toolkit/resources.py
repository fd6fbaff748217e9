"""Where the toolkit's files are: the user cache directory, and the files shipped with the package — recipes, prompt
suites and search spaces (the repository's ``recipes/``).

``recipes/`` is installed as the package ``toolkit.recipes`` (a setuptools package-dir mapping, see ``setup.py``)
and read through :mod:`importlib.resources`, so a regular ``pip install .`` works the same as an editable checkout.
Nothing is ever written here: outputs go to the working directory or ``--out``.
"""

from __future__ import annotations

import os
from pathlib import Path

from toolkit.errors import ConfigError

_SOURCE_RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def cache_dir() -> Path:
    """The user cache directory of the toolkit (converted models, verify cost curves, KV calibrations):
    ``$TOOLKIT_CACHE_DIR`` or the XDG user cache dir of ``llm-toolkit``."""
    env = os.environ.get("TOOLKIT_CACHE_DIR")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("llm-toolkit"))


def inductor_cache() -> None:
    """Inductor's on-disk cache under the toolkit's cache directory, unless the user chose one. Inductor reads the
    variable at every use but writes its default (``/tmp/torchinductor_<user>``) into it on first use, so a value
    equal to that default counts as unset."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        default = os.path.abspath(default_cache_dir())
    except (ImportError, OSError):  # a torch without this helper: only an unset variable is replaced
        default = None
    if current is None or os.path.abspath(current) == default:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")


def recipes_root() -> Path:
    """The directory of the shipped recipes: ``recipes/`` next to this code in a source checkout (so a work tree
    reads its own files, whatever an editable install elsewhere maps), else the installed package data."""
    if (_SOURCE_RECIPES / "__init__.py").is_file():
        return _SOURCE_RECIPES
    from importlib.resources import files

    return Path(str(files("toolkit.recipes")))


def shipped(kind: str) -> Path:
    """``recipes_root()`` for ``kind`` ``""`` (recipes), ``"prompts"`` (suites) or ``"search"`` (search spaces)."""
    return recipes_root() / kind if kind else recipes_root()


def shipped_name(path: str | Path) -> str:
    """A machine-independent name of a shipped data file (``recipes/search/short.yaml``), or the path as given."""
    try:
        return "recipes/" + Path(path).resolve().relative_to(recipes_root().resolve()).as_posix()
    except ValueError:
        return str(path)


def resolve(name_or_path: str | Path, kind: str, field: str) -> Path:
    """A YAML file by path, or by the name of a shipped one (``short`` -> ``<root>/<kind>/short.yaml``).

    Raises:
        ConfigError: neither an existing file nor a shipped name (the shipped names are listed).
    """
    if not isinstance(name_or_path, (str, Path)) or not str(name_or_path) or "\0" in str(name_or_path):
        raise ConfigError(field, f"must be a file path or a shipped name, got {name_or_path!r}")
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    if not path.suffix and len(path.parts) == 1:
        candidate = shipped(kind) / f"{name_or_path}.yaml"
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for p in shipped(kind).glob("*.yaml"))
    raise ConfigError(field, f"no file or shipped name {str(name_or_path)!r}", known)
