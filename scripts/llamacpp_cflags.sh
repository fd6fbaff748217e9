#!/usr/bin/env sh
# C/C++ flags for building llama-cpp-python natively (GGML_NATIVE): on x86-64, leave out ggml's AMX kernels, which
# -march=native compiles in on AMX CPUs (Sapphire Rapids and later Xeons) and which crash the process at the first
# matrix product (an ldtilecfg on a half-written tile configuration: llama.cpp issue 20824, PR 26954). GCC and clang
# keep an explicit -mno-* over what -march=native turns on, whatever their order. Used by `make llamacpp` and
# scripts/install_engines.sh; toolkit/models/llamacpp.py refuses a build that has them.
case "$(uname -m)" in
  x86_64|amd64) echo "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" ;;
  *) echo "" ;;
esac
