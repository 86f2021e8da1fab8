"""experiments/gpu_check/ (`make gpu-check`) without a GPU: the one skip line, its comparison,
traffic and verdict helpers, which multi-rank rows a machine runs, and a CPU rehearsal of the
whole script (every check, CPU sizes, the multi-rank rows on 2 and 4 gloo ranks)."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from experiments.gpu_check import common, engine_rows, multi_rank_rows, zero_r_rows
from experiments.gpu_check.common import SKIPPED, dp_traffic, parity_distance, verdict

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
    failed = {"ok": False, "error": "Traceback...\nRuntimeError: CUDA out of memory | x"}
    for forced, local in ((failed, {"ok": True}), ({"ok": True}, failed)):  # either run of the pair
        name, measured, _, result = engine_rows.point_row("x", forced, local, SimpleNamespace(stage=1), "bf16")
        assert (name, measured, result) == ("x", "RuntimeError: CUDA out of memory / x", "FAIL")


def stats(grads: int, params: int, psi: int = 1000, padded: int = 1024) -> dict:
    """An engine's stats as far as dp_traffic reads them: the last step's elements by purpose."""
    by_purpose = {"grads": {"elements": grads}, "params": {"elements": params}, "norm": {"elements": 4},
                  "activations": {"elements": 10_000}}
    return {"psi": psi, "padded_psi": padded, "comm": {"last_step": {"by_purpose": by_purpose}}}


def test_dp_traffic_is_the_papers_volume_up_to_padding():
    assert dp_traffic(stats(1024, 1024), 1) == (2.048, True)  # a reduce-scatter and an all-gather, padded
    assert dp_traffic(stats(1024, 2048), 3) == (3.072, True)  # stage 3 gathers twice
    assert dp_traffic(stats(2048, 0), 0) == (2.048, True)     # an all-reduce counts twice its size
    assert dp_traffic(stats(0, 0), 1) == (0.0, False)         # no collective ran (the short circuit)
    assert dp_traffic(stats(1024, 0), 1)[1] is False          # the post-step all-gather missed
    assert dp_traffic(stats(1024, 1024), 3)[1] is False       # stage 3 without its backward gather
    assert dp_traffic(stats(2048, 1024), 1)[1] is False       # a bucket reduced twice


def test_zero_r_through_the_collectives_is_bitwise_or_fails():
    def run(losses: list[float], gathered: int = 0) -> dict:
        traffic = stats(1024, 1024)
        traffic["comm"]["last_step"]["by_purpose"]["activations"]["elements"] = gathered
        return {"ok": True, "value": {"losses": losses, "stats": traffic}, "nondeterministic": ["index_add_"]}
    losses = [6.5, 6.25, 6.0]
    outcomes = {name: run(losses, gathered=100) for name in zero_r_rows.RUNS}
    assert zero_r_rows.collectives_row(outcomes, "x")[3] == "PASS"
    outcomes["C3 (MD)"] = run([6.5, math.nextafter(6.25, 7), 6.0])  # one ulp off in one loss
    _, measured, _, result = zero_r_rows.collectives_row(outcomes, "x")
    assert result == "FAIL" and "C3 (MD): DIFFER by up to 8.88e-16, 2.0480Ψ (nondeterministic ops: index_add_)" in measured
    outcomes["C3 (MD)"] = run(losses)
    outcomes["C4 (Pa, MD)"] = run(losses, gathered=0)  # Pa's gather never went through the communicator
    assert zero_r_rows.collectives_row(outcomes, "x")[3] == "FAIL"


def test_tp_distance_compares_each_tp_rank_with_its_slice_of_the_single_process():
    w0, w1 = torch.zeros(4, 2), torch.arange(8.0).view(4, 2)  # column-parallel: rows split over 2 TP ranks
    b0, b1 = torch.zeros(2), torch.ones(2)                    # replicated (a LayerNorm's bias)
    reference = {"initial": {"w": w0, "b": b0}, "final": {"w": w1, "b": b1}, "losses": [6.0, 5.0]}
    rank = lambda r, rows: {"tp": 2, "tp_rank": r, "partition": {"w": 0, "b": None}, "losses": [6.0, 5.0],  # noqa: E731
                            "final": {"w": w1[rows], "b": b1}}
    ranks = [rank(0, slice(0, 2)), rank(1, slice(2, 4)), rank(0, slice(0, 2)), rank(1, slice(2, 4))]  # TP 2 x DP 2
    assert multi_rank_rows.tp_distance(reference, ranks) == {"update_rel": 0.0, "max_abs": 0.0, "loss_abs": 0.0}
    swapped = [rank(0, slice(2, 4)), rank(1, slice(0, 2))]  # each TP rank holding the other's rows
    d = multi_rank_rows.tp_distance(reference, swapped)
    # 8 elements off by 4 (w1's halves differ by 4 per element) over an update of |w1| and |b1|
    assert math.isclose(d["update_rel"], math.sqrt(8 * 16 / (float((w1 ** 2).sum()) + 2)), rel_tol=1e-9)


def test_multi_rank_rows_run_where_the_gpus_are(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert multi_rank_rows.skipped_layouts() == {}  # a rehearsal runs every layout on CPU ranks
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for count, skipped in ((1, {"world 2": "1 GPU, needs 2", "TP2xDP2": "1 GPU, needs 4"}),
                           (2, {"TP2xDP2": "2 GPUs, needs 4"}), (8, {})):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        assert multi_rank_rows.skipped_layouts() == skipped


@pytest.mark.slow
def test_cpu_rehearsal_runs_every_check():
    done = run_check("--rehearse")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("### GPU check: CPU rehearsal") and "| check | measured | expected | verdict |" in lines
    rows = [line for line in lines if line.startswith("| ") and line.endswith(("| PASS |", "| FAIL |"))]
    # stages, parity, world 2, TP2xDP2 (+ Pa), 1.3B, ZeRO-R, bench
    assert len(rows) == 8 + 4 + 4 + 5 + 1 + 2 + 3 + 1 and all(row.endswith("| PASS |") for row in rows), rows
    stage_rows = [row for row in rows if row.startswith("| tiny_m stage") and "collectives forced" in row]
    assert len(stage_rows) == 8 and all("losses bitwise equal" in row for row in stage_rows)
    # stage 3, bf16 and fp16: 3Ψ less the root's second gather (stage3_keep_root); 2Ψ the rest
    assert sum("stage 3" in row and "DP traffic 2.8" in row for row in stage_rows) == 2
    parity = [row for row in rows if "parity fp32" in row]
    assert len(parity) == 4 and all("update distance 0.00e+00" in row and "vs local copies: bitwise equal" in row
                                    for row in parity)  # CPU against CPU, forced collectives against local copies
    assert sum(row.startswith("| world 2 stage") for row in rows) == 4
    assert sum(row.startswith("| TP2xDP2 stage") for row in rows) == 5
    [pa] = [row for row in rows if row.startswith("| TP2xDP2 stage 2 + Pa")]
    assert "losses and parameters bitwise equal" in pa and "Pa gathered 0 " not in pa
    [forced] = [row for row in rows if row.startswith("| ZeRO-R through the collectives")]
    assert forced.count(": bitwise, 2.0000Ψ") == 4 and forced.count("Pa gathered") == 2
    [md] = [row for row in rows if row.startswith("| MD fragmentation")]
    assert "no allocator on CPU" in md and "arena 0.00 MB" not in md
    [overlap] = [row for row in rows if row.startswith("| Pa+cpu prefetch")]
    assert "on demand 0" in overlap and "bitwise equal" in overlap
    assert lines[-3] == ("rows: stages through the collectives (gloo, world 1) 8, parity 4, world 2 (gloo) 4, "
                         "TP2xDP2 (gloo) 5, tiny_l 1, step-time model 2, ZeRO-R 3, allocator 0 (needs CUDA's own trace), "
                         "bench 1; skipped: none")
    assert sum("vs the step-time model" in row for row in rows) == 2  # prediction_rows.py: GEMM curve, step
    assert lines[-1].startswith("28/28 checks pass")


def test_a_row_that_cannot_be_built_is_a_failed_row():
    def broken():
        raise KeyError("peak_buffers")
    assert common.safe_row("1.3B", broken) == ("1.3B", "KeyError: 'peak_buffers'", "a row", "FAIL")
