"""A Slurm job of several points (the submitit path, experiments/sweeps/slurm_job.py) after one
rank fails: every rank goes on to the next point, and rank 0's record says why."""
from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from experiments.launch import spawn
from experiments.points import expand
from experiments.records import read_record
from experiments.sweeps.slurm_job import run_job_points

TINY = ("model=tiny_s", "gpus=2", "train.warmup_steps=1", "train.steps=2")


def _job_port() -> int:
    """A free port that slurm_job derives from a job id (20000 + id % 20000)."""
    for port in range(20000 + time.monotonic_ns() % 19000, 40000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port in 20000-39999")


def _task(points, results_dir, port) -> float:
    """One task of the job, as submitit starts it: its rank from the job environment."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()  # spawn's; a Slurm task starts without one
    job = SimpleNamespace(global_rank=rank, num_tasks=world, local_rank=rank, hostnames=["127.0.0.1"],
                          raw_job_id=str(port - 20000))
    began = time.monotonic()
    run_job_points(points, job, results_dir, force=False)
    return time.monotonic() - began


@pytest.mark.parametrize("fault, failing", [("raise_last_rank", 1), ("raise", 0)])
def test_a_rank_failing_mid_point_leaves_the_job_to_its_next_point(compose, tmp_path, fault, failing):
    """One rank raises at step 1 while the other waits for it in the step's barrier. Both ranks
    must reach point 2, and point 1's record must carry the failing rank's error, not another
    rank's view of it (the connection it lost). Before run/outcome.py, with rank 1 failing, rank
    0 recorded its own lost connection and the job hung at point 2's rendezvous."""
    broken = expand(compose(*TINY, "stage=1", f"train.fault={fault}", f"results_dir={tmp_path}"))[0]
    healthy = expand(compose(*TINY, "stage=2", f"results_dir={tmp_path}"))[0]
    results_dir = tmp_path / broken.experiment
    elapsed = spawn(_task, 2, [broken, healthy], results_dir, _job_port(), timeout=90)
    first = read_record(results_dir / f"{broken.point_id}.json")
    second = read_record(results_dir / f"{healthy.point_id}.json")
    assert first["status"] == "fail", first["error"]
    assert first["error"].startswith(f"rank {failing} failed first")
    assert f"injected fault (train.fault={fault}) on rank {failing}" in first["error"]
    assert second["status"] == "ok" and len(second["losses"]) == 3, second["error"]
    # both points take ~3 s here; a wait for any timeout (train.timeout_s: 600 s) would not fit
    assert max(elapsed) < 45
