# Two commands on a fresh machine: `make test` and `make run`. Both build .venv first.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)

.PHONY: setup test test-matrix run bench gpu-check compare clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; zero-repro needs Python 3.11 (set PYTHON=...)"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --constraint constraints.txt --editable '.[test]'
	@rm -f $(VENV)/.installed-* && touch $@

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The numerical tests under every CPU kernel family and thread count this CPU allows
# (a verdict must not depend on which CPU runs it); CPU_CAPS/THREADS narrow it.
NUMERICAL := tests/test_parity.py tests/test_megatron_tp.py tests/test_stage3.py tests/test_stage3_schedule.py \
             tests/test_fp16_overflow.py tests/test_memory_comm.py tests/test_megatron_init.py tests/test_zero_r.py \
             tests/test_checkpoint.py tests/test_construction_memory.py tests/test_engine_lifetime.py
CPU_CAPS  ?= default avx2 $(shell grep -q avx512f /proc/cpuinfo 2>/dev/null && echo avx512)
THREADS   ?= 1 2
test-matrix: $(STAMP)
	@set -e; for cap in $(CPU_CAPS); do echo "== ATEN_CPU_CAPABILITY=$$cap"; \
	  ATEN_CPU_CAPABILITY=$$cap $(BIN)/python -m pytest -q -p no:cacheprovider $(NUMERICAL); done; \
	for n in $(THREADS); do echo "== OMP_NUM_THREADS=$$n"; \
	  OMP_NUM_THREADS=$$n $(BIN)/python -m pytest -q -p no:cacheprovider $(NUMERICAL); done

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
