"""A sweep: the grid of one experiment (model x stage x GPU count x TP), run point by point.

    python experiments/sweep.py stage=2                      # CPU default grid, stage 2: < 3 min on 2 cores
    python experiments/sweep.py experiment=fig2 dry_run=true # the paper's Figure 2 points, not run
    python experiments/sweep.py model=tiny_m gpus=[1,2,4] stage=[1,3] force=true
    python experiments/sweep.py -m stage=1,2,3               # Hydra multirun: one sweep per stage

Every point is validated before anything starts (bad input: one line on stderr, exit code 2,
nothing written). Each point runs on local ranks (forked processes, or torchrun), under a
timeout; a failed, hung or out-of-memory point is recorded with its status and the sweep goes
on; points that already have an `ok` record are skipped unless force=true. At the end a
Table-5-style summary is printed and written as summary.csv beside the records.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from experiments.cli import exit_on_interrupt, preflight_or_exit
from experiments.points import ConfigError, check_runnable_here, check_simulate_rank, expand
from experiments.schema import register

register()


def run_sweep(cfg: DictConfig) -> int:
    """The sweep the config describes: listed (dry_run), simulated, searched (simulate_largest) or run here."""
    # imported once the preflight has passed: a bad command line is refused without them (and megatron-core)
    from experiments.sweeps.dry_run import dry_run
    from experiments.sweeps.largest import run_sweep_largest
    from experiments.sweeps.local import run_local_sweep
    from experiments.sweeps.simulated import run_sweep_simulated
    points = expand(cfg)
    print(f"experiment {cfg.experiment.name}: {len(points)} points. {cfg.experiment.description}")
    results_dir = _absolute(cfg.results_dir) / cfg.experiment.name
    if cfg.dry_run:
        dry_run(points)
        return 0
    if cfg.simulate and cfg.simulate_largest:  # the largest model of each row's family that fits
        return run_sweep_largest(points, results_dir, rank=cfg.simulate_rank, workers=cfg.simulate_workers)
    if cfg.simulate:  # one rank of each point's full world, on fake tensors
        return run_sweep_simulated(points, results_dir, rank=cfg.simulate_rank, workers=cfg.simulate_workers,
                                   force=cfg.force)
    return run_local_sweep(points, results_dir, cfg.launcher, cfg.force, cfg.experiment.name, cfg.ignore_host_memory)


def _absolute(path: str) -> Path:
    """Relative paths are relative to where the command was started, wherever the job runs."""
    from hydra.core.hydra_config import HydraConfig
    start = Path(HydraConfig.get().runtime.cwd) if HydraConfig.initialized() else Path.cwd()
    return start / path


def interrupted(cfg: DictConfig) -> str:
    """What a Ctrl-C leaves behind in each mode, and what the same command does next."""
    if cfg.simulate and cfg.simulate_largest:
        return (f"the search's finished simulations are kept in {cfg.experiment.name}/simulated/search/ (the running "
                "ones say they were interrupted); the same command again starts each row's search from them")
    if cfg.simulate:
        return (f"the finished simulations' records are kept in {cfg.experiment.name}/simulated/ (the running ones say "
                "they were interrupted); the same command again simulates the points without an ok or oom record")
    return ("the records written so far are kept (the point that was running says it was interrupted); "
            "the same command again goes on, skipping points with an ok record")


@hydra.main(config_path="../conf", config_name="sweep", version_base="1.3")
@exit_on_interrupt(interrupted)
def main(cfg: DictConfig) -> None:
    from experiments.sweeps.slurm_job import run_in_slurm_job, submitit_job
    try:
        job = submitit_job()
        if job is not None:
            run_in_slurm_job(cfg, job, _absolute(cfg.results_dir) / cfg.experiment.name)
        else:
            run_sweep(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def _validate(cfg: DictConfig, remote: bool) -> None:
    points = expand(cfg)
    if remote:  # one Slurm job per multirun job, one task per GPU: one GPU count per job
        if cfg.gpus is None or isinstance(cfg.gpus, (list, tuple)) or OmegaConf.is_list(cfg.gpus):
            raise ConfigError("with a Slurm launcher, give gpus one value (tasks per job follow it), e.g. gpus=8")
    elif cfg.simulate and not cfg.dry_run:
        check_simulate_rank(points, cfg.simulate_rank)
    elif not cfg.dry_run and cfg.launcher != "torchrun":
        check_runnable_here(points)
        if cfg.launcher == "fork" and torch.cuda.is_available():
            raise ConfigError("launcher=fork cannot start GPU ranks (CUDA does not survive fork); use auto, spawn or torchrun")


if __name__ == "__main__":
    preflight_or_exit("sweep", sys.argv[1:], _validate)
    main()
