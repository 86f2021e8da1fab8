# Two commands on a fresh machine: `make test` and `make run`. Both build .venv first.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)

.PHONY: setup test test-timing test-matrix run bench proxies reference-proxies reference-bench reference-host-time calibrate gpu-check reference reference-cpu reference-plans compare notebook clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; zero-repro needs Python 3.11 (set PYTHON=...)"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --constraint constraints.txt --editable '.[test]'
	@rm -f $(VENV)/.installed-* && touch $@

# INSTALL_SLURM=1 runs the real-Slurm tests too (root: they start their own Slurm daemons, and install
# Debian's slurm-wlm and munge when missing; .ci/run sets it); without it they skip, saying why.
INSTALL_SLURM ?=
# Two pytest workers, a test file each at a time (files share module fixtures, such as the Slurm cluster).
TEST_WORKERS ?= 2
test: $(STAMP)
	ZERO_REPRO_INSTALL_SLURM=$(INSTALL_SLURM) $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# make test, timed by tier into results/reference/reports/test_suite.md, which README.md pastes
# (run it on an idle 2-core machine, as CI's).
test-timing: $(STAMP)
	ZERO_REPRO_TIMING=results/reference/reports/test_suite.md $(MAKE) test INSTALL_SLURM=$(INSTALL_SLURM)

# The numerical tests under every CPU kernel family and thread count this CPU allows
# (a verdict must not depend on which CPU runs it): the tests marked numerical; CPU_CAPS/THREADS narrow it.
CPU_CAPS  ?= default avx2 $(shell grep -q avx512f /proc/cpuinfo 2>/dev/null && echo avx512)
THREADS   ?= 1 2
test-matrix: $(STAMP)
	@set -e; for cap in $(CPU_CAPS); do echo "== ATEN_CPU_CAPABILITY=$$cap"; \
	  ATEN_CPU_CAPABILITY=$$cap $(BIN)/python -m pytest -q -p no:cacheprovider -m numerical; done; \
	for n in $(THREADS); do echo "== OMP_NUM_THREADS=$$n"; \
	  OMP_NUM_THREADS=$$n $(BIN)/python -m pytest -q -p no:cacheprovider -m numerical; done

run: $(STAMP)
	$(BIN)/python experiments/sweep.py stage=2

bench: $(STAMP)
	$(BIN)/python -m experiments.bench_engine

# What each system's step would cost a GPU, counted on CPU (kernels, host syncs, collectives, bytes),
# priced on dgx2_v100 and dgx_h100: results/reports/bench/proxies.md, ignored by git (docs/benchmark.md)
proxies: $(STAMP)
	$(BIN)/python -m experiments.bench_proxies

# No command above rewrites a committed file: these targets regenerate the committed benchmark
# tables, each with DeepSpeed installed first (make compare) so that its rows are there, then
# refresh the copies README.md and docs/ paste.
REFERENCE_BENCH := results/reference/bench
reference-proxies: compare
	$(BIN)/python -m experiments.bench_proxies --out $(REFERENCE_BENCH)/proxies.md
	$(BIN)/python -m experiments.reports.pasted

# The committed engine benchmark (docs/benchmark.md, "The committed run"): bench_engine prints its
# table and writes no file, so its output from the table's header on is kept (about 8 minutes on 2 cores).
reference-bench: compare
	@mkdir -p results/reports/bench
	$(BIN)/python -m experiments.bench_engine --repeats 4 > results/reports/bench/bench_engine.out
	sed -n '/^| system /,$$p' results/reports/bench/bench_engine.out > $(REFERENCE_BENCH)/bench_engine_cpu.md
	$(BIN)/python -m experiments.reports.pasted

# The committed host time of one megatron-core layer (experiments/reports/host_ops.py --time), which
# the step-time model's host constant is checked against (validation_host_constants.md, the scorecard).
reference-host-time: $(STAMP)
	$(BIN)/python -m experiments.reports.host_ops --time --out $(REFERENCE_BENCH)/layer_host_time.csv
	$(BIN)/python experiments/report.py results_dir=results/reference/runs out_dir=results/reference/reports
	$(BIN)/python -m experiments.reports.pasted

# This machine's profile for the step-time model (GEMMs, bandwidth, op floor, gloo; under 2 minutes):
# results/calibration/<hostname>.yaml, generated and ignored by git; report.py's prediction check uses it.
calibrate: $(STAMP)
	$(BIN)/python experiments/calibrate.py

# The CUDA path end to end on one GPU (at most 8 minutes); without a GPU, one line and exit 0.
gpu-check: $(STAMP)
	$(BIN)/python -m experiments.gpu_check

# Regenerate the committed simulated reference set (the paper's points at their true world size,
# one rank on fake tensors; about 10 minutes on 2 cores), its reports, and the tables README.md and
# docs/ paste from them.
SIMULATED := fig2 fig4 fig7
SEARCHED  := fig4 table2 fig6
reference: $(STAMP)
	rm -rf $(foreach e,$(sort $(SIMULATED) $(SEARCHED)),results/reference/runs/$(e)/simulated results/reference/reports/$(e))
	@set -e; for e in $(SIMULATED); do \
	  $(BIN)/python experiments/sweep.py experiment=$$e simulate=true results_dir=results/reference/runs; done; \
	for e in $(SEARCHED); do \
	  $(BIN)/python experiments/sweep.py experiment=$$e simulate=true simulate_largest=true results_dir=results/reference/runs; done; \
	for e in $(sort $(SIMULATED) $(SEARCHED)); do \
	  $(BIN)/python experiments/report.py experiment=$$e results_dir=results/reference/runs out_dir=results/reference/reports; done
	$(BIN)/python experiments/report.py results_dir=results/reference/runs out_dir=results/reference/reports
	$(MAKE) reference-plans
	$(BIN)/python -m experiments.reports.pasted

# Regenerate the committed CPU reference records (real runs on this machine's CPU processes: the
# default grid and experiment=table1, about 2 minutes on 2 cores; tests/experiments/test_reference_records.py
# fails when the code no longer gives them), the whole set's report and the tables pasted from it.
CPU_MEASURED := cpu_default table1
reference-cpu: $(STAMP)
	rm -rf $(foreach e,$(CPU_MEASURED),results/reference/runs/$(e))
	@set -e; for e in $(CPU_MEASURED); do \
	  $(BIN)/python experiments/sweep.py experiment=$$e results_dir=results/reference/runs; done
	$(BIN)/python experiments/report.py results_dir=results/reference/runs out_dir=results/reference/reports
	$(BIN)/python -m experiments.reports.pasted

# docs/plan.md's worked example: the plans of a 7B GPT on one 8-GPU node (V100 32 GB, H100 80 GB),
# whole, at TP 1 with recomputation (each stage's micro-batches, all simulated), and under the
# DeepSpeed ZeRO-2 JSON conf/deepspeed/zero2_fp16.json (about 8 minutes on 2 cores).
PLAN := $(BIN)/python experiments/plan.py model=gpt_7b gpus=8 results_dir=results/reference/plans
reference-plans: $(STAMP)
	rm -rf results/reference/plans
	@set -e; for c in dgx2_v100 dgx_h100; do \
	  $(PLAN) cluster=$$c; \
	  $(PLAN) cluster=$$c tps=[1] recompute=[true] confirm=28 max_simulations=28 name=gpt_7b-$$c-g8-tp1; done
	$(PLAN) cluster=dgx2_v100 deepspeed_config=conf/deepspeed/zero2_fp16.json name=gpt_7b-dgx2_v100-g8-ds_zero2

# notebooks/figures.ipynb executed with nbclient (installed with the suite; no Jupyter needed), from
# notebooks/ as Jupyter runs it, into results/reports/figures.ipynb: the committed notebook stays as it is.
NOTEBOOK_OUT := results/reports/figures.ipynb
notebook: $(STAMP)
	@mkdir -p $(dir $(NOTEBOOK_OUT))
	$(BIN)/python -c "import nbclient, nbformat; nb = nbformat.read('notebooks/figures.ipynb', as_version=4); \
	nbclient.NotebookClient(nb, timeout=600, kernel_name='python3', resources={'metadata': {'path': 'notebooks'}}).execute(); \
	nbformat.write(nb, '$(NOTEBOOK_OUT)')"
	@echo "executed: $(NOTEBOOK_OUT) (open it in any notebook viewer)"

# Optional: DeepSpeed as a comparison peer for the benchmarks and tests.
compare: $(STAMP)
	$(BIN)/pip install --quiet --constraint constraints.txt --editable '.[test,compare]'

clean:
	rm -rf $(VENV) .pytest_cache
