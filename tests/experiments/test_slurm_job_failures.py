"""A Slurm job of several points (the submitit path, experiments/sweeps/slurm_job.py) after one
rank fails: every rank goes on to the next point, and rank 0's record says why."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from experiments.launch import RankFailed, spawn
from experiments.points import expand
from experiments.records import load_records, read_record
from experiments.sweeps.slurm_job import run_job_points

REPO = Path(__file__).resolve().parents[2]
TINY = ("model=tiny_s", "gpus=2", "train.warmup_steps=1", "train.steps=2")


def _job_port() -> int:
    """A free port that slurm_job derives from a job id (10000 + id % 20000)."""
    for port in range(10000 + time.monotonic_ns() % 19000, 30000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port in 10000-29999")


def _task(points, results_dir, port) -> float:
    """One task of the job, as submitit starts it: its rank from the job environment."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()  # every rank is done setting up spawn's group (else rank 1 may still connect to rank 0's)
    dist.destroy_process_group()  # spawn's; a Slurm task starts without one
    job = SimpleNamespace(global_rank=rank, num_tasks=world, local_rank=rank, hostnames=["127.0.0.1"],
                          raw_job_id=str(port - 10000))
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


def test_a_silent_rank_ends_the_job_after_rank_0_recorded_it(compose, tmp_path):
    """Rank 1 hangs outside any collective (as a rank stuck in its own code, or one the kernel
    killed, would): rank 0 leaves the barrier at the group's timeout (train.timeout_s), waits as
    long again for rank 1's outcome, records that rank 1 was silent, and the job ends (RanksLost)
    before point 2, which the two ranks can no longer train together."""
    stuck = expand(compose(*TINY, "stage=1", "train.fault=hang_last_rank", "train.timeout_s=4",
                           f"results_dir={tmp_path}"))[0]
    healthy = expand(compose(*TINY, "stage=2", f"results_dir={tmp_path}"))[0]
    results_dir = tmp_path / stuck.experiment
    began = time.monotonic()
    with pytest.raises(RankFailed, match="RanksLost: ranks \\[1\\] posted no outcome within 4 s") as failed:
        spawn(_task, 2, [stuck, healthy], results_dir, _job_port(), timeout=60)
    assert failed.value.rank == 0 and time.monotonic() - began < 30  # 2 x 4 s of timeouts, and the start
    record = read_record(results_dir / f"{stuck.point_id}.json")
    assert record["status"] == "fail" and record["error"].startswith("ranks [1] posted no outcome within 4 s")
    assert "rank 0 failed first" in record["error"]  # its barrier's timeout, the only failure anyone posted
    assert read_record(results_dir / f"{healthy.point_id}.json") is None


def test_a_preempted_point_is_recorded_before_any_rank_leaves(compose, tmp_path, monkeypatch):
    """Slurm's warning (the stop file): both ranks save after step 1 and raise Preempted, which
    the job's loop takes as a point that did not finish; rank 0's record says where to resume,
    the launcher's requeue marker is there, and the pending record is gone."""
    stop = tmp_path / "stop_requested"
    stop.touch()
    monkeypatch.setenv("ZERO_REPRO_STOP_FILE", str(stop))  # inherited by spawn's forked ranks
    point = expand(compose(*TINY, "stage=2", f"results_dir={tmp_path}"))[0]
    results_dir = tmp_path / point.experiment
    spawn(_task, 2, [point], results_dir, _job_port(), timeout=60)
    record = read_record(results_dir / f"{point.point_id}.json")
    assert record["status"] == "timeout" and "stopped after step 1" in record["error"]
    saved = results_dir / "checkpoints" / point.checkpoint_id / "step_1"
    assert record["resume"] == {"last_step": 1, "checkpoint": str(saved)}
    assert Path(f"{stop}.saved").exists() and not list(results_dir.glob("*.pending"))


@pytest.mark.slow
def test_torchrun_point_records_the_failing_rank(tmp_path):
    """The single-point path (train.py under torchrun, whose store carries the agreement): rank
    0's record carries rank 1's error (the sweep keeps a failed record the ranks wrote)."""
    done = subprocess.run([sys.executable, str(REPO / "experiments" / "sweep.py"), "model=tiny_s", "gpus=[2]",
                           "stage=2", "launcher=torchrun", "train.fault=raise_last_rank", f"results_dir={tmp_path}",
                           "train.warmup_steps=1", "train.steps=2"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr  # the sweep goes on; the point's record says what failed
    [record] = load_records(tmp_path, "cpu_default")
    assert record["status"] == "fail" and record["error"].startswith("rank 1 failed first"), record["error"]
    assert "injected fault (train.fault=raise_last_rank) on rank 1" in record["error"]


def test_every_task_runs_the_points_rank_0_found_left(compose, tmp_path, monkeypatch):
    """Rank 0 publishes which points are left: a task that sees an ok record rank 0 does not
    (another node's stale view of the shared folder) still runs every point with it, instead of
    waiting on another point's keys."""
    from experiments.sweeps import slurm_job

    class Store:  # the job's one TCPStore, shared by the tasks
        values: dict[str, bytes] = {}

        def __init__(self, *args, **kwargs):
            pass

        def set(self, key: str, value: str) -> None:
            self.values[key] = value.encode()

        def get(self, key: str) -> bytes:
            return self.values[key]

    first, second = (expand(compose(*TINY, f"stage={s}", f"results_dir={tmp_path}"))[0] for s in (1, 2))
    monkeypatch.setattr(slurm_job.dist, "TCPStore", Store)
    monkeypatch.setattr(slurm_job, "query_addresses", lambda hosts: {h: h for h in hosts})
    ran = []
    monkeypatch.setattr(slurm_job, "run_as_rank", lambda point, *args: ran.append((os.environ["RANK"], point)))
    for rank, view in ((0, tmp_path / "rank0"), (1, tmp_path / "rank1")):
        job = SimpleNamespace(global_rank=rank, num_tasks=2, local_rank=rank, hostnames=["node1"], raw_job_id="7")
        if rank == 1:  # this task sees the first point done
            view.mkdir()
            (view / f"{first.point_id}.json").write_text(json.dumps({"status": "ok"}))
        slurm_job.run_job_points([first, second], job, view, force=False, ignore_host_memory=True)
    assert ran == [("0", first), ("0", second), ("1", first), ("1", second)]
