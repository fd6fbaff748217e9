"""Prepare, on this (networked, CPU) machine, what the GPU kit carries to an offline GPU machine: ``.gpu-carry/``
(git-ignored) with

* ``wheels/`` — torchao, gguf, platformdirs and bitsandbytes for CPython 3.12 / manylinux x86-64 at the versions
  installed here; bitsandbytes trimmed to its CPU library and the one CUDA library the device's CUDA needs (43 MB ->
  3.4 MiB);
* ``tokenizer/`` — the embedded SmolLM2 tokenizer (real prompts for the random-weight shapes);
* ``gguf/`` — the embedded GGUF (94 MiB) in ``--parts`` parts (3: 31 MiB each) + a manifest with its SHA-256, for
  consecutive calls.

    PYTHONPATH=. .venv/bin/python bench/gpu_carry.py [--out .gpu-carry] [--cuda 130] [--parts 3]

One call to a GPU machine carries at most 64 MiB with the working tree (~11 MiB), so the parts travel in consecutive
calls while the machine is warm, and the last one runs the kit (``bench/README.md`` gives the three calls). Needs
pip and the network here; writes nothing outside ``--out``.
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

from gpu_kit.carry import MANIFEST, split_file  # noqa: E402

WHEELS = ("torchao", "gguf", "platformdirs", "bitsandbytes")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "any"]


def download(dist: str, version: str, dest: Path) -> Path:
    """``pip download`` one binary wheel of ``dist==version`` for CPython 3.12 on x86-64 Linux into ``dest``."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "-d", str(dest), f"{dist}=={version}"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd, check=True)
    return max(dest.glob(f"{dist}-{version}-*.whl"), key=lambda p: p.stat().st_mtime)


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu-carry")
    parser.add_argument("--cuda", default="130", help="the device's CUDA as bitsandbytes names it (13.0 -> 130)")
    parser.add_argument("--parts", type=int, default=3,
                        help="parts of the embedded GGUF, one per call (3 keep each call under 64 MiB with the tree)")
    parser.add_argument("--wheels", nargs="+", default=list(WHEELS), choices=WHEELS,
                        help="packages to carry as wheels (default: all; gguf + platformdirs serve the embedded "
                             "model, torchao + bitsandbytes only the quantized recipes, which no kit stage times)")
    args = parser.parse_args(argv)
    wheels = args.out / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    for dist in args.wheels:
        wheel = download(dist, importlib.metadata.version(dist), wheels)
        if dist == "bitsandbytes":
            trim_bitsandbytes(wheel, args.cuda)
        print(f"{wheel.name}: {wheel.stat().st_size / 2**20:.1f} MiB")
    from transformers import AutoTokenizer

    from toolkit.models.embedded import embedded_gguf_path, resolve_source

    AutoTokenizer.from_pretrained(resolve_source("embedded")).save_pretrained(args.out / "tokenizer")
    shutil.rmtree(args.out / "gguf", ignore_errors=True)
    parts = split_file(Path(embedded_gguf_path()), args.out / "gguf", args.parts)
    for part in [*parts, args.out / "gguf" / MANIFEST]:
        print(f"{part.relative_to(args.out.parent)}: {part.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
