"""Long work says how far it is ("k of N", the time left) and nothing else: no megatron-core
INFO lines, no CUDA advice on CPU ranks, no fake-tensor warnings."""
from __future__ import annotations

import re
import subprocess
import sys
from types import SimpleNamespace

import torch

from experiments.commands import REPO
from experiments.sweeps import largest, progress

NOISE = ("[INFO]", "CUDA_DEVICE_MAX_CONNECTIONS", "data pointer of FakeTensor", "Megatron-FSDP")


def test_progress_counts_and_estimates_the_time_left(monkeypatch):
    clock = iter([100.0, 130.0, 160.0, 190.0])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    p = progress.Progress(4)
    assert p.status() == "[0 of 4]"
    assert p.done() == "[1 of 4, about 90 s left]"  # 30 s per item, 3 to go
    p.total, p.estimated, p.what = 10, True, "simulations"
    assert p.done() == "[2 of about 10 simulations, about 4 min left]"
    p.total = 3
    assert p.done() == "[3 of about 3 simulations]"


def test_the_largest_search_expects_a_few_simulations_per_open_row():
    def row(peaks: int, done: bool, failed: str | None = None):
        return SimpleNamespace(peaks=dict.fromkeys(range(peaks)), done=done, failed=failed)
    rows = [row(0, False), row(4, False), row(2, True), row(1, True, "boom")]
    assert largest.expected_simulations(rows) == largest.TYPICAL_SIMULATIONS + 5 + 2 + 2


def test_a_simulated_sweep_counts_its_points_and_prints_no_noise(tmp_path):
    done = subprocess.run([sys.executable, "experiments/sweep.py", "model=tiny_m", "stage=2", "gpus=[2,4]", "tp=2",
                           "simulate=true", "simulate_workers=1", f"results_dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    counted = re.findall(r"\[(\d) of 2(?:, about \d+ s left)?\]$", done.stderr, re.M)
    assert counted == ["1", "2"], done.stderr
    noise = [n for n in NOISE if not (n == "CUDA_DEVICE_MAX_CONNECTIONS" and torch.cuda.is_available())]  # GPU advice
    for text in (done.stdout, done.stderr):
        assert not [n for n in noise if n in text], text
