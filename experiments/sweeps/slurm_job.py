"""A Slurm job of the submitit launcher (`sweep.py -m hydra/launcher=slurm ...`): one task per GPU,
every task one rank of each of the job's points in turn; rank 0 writes the records."""
from __future__ import annotations

import gc
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from omegaconf import DictConfig

from experiments.points import ConfigError, Point, check_host_memory, expand
from experiments.run.outcome import RanksLost
from experiments.run.real import run_as_rank
from experiments.slurm_nodes import query_addresses, rendezvous_port
from experiments.sweeps.local import already_done, record_invalid

LAUNCHER = "slurm (submitit)"  # the records' launcher


def submitit_job():
    """submitit's job environment when this process is a task of a Slurm job it submitted."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return None
    import submitit
    return submitit.JobEnvironment()


def run_in_slurm_job(cfg: DictConfig, job, results_dir: Path) -> None:
    """Inside a job of the submitit launcher, one task per GPU: every task is one rank of each
    of the job's points in turn; rank 0 writes the records."""
    run_job_points(expand(cfg), job, results_dir, cfg.force, cfg.ignore_host_memory)


def run_job_points(points: list[Point], job, results_dir: Path, force: bool, ignore_host_memory: bool = False) -> None:
    """`points` in turn on the job's tasks (`job`: submitit's JobEnvironment). One TCPStore for
    the whole job, served by rank 0 at the job's port, carries every point's rendezvous and the
    ranks' agreement on its outcome (experiments/run/outcome.py): after a failed point every task
    goes on to the next one; after a rank fell silent (died, or stuck) the job ends."""
    os.environ.update(RANK=str(job.global_rank), WORLD_SIZE=str(job.num_tasks), LOCAL_RANK=str(job.local_rank))
    # per-point keys (each point's own prefix); rank 0 waits here for every task to connect
    timeout = timedelta(seconds=max(p.train["timeout_s"] for p in points))
    # at the first node's address as Slurm has it: its name may resolve nowhere but in Slurm
    head = job.hostnames[0]
    store = dist.TCPStore(query_addresses([head])[head], rendezvous_port(int(job.raw_job_id)), job.num_tasks,
                          is_master=job.global_rank == 0, timeout=timeout)
    # Rank 0 decides which points are left, for every task: a task that saw the records' folder
    # otherwise (another node's cache of a shared file system) would wait on other points' keys.
    if job.global_rank == 0:
        store.set("job/todo", json.dumps([p.point_id for p in points if not already_done(p, results_dir, force)]))
    by_id = {p.point_id: p for p in points}
    todo = [by_id[point_id] for point_id in json.loads(store.get("job/todo"))]
    for point in todo:
        if not ignore_host_memory and _host_refuses(point, job, store, results_dir):
            continue
        try:
            run_as_rank(point, results_dir.parent, LAUNCHER, store)
        except (RanksLost, dist.DistError):
            raise  # a silent rank, or the job's store gone with rank 0: no later point can run
        except Exception as e:  # every rank raises alike; rank 0 has recorded why
            print(f"point {point.point_id} failed: {type(e).__name__}: {e}", file=sys.stderr)
            del e
            gc.collect()  # the failed point's engine, held in reference cycles, would crowd the next one



def _host_refuses(point: Point, job, store: dist.Store, results_dir: Path) -> bool:
    """Whether a node cannot hold the point's ranks on CPU (points.check_host_memory for the job's
    tasks per node; GPU ranks are not checked). Rank 0 decides for every task, through the job's
    store: tasks that disagreed would wait for each other in the point's rendezvous. It records
    the point invalid with the refusal's line, as a local sweep does."""
    key = f"{point.point_id}/host_memory"
    if job.global_rank == 0:
        try:
            check_host_memory(point, job.num_tasks // len(job.hostnames))
            store.set(key, "")
        except ConfigError as e:
            record_invalid(point, LAUNCHER, results_dir, e)
            store.set(key, str(e))
    return bool(store.get(key))
