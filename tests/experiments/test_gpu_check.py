"""experiments/gpu_check/ (`make gpu-check`) without a GPU: the one skip line, its comparison
and verdict helpers, and a CPU rehearsal of the whole script (every check, CPU sizes)."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import torch

from experiments.gpu_check import common, engine_rows
from experiments.gpu_check.common import SKIPPED, verdict
from experiments.gpu_check.engine_rows import parity_distance

REPO = Path(__file__).resolve().parents[2]
NO_GPU = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # also on a machine with GPUs: the check must skip


def run_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.gpu_check", *args], cwd=REPO, env=NO_GPU,
                          capture_output=True, text=True, timeout=600)


def test_without_cuda_it_prints_one_line_and_exits_0():
    done = run_check()
    assert done.returncode == 0, done.stderr
    assert done.stdout == SKIPPED + "\n" and "skipped" in SKIPPED


def fake_run(scale: float = 0.0, loss_shift: float = 0.0) -> dict:
    initial = {"w": torch.zeros(2, 2), "b": torch.zeros(3)}
    final = {"w": torch.full((2, 2), 0.5), "b": torch.tensor([0.0, 0.0, 1.0])}  # update norm sqrt(4 * 0.25 + 1)
    final = {n: t + scale * torch.ones_like(t) for n, t in final.items()}
    return {"initial": initial, "final": final, "losses": [6.0 + loss_shift, 5.0]}


def test_parity_distance_is_relative_to_the_update():
    assert parity_distance(fake_run(), fake_run()) == {"update_rel": 0.0, "max_abs": 0.0, "loss_abs": 0.0}
    d = parity_distance(fake_run(), fake_run(scale=1e-3, loss_shift=2e-5))
    assert math.isclose(d["update_rel"], math.sqrt(7 * 1e-6 / 2), rel_tol=1e-4)  # 7 elements off by 1e-3 (fp32)
    assert math.isclose(d["max_abs"], 1e-3, rel_tol=1e-4) and math.isclose(d["loss_abs"], 2e-5, rel_tol=1e-6)
    other = fake_run()
    del other["final"]["b"]  # a run that lost a parameter is infinitely far, never "close"
    assert parity_distance(fake_run(), other)["update_rel"] == math.inf
    other = fake_run()
    other["losses"] = other["losses"][:1]
    assert parity_distance(fake_run(), other)["loss_abs"] == math.inf


def test_verdict_fails_on_nan_and_on_any_failed_check():
    assert verdict(True, 1e-5 <= 1e-3) == "PASS"
    assert verdict(True, float("nan") <= 1e-3) == "FAIL" and verdict(False) == "FAIL"
    assert engine_rows.PARITY["update_bound"] == 1e-3 and engine_rows.PARITY["loss_bound"] == 1e-4


def test_a_failed_point_is_a_row_that_says_why():
    row = engine_rows.point_row("x", {"ok": False, "error": "Traceback...\nRuntimeError: CUDA out of memory | x"},
                              None, "bf16")
    assert row == ("x", "RuntimeError: CUDA out of memory / x", "trains", "FAIL")


def test_cpu_rehearsal_runs_every_check():
    done = run_check("--rehearse")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("### GPU check: CPU rehearsal") and "| check | measured | expected | verdict |" in lines
    rows = [line for line in lines if line.startswith("| ") and line.endswith(("| PASS |", "| FAIL |"))]
    assert len(rows) == 8 + 4 + 1 + 2 + 1 and all(row.endswith("| PASS |") for row in rows), rows
    assert sum("parity fp32" in row and "update distance 0.00e+00" in row for row in rows) == 4  # CPU against CPU
    [md] = [row for row in rows if row.startswith("| MD fragmentation")]
    assert "no allocator on CPU" in md and "arena 0.00 MB" not in md
    [overlap] = [row for row in rows if row.startswith("| Pa+cpu prefetch")]
    assert "on demand 0" in overlap and "bitwise equal" in overlap
    assert lines[-1].startswith("16/16 checks pass")


def test_a_row_that_cannot_be_built_is_a_failed_row():
    def broken():
        raise KeyError("peak_buffers")
    assert common.safe_row("1.3B", broken) == ("1.3B", "KeyError: 'peak_buffers'", "a row", "FAIL")
