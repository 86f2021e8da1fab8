# Two commands on a fresh machine: `make test` and `make run`. Both build .venv first.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)

.PHONY: setup test run bench gpu-check compare clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; zero-repro needs Python 3.11 (set PYTHON=...)"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --constraint constraints.txt --editable '.[test]'
	@rm -f $(VENV)/.installed-* && touch $@

test: $(STAMP)
	$(BIN)/python -m pytest -q

run: $(STAMP)
	$(BIN)/python experiments/sweep.py stage=2

bench: $(STAMP)
	$(BIN)/python -m experiments.bench_engine

# The CUDA path end to end on one GPU (at most 5 minutes); without a GPU, one line and exit 0.
gpu-check: $(STAMP)
	$(BIN)/python experiments/gpu_check.py

# Optional: DeepSpeed as a comparison peer for the benchmarks and tests.
compare: $(STAMP)
	$(BIN)/pip install --quiet --constraint constraints.txt --editable '.[test,compare]'

clean:
	rm -rf $(VENV) .pytest_cache
