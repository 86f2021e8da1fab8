"""The plan slurm/launch.sh prints before any rank starts: the initialization's normal draws per
rank (counted against a meta build) and their cost, and the checkpoint's size and time."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments.launch import spawn
from experiments.models.megatron_gpt import build_gpt, initialize_parallel, param_role
from experiments.models.gpt_shape import GPTShape, normal_draws_per_rank
from experiments.points import cpu_normal_draws_per_s, expand, launch_plan

REPO = Path(__file__).resolve().parents[2]
SHAPE = GPTShape(layers=3, hidden=32, heads=4, seq_len=24, vocab_size=300)


def _drawn_full_elements(tp: int) -> int:
    """Every drawn parameter's TP=1 size, from megatron's own layout of a meta build."""
    initialize_parallel(tp)
    with torch.device("meta"):
        model = build_gpt(SHAPE)
    return sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
               for name, p in model.named_parameters() if param_role(name).fill == "normal")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_normal_draws_per_rank_counts_every_weight_whole(tp):
    assert normal_draws_per_rank(SHAPE, tp) == spawn(_drawn_full_elements, tp, tp, timeout=120)[0]


def test_plan_of_the_100b_job(compose):
    [point] = expand(compose("experiment=fig2", "model=fig2_100b", "stage=2", "gpus=400", "tp=16", "micro_batch=32",
                             "cluster=dgx2_v100", "train.precision=fp16"))[:1]
    # 125 layers x 12 x 8192^2 + (51200 + 1024) x 8192 = 1.0109e11 values, 4 B each at 900 GB/s;
    # at 1.5e8 draws/s 674 s; 12 B x 6.33e9 parameters per TP rank / DP 25 = 3.04 GB per rank,
    # 16 ranks per node at 2 GB/s: 24 s
    assert launch_plan(point, 1.5e8) == (
        "plan: init draws 1.01e+11 normal values per rank (every weight whole): >= 0.4 s on the GPU (4 B per value at "
        "hbm_gb_per_s=900), 11.2 min on this host's CPU (150 M/s measured, one core); a checkpoint is 3.04 GB per rank, "
        "24 s per save at checkpoint_write_gb_per_s=2 per node, within Slurm's 600 s warning")
    local = expand(compose("experiment=cpu_default", "model=tiny_s", "stage=2", "gpus=2", "tp=1", "micro_batch=2"))[0]
    assert launch_plan(local, 1e8).endswith("(cluster.checkpoint_write_gb_per_s unknown: its time is not checked)")


def test_cpu_draw_rate_is_measured():
    rate = cpu_normal_draws_per_s(2 ** 16)
    assert 1e6 < rate < 1e11  # any CPU of this century, one core


def test_launchers_check_prints_the_plan_once():
    done = subprocess.run([sys.executable, str(REPO / "experiments" / "train.py"), "model=tiny_s", "gpus=2"],
                          env={**os.environ, "ZERO_REPRO_CHECK_ONLY": "1"}, capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stdout.splitlines() if line.startswith("plan: ")] == [done.stdout.strip()]
