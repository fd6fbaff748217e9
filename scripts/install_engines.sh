#!/usr/bin/env bash
# Install the CPU engines a user would pick instead of this toolkit into their own virtual environment
# (.venv-engines by default): llama.cpp (llama-cpp-python, built from source for this CPU: a few minutes) and
# OpenVINO through optimum-intel (NNCF int4 weight compression).
# They live apart from .venv because optimum-intel pins transformers < 5.6 and huggingface-hub < 1.22, older than
# what the toolkit is tested with (constraints.txt); the benchmark runs them as separate processes
# (toolkit/measure/engines.py). Versions: bench/engines-constraints.txt.
set -euo pipefail
venv="${1:-.venv-engines}"
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
test -x "$venv/bin/python" || "$python" -m venv "$venv"
"$root/scripts/install_torch.sh" "$venv/bin/pip"
# GGML_NATIVE: kernels for this CPU's instruction set (AVX-512/VNNI where present), as a local llama.cpp build does,
# less ggml's AMX kernels, which crash (scripts/llamacpp_cflags.sh); --no-cache-dir: not a wheel pip built earlier
# with other flags.
amx="$("$root/scripts/llamacpp_cflags.sh")"
CFLAGS="$amx ${CFLAGS:-}" CXXFLAGS="$amx ${CXXFLAGS:-}" CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" \
  "$venv/bin/pip" install --no-cache-dir -c "$root/bench/engines-constraints.txt" llama-cpp-python
"$venv/bin/pip" install -c "$root/bench/engines-constraints.txt" "optimum-intel[openvino]" nncf
# optimum-intel declares torchvision, and the only build the registry has is PyPI's CUDA one: with a CPU torch its
# operators fail to register and break transformers' imports. Text models never use it, so it goes.
if ! "$venv/bin/python" -c "import torchvision" >/dev/null 2>&1; then
  "$venv/bin/pip" uninstall -y torchvision
fi
"$venv/bin/python" -c "import llama_cpp, openvino, optimum.intel; \
  print('llama.cpp', llama_cpp.__version__, '| OpenVINO', openvino.__version__)"
