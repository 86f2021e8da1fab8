"""Long work says how far it is ("k of N", the time left) and nothing else: no megatron-core
INFO lines, no CUDA advice on CPU ranks, no fake-tensor warnings."""
from __future__ import annotations

import re
import subprocess
import sys

import torch

from experiments.commands import REPO
from experiments.points import expand
from experiments.sweeps import largest, progress

NOISE = ("[INFO]", "CUDA_DEVICE_MAX_CONNECTIONS", "data pointer of FakeTensor", "Megatron-FSDP")


def test_progress_counts_and_estimates_the_time_left_of_items_run_in_parallel(monkeypatch):
    """Two workers: the first item ends after 30 s while the second has run as long, so the three
    left take 30 s each, two at a time: 45 s, not the 90 s that the time so far per finished item
    says."""
    now = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    p = progress.Progress(4, workers=2)
    assert p.status() == "[0 of 4]"
    p.start("a"), p.start("b")
    now[0] = 130.0
    assert p.done("a") == "[1 of 4, about 45 s left]"
    p.start("c")
    now[0] = 150.0  # b took 50 s: the mean is 40 s, two left at a time
    assert p.done("b") == "[2 of 4, about 40 s left]"
    p.total, p.qualifier, p.what = 10, "at least", "simulations"
    p.start("d")
    now[0] = 160.0  # c took 30 s (mean 110 / 3), 7 left
    assert p.done("c") == "[3 of at least 10 simulations, at least 2 min left]"
    p.total, p.qualifier = 4, "about"
    now[0] = 190.0
    assert p.done("d") == "[4 of about 4 simulations]"


def test_the_largest_search_expects_the_simulations_each_rows_range_needs(compose):
    """An open row's remaining simulations follow from its range: ceil(log2(hi - lo)) between a
    fitting and a failing depth (the committed Table 2 row 87 fits, 134 fails: 6 more, as it
    took), ceil(log2(hi)) below a failing depth with none fitting, and at least one (two with
    nothing simulated) while nothing failed, which makes the total a lower bound."""
    [point] = expand(compose("model=tiny_s", "gpus=[4]", "stage=2", "cluster=dgx2_v100"))

    def row(outcomes: dict[int, bool], failed: str | None = None) -> largest.Search:
        search = largest.Search(point)
        search.fits, search.peaks, search.failed = dict(outcomes), dict.fromkeys(outcomes, 0), failed
        return search
    assert largest.remaining_simulations(row({87: True, 134: False})) == (6, False)
    assert largest.remaining_simulations(row({64: False})) == (6, False)
    assert largest.remaining_simulations(row({130: True, 131: False})) == (0, False)  # done
    assert largest.remaining_simulations(row({73: True})) == (1, True)
    assert largest.remaining_simulations(row({})) == (2, True)
    assert largest.remaining_simulations(row({5: True}, failed="boom")) == (0, False)
    capped = row({n: True for n in range(1, largest.MAX_SIMULATIONS - 1)} | {4000: False})
    assert largest.remaining_simulations(capped) == (1, False)  # the row's last allowed simulation
    assert largest.expected_simulations([row({87: True, 134: False}), row({64: False})]) == (12, False)
    assert largest.expected_simulations([row({87: True, 134: False}), row({73: True})]) == (7, True)


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
