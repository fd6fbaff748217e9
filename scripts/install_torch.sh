#!/usr/bin/env bash
# Install PyTorch into the virtual environment whose pip is $1.
# With an NVIDIA GPU: the default (CUDA) build from PyPI. Without one: the CPU-only build, never the multi-GB CUDA
# wheels — first a local CPU wheel if pip can see one (pip's find-links), else PyTorch's CPU index.
set -euo pipefail
pip="$1"
if "$pip" show torch >/dev/null 2>&1; then
  echo "torch already installed: $("$pip" show torch | awk '/^Version/ {print $2}')"
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "$pip" install torch
else
  "$pip" install "torch==2.13.0+cpu" 2>/dev/null \
    || "$pip" install torch --index-url https://download.pytorch.org/whl/cpu
fi
