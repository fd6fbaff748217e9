"""Prepare, on this (networked, CPU) machine, what the GPU kit carries to an offline GPU machine: ``.gpu-carry/``
(git-ignored) with

* ``wheels/`` — for CPython 3.12 / manylinux x86-64 at the versions installed here (:data:`GROUPS`): ``quant``
  (torchao, whose PyPI wheel is its CUDA build, and bitsandbytes trimmed to its CPU library and the one CUDA library
  of the device's CUDA: 43 MB -> 3.4 MiB), ``relay`` (gguf, platformdirs: the embedded GGUF's conversion) and
  ``stack`` (what the evaluator, the search and head training import beyond the GPU image's packages: datasets,
  evaluate, rouge_score, nltk, optuna and its storage, jsonschema; SQLAlchemy without its optional Cython
  accelerators, which it replaces with pure Python: 4.7 -> 1.1 MB). ``rouge_score`` has no wheel on PyPI: one is
  built here from its source (pure Python);
* ``tokenizer/`` — the embedded SmolLM2 tokenizer (``--tokenizer``; off by default: the kit reads it from the relayed
  GGUF, and its 3.4 MiB are better spent on the GGUF);
* ``gguf/`` — the embedded GGUF (94 MiB) xz-compressed (86 MiB) in parts + a manifest with its SHA-256: the first
  part sized to travel with the wheels in one call of ``--call-mib``, the next ones in the following calls.

    PYTHONPATH=. .venv/bin/python bench/gpu_carry.py [--out .gpu-carry] [--cuda 130] [--call-mib 50]

One call to a GPU machine carries at most 64 MiB with the working tree (~11 MiB): ``--call-mib`` is what one call may
carry beside the tree (``bench/README.md`` gives the three calls). Needs pip and the network here; writes nothing
outside ``--out``; prints the size of every file and what each call carries.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from gpu_kit.carry import split_file  # noqa: E402

#: the wheels carried, by group (distribution names)
GROUPS = {"quant": ("torchao", "bitsandbytes"), "relay": ("gguf", "platformdirs"),
          "stack": ("datasets", "dill", "multiprocess", "evaluate", "rouge_score", "nltk", "optuna", "alembic",
                    "sqlalchemy", "colorlog", "mako", "jsonschema", "referencing", "rpds_py",
                    "jsonschema_specifications", "defusedxml")}
#: files dropped from a wheel (with their RECORD lines): optional native accelerators no stage needs
DROP = {"sqlalchemy": lambda name: name.endswith(".so"),
        "torchao": lambda name: name.rsplit("/", 1)[-1].startswith("_C_mxfp8")}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "any"]


def download(dist: str, version: str, dest: Path) -> Path:
    """``pip download`` one binary wheel of ``dist==version`` for CPython 3.12 on x86-64 Linux into ``dest`` (a
    distribution without one, like rouge_score, is built into a wheel here with ``pip wheel``)."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "-d", str(dest), f"{dist}=={version}"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    if subprocess.run(cmd).returncode != 0:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest),
                        f"{dist}=={version}"], check=True)
    return max(dest.glob(f"{dist.replace('-', '_')}-{version}-*.whl"), key=lambda p: p.stat().st_mtime)


def drop_files(wheel: Path, unwanted) -> Path:
    """Rewrite ``wheel`` in place without the files for which ``unwanted(name)`` is true (and their RECORD lines)."""
    trimmed = wheel.with_suffix(".trimmed")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if unwanted(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(line for line in data.decode().splitlines(keepends=True)
                               if not unwanted(line.split(",", 1)[0])).encode()
            dst.writestr(info, data)
    trimmed.replace(wheel)
    return wheel


def trim_bitsandbytes(wheel: Path, cuda: str) -> Path:
    """Rewrite the bitsandbytes wheel in place keeping only ``libbitsandbytes_cpu.so`` and
    ``libbitsandbytes_cuda<cuda>.so`` of its native libraries (and their RECORD lines)."""
    keep = {"libbitsandbytes_cpu.so", f"libbitsandbytes_cuda{cuda}.so"}

    def wanted(name: str) -> bool:
        base = name.rsplit("/", 1)[-1]
        return not (base.startswith("libbitsandbytes_") and base not in keep)

    trimmed = wheel.with_suffix(".trimmed")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as dst:
        if not any(n.endswith(f"libbitsandbytes_cuda{cuda}.so") for n in src.namelist()):
            raise SystemExit(f"--cuda {cuda}: {wheel.name} has no libbitsandbytes_cuda{cuda}.so")
        for info in src.infolist():
            if not wanted(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(line for line in data.decode().splitlines(keepends=True)
                               if wanted(line.split(",", 1)[0])).encode()
            dst.writestr(info, data)
    trimmed.replace(wheel)
    return wheel


def _mib(path: Path) -> float:
    return sum(p.stat().st_size for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file()) / 2**20


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu-carry")
    parser.add_argument("--cuda", default="130", help="the device's CUDA as bitsandbytes names it (13.0 -> 130)")
    parser.add_argument("--groups", nargs="+", default=list(GROUPS), choices=GROUPS, help="wheel groups to carry")
    parser.add_argument("--call-mib", type=float, default=50.0,
                        help="MiB one call may carry beside the working tree (64 MiB less the tree and a margin)")
    parser.add_argument("--tokenizer", action="store_true", help="carry the embedded tokenizer too (3.4 MiB)")
    args = parser.parse_args(argv)
    wheels = args.out / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    for dist in [d for group in args.groups for d in GROUPS[group]]:
        wheel = download(dist, importlib.metadata.version(dist), wheels)
        if dist == "bitsandbytes":
            trim_bitsandbytes(wheel, args.cuda)
        if dist in DROP:
            drop_files(wheel, DROP[dist])
        print(f"{wheel.name}: {wheel.stat().st_size / 2**20:.2f} MiB")
    shutil.rmtree(args.out / "tokenizer", ignore_errors=True)
    if args.tokenizer:
        from transformers import AutoTokenizer

        from toolkit.models.embedded import resolve_source

        AutoTokenizer.from_pretrained(resolve_source("embedded")).save_pretrained(args.out / "tokenizer")
    from toolkit.models.embedded import embedded_gguf_path

    first = args.call_mib - _mib(wheels) - (_mib(args.out / "tokenizer") if args.tokenizer else 0.0)
    if first < 1:
        raise SystemExit(f"--call-mib {args.call_mib}: the wheels alone take {_mib(wheels):.1f} MiB")
    shutil.rmtree(args.out / "gguf", ignore_errors=True)
    parts = split_file(Path(embedded_gguf_path()), args.out / "gguf", 1, first_bytes=int(first * 2**20),
                       max_bytes=int(args.call_mib * 2**20), compress=True)
    print(f"wheels: {_mib(wheels):.1f} MiB in all")
    for i, part in enumerate(parts):
        extra = " + wheels/" + (" + tokenizer/" if args.tokenizer else "") + " + gguf/manifest.json" if i == 0 else ""
        print(f"call {i + 1} carries gguf/{part.name}{extra}: "
              f"{_mib(part) + (_mib(wheels) + _mib(args.out / 'tokenizer') if i == 0 else 0):.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
