#!/usr/bin/env bash
# Install PyTorch into the virtual environment whose pip is $1.
# - torch already importable there (a venv made with the machine's torch, or installed earlier): nothing is installed,
#   nothing is fetched — this is what an offline GPU machine with a preinstalled torch needs.
# - With an NVIDIA GPU: the default (CUDA) build from PyPI at the tested version (constraints.txt).
# - Without one: the CPU-only build, never the multi-GB CUDA wheels — first a local CPU wheel if pip can see one
#   (pip's find-links), else PyTorch's CPU index.
set -euo pipefail
pip="$1"
python="$(dirname "$pip")/python"
constraints="$(dirname "$0")/../constraints.txt"
if version=$("$python" -c "import torch; print(torch.__version__)" 2>/dev/null); then
  echo "torch already importable: $version (nothing installed)"
  exit 0
fi
pinned=$(sed -n 's/^torch==//p' "$constraints" 2>/dev/null || true)
pinned=${pinned:-2.13.0}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "$pip" install "torch==$pinned"
else
  "$pip" install "torch==$pinned+cpu" 2>/dev/null \
    || "$pip" install "torch==$pinned" --index-url https://download.pytorch.org/whl/cpu
fi
