"""A Slurm job of the submitit launcher (`sweep.py -m hydra/launcher=slurm ...`): one task per GPU,
every task one rank of each of the job's points in turn; rank 0 writes the records."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from omegaconf import DictConfig

from experiments.points import expand
from experiments.run.real import run_as_rank
from experiments.sweeps.local import already_done


def submitit_job():
    """submitit's job environment when this process is a task of a Slurm job it submitted."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return None
    import submitit
    return submitit.JobEnvironment()


def run_in_slurm_job(cfg: DictConfig, job, results_dir: Path) -> None:
    """Inside a job of the submitit launcher, one task per GPU: every task is one rank of each
    of the job's points in turn; rank 0 writes the records."""
    for point in expand(cfg):
        if already_done(point, results_dir, cfg.force):
            continue  # every task reads the same file, so every task skips alike
        os.environ.update(RANK=str(job.global_rank), WORLD_SIZE=str(job.num_tasks), LOCAL_RANK=str(job.local_rank),
                          MASTER_ADDR=job.hostnames[0], MASTER_PORT=str(20000 + int(job.raw_job_id) % 20000))
        try:
            run_as_rank(point, results_dir.parent, "slurm (submitit)")
        except Exception as e:  # rank 0 has recorded why; the job goes on to its next point
            print(f"point {point.point_id} failed: {type(e).__name__}: {e}", file=sys.stderr)
