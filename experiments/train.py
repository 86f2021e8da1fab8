"""One benchmark point, as torchrun or srun runs it on every rank (experiments/run/real.py):

    torchrun --nproc-per-node=2 experiments/train.py model=tiny_s stage=2 gpus=2
    srun python experiments/train.py model=fig4_13b stage=2 gpus=128 cluster=dgx2_v100
    python experiments/train.py model=fig4_13b stage=2 gpus=128 cluster=dgx2_v100 simulate=true

Rank 0 writes results/runs/<experiment>/<point_id>.json, also when the point fails. With
simulate=true this process plays one rank of the whole world on fake tensors
(experiments/run/fake.py) and writes the record under <experiment>/simulated/.
"""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra
from omegaconf import DictConfig

from experiments.cli import exit_on_interrupt, preflight_or_exit
from experiments.commands import quoted, script_command, train_command
from experiments.points import (ConfigError, Point, check_host_memory, check_runnable_here, check_simulate_rank,
                                cpu_normal_draws_per_s, launch_plan, point_from_train_config)
from experiments.schema import register

register()


def simulate(cfg: DictConfig) -> int:
    """simulate=true: the point's record and its summary row; 0 unless the simulation failed."""
    from experiments.run.fake import simulate_and_record
    from experiments.sweeps.summary import simulated_summary_markdown, simulated_summary_rows
    point = point_from_train_config(cfg)
    record, path = simulate_and_record(point, Path(cfg.results_dir), cfg.simulate_rank)
    print(simulated_summary_markdown(simulated_summary_rows([point], path.parent.parent, cfg.simulate_rank)))
    print(f"{record['status']}: {path}" + (f"\n{record['error']}" if record.get("error") else ""))
    return 0 if "simulation" in record else 1


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
@exit_on_interrupt("this run wrote no record (one with checkpoints resumes with train.resume=true)")
def main(cfg: DictConfig) -> None:
    # imported once the preflight has passed: a bad command line is refused without megatron-core
    from experiments import records
    from experiments.run.real import run_as_rank
    from experiments.run.record import resume_line
    from experiments.sweeps.summary import point_summary_line
    if "WORLD_SIZE" not in os.environ:  # a plain `python experiments/train.py gpus=1`: a world of one,
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",  # on a port no other run holds
                          MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()))
    try:
        if cfg.simulate:
            sys.exit(simulate(cfg))
        path = run_as_rank(point_from_train_config(cfg), Path(cfg.results_dir),
                           os.environ.get("ZERO_REPRO_LAUNCHER", "torchrun"))
        if path is not None:  # rank 0: what the run measured, whether it resumed, and where its record is
            print(point_summary_line(path))
            print(resume_line(records.read_record(path)))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def _validate(cfg: DictConfig, remote: bool) -> None:
    point = point_from_train_config(cfg)
    if cfg.simulate:
        check_simulate_rank([point], cfg.simulate_rank)
    else:
        if os.environ.get("ZERO_REPRO_CHECK_ONLY") == "1":  # slurm/launch.sh's check, once per job: its plan
            print(launch_plan(point, cpu_normal_draws_per_s()))
        else:
            check_launcher_world(point, sys.argv[1:])
        if not cfg.ignore_host_memory:
            check_host_memory_once(point)


def check_host_memory_once(point: Point) -> None:
    """points.check_host_memory for the ranks this host runs of the job (LOCAL_WORLD_SIZE: torchrun
    sets it, slurm/launch.sh's check its ranks per node; plain python: one). Every rank checks, so
    that none builds a point its host cannot hold; local rank 0 alone says why, once a host, and
    the others exit with the same code quietly."""
    try:
        check_host_memory(point, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ConfigError:
        if int(os.environ.get("LOCAL_RANK", "0")) != 0:
            sys.exit(2)
        raise


def free_port() -> int:
    """A TCP port free on this host now (two world-of-one runs at once must not share 29500)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_launcher_world(point: Point, argv: list[str]) -> None:
    """A point of N ranks needs a launcher that starts as many (torchrun on a node, slurm/launch.sh
    across nodes); a plain `python experiments/train.py gpus=2` is a world of one. Say how to start
    it instead: the launcher its cluster's nodes need, the sweep where this machine can run it, or
    one rank simulated."""
    gpus, world = point.gpus, int(os.environ.get("WORLD_SIZE", "1"))
    if world == gpus:
        return
    if "WORLD_SIZE" in os.environ:
        raise ConfigError(f"gpus={gpus} but the launcher started {world} ranks; give gpus={world} "
                          f"or start {gpus} ranks")
    ways = [f"`{train_command(quoted(argv), gpus, point.cluster.get('gpus_per_node') or gpus)}`"]
    try:
        check_runnable_here([point])
        ways.append(f"`{script_command('experiments/sweep.py', quoted(argv))}` (starts the ranks itself)")
    except ConfigError:
        pass
    raise ConfigError(f"gpus={gpus} needs {gpus} ranks and this is one process: run " + ", or ".join(ways)
                      + f", or add simulate=true (one rank of the {gpus} on fake tensors)")


if __name__ == "__main__":
    preflight_or_exit("train", sys.argv[1:], _validate)
    main()
