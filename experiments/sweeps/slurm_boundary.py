"""hydra/launcher=slurm's checks before anything is submitted (a Hydra callback that
conf/hydra/launcher/slurm.yaml adds): a Slurm that answers here, as many tasks per job as the
point has GPUs, and as many GPUs per node as tasks. Without them, no Slurm is a 45-line traceback from submitit, and a task count
that is not gpus a job whose ranks refuse to start. Bad input is one line on stderr and exit
code 2, as everywhere in the suite."""
from __future__ import annotations

import shutil
import subprocess
import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SlurmBoundary(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        problem = (slurm_unreachable() or task_count_problem(config.hydra.launcher, config.gpus)
               or gpu_count_problem(config.hydra.launcher))
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            sys.exit(2)


def slurm_unreachable() -> str | None:
    """Why no job can be submitted from here, or None: sbatch must exist and a controller answer."""
    if shutil.which("sbatch") is None:
        return "hydra/launcher=slurm submits with sbatch, which is not installed here: run it where Slurm is"
    try:
        done = subprocess.run(["sinfo", "--noheader", "--format=%P"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"hydra/launcher=slurm: sinfo could not reach Slurm's controller ({e})"
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return f"hydra/launcher=slurm: no Slurm controller answers here (sinfo: {said.strip()})"
    return None


def task_count_problem(launcher: DictConfig, gpus: Any) -> str | None:
    """Every task is one rank of the job's points: nodes x tasks_per_node must be gpus."""
    nodes, per_node = launcher.nodes or 1, launcher.tasks_per_node or 1
    if nodes * per_node == gpus:
        return None
    fix = (f"give hydra.launcher.tasks_per_node={gpus // nodes}" if gpus % nodes == 0 else
           f"give gpus a multiple of hydra.launcher.nodes={nodes}")
    return f"gpus={gpus} but hydra.launcher starts {nodes} node(s) x {per_node} task(s): {fix}"


def gpu_count_problem(launcher: DictConfig) -> str | None:
    """One task per GPU: a node's GPUs (gpus_per_node, null for CPU nodes) must be its tasks.
    gpus_per_node follows gpus, so over several nodes it asks each node for all the job's GPUs."""
    per_node, tasks = launcher.gpus_per_node, launcher.tasks_per_node or 1
    if per_node is None or per_node == tasks:
        return None
    return (f"hydra.launcher.gpus_per_node={per_node} but tasks_per_node={tasks}: every task is one GPU's rank; "
            f"give hydra.launcher.gpus_per_node={tasks}")
