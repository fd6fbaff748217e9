"""What travels to an offline GPU machine beside the working tree: wheels, the embedded tokenizer, the embedded GGUF.

A lent GPU machine has torch and transformers but no registry: packages the kit can use beyond those (torchao,
bitsandbytes, gguf) come as wheels in a git-ignored folder (``.gpu-carry/wheels``), installed into a private
``--target`` directory at start and put on ``sys.path``; a missing one is skipped with one line. The embedded GGUF
(94 MiB) is larger than what one call may carry beside the tree, so it travels in parts (:func:`split_file`) over
consecutive calls to a warm machine and is joined there (:func:`join_parts`), checked against its SHA-256.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from toolkit.io import sha256_file

#: import name -> distribution name of the packages the kit uses when present (gguf + platformdirs: the toolkit's
#: conversion of the relayed embedded GGUF)
OPTIONAL = {"torchao": "torchao", "bitsandbytes": "bitsandbytes", "gguf": "gguf", "platformdirs": "platformdirs"}
MANIFEST = "manifest.json"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def load_wheels(folder: Path, log=print) -> dict[str, str]:
    """Make each package of :data:`OPTIONAL` importable: preinstalled, else from a wheel in ``folder`` (installed
    with pip ``--no-index --no-deps --target`` into a temporary directory put first on ``sys.path``), else missing.

    Returns ``{name: "preinstalled 1.2" | "carried 1.2" | "missing: ..."}``; logs one line per package.
    """
    out = {}
    target = None
    for name, dist in OPTIONAL.items():
        version = _version(dist)
        if version is not None:
            out[name] = f"preinstalled {version}"
            continue
        wheels = sorted(folder.glob(f"{dist}-*.whl")) if folder.is_dir() else []
        if not wheels:
            out[name] = f"missing: no {dist} installed and no {dist}-*.whl in {folder}"
            log(f"skip {name}: {out[name]}")
            continue
        if target is None:
            target = Path(tempfile.mkdtemp(prefix="gpu-kit-site-"))
            sys.path.insert(0, str(target))
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                               "--no-compile", "--target", str(target), str(wheels[-1])],
                              capture_output=True, text=True)
        if done.returncode != 0:
            out[name] = f"missing: pip could not install {wheels[-1].name}: {done.stderr.strip()[-200:]}"
            log(f"skip {name}: {out[name]}")
            continue
        importlib.invalidate_caches()
        out[name] = f"carried {wheels[-1].name.split('-')[1]}"
        log(f"{name}: {out[name]}")
    return out


def split_file(path: Path, out_dir: Path, parts: int) -> list[Path]:
    """Write ``path`` as ``parts`` files ``<out_dir>/<name>.part<i>`` of near-equal size and a ``manifest.json``
    (name, bytes, SHA-256, part names). Raises ``ValueError`` for ``parts < 1``."""
    if parts < 1:
        raise ValueError(f"parts: must be >= 1, got {parts}")
    out_dir.mkdir(parents=True, exist_ok=True)
    size = path.stat().st_size
    step = -(-size // parts)
    names = []
    with open(path, "rb") as src:
        for i in range(parts):
            name = f"{path.name}.part{i}"
            (out_dir / name).write_bytes(src.read(step))
            names.append(name)
    manifest = {"name": path.name, "bytes": size, "sha256": sha256_file(path), "parts": names}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return [out_dir / n for n in names]


def join_parts(folder: Path, dest_dir: Path) -> Path:
    """Join the parts listed in ``<folder>/manifest.json`` into ``<dest_dir>/<name>`` and check size and SHA-256
    (an intact file already there is kept as it is).

    Raises:
        FileNotFoundError: no manifest, or a part missing (names which: carry it in the next call).
        ValueError: the joined file's size or SHA-256 differs from the manifest's.
    """
    manifest = json.loads((folder / MANIFEST).read_text())
    missing = [p for p in manifest["parts"] if not (folder / p).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder}: parts not here yet: {', '.join(missing)} (carry them in this call)")
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / manifest["name"]
    if dest.is_file() and dest.stat().st_size == manifest["bytes"] and sha256_file(dest) == manifest["sha256"]:
        return dest  # joined by an earlier run: same file, same mtime, so its converted copy is reused
    with open(dest, "wb") as out:
        for part in manifest["parts"]:
            out.write((folder / part).read_bytes())
    if dest.stat().st_size != manifest["bytes"] or sha256_file(dest) != manifest["sha256"]:
        dest.unlink()
        raise ValueError(f"{folder}: the joined {manifest['name']} differs from the manifest (a part is stale)")
    return dest
