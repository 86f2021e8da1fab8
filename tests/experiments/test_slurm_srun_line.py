"""slurm/launch.sh's srun command line, without Slurm (tests/slurm_stubs.py). The real cluster:
tests/experiments/test_slurm.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from slurm_stubs import run_launch, srun_arguments


def srun_args(tmp_path: Path, **env: str) -> list[str]:
    """The arguments launch.sh passes to srun inside a one-node allocation of 2 GPUs."""
    done = run_launch(tmp_path, "gpus=2", "model=tiny_s", SLURM_GPUS_ON_NODE="2", **env)
    assert done.returncode == 0, done.stderr
    return srun_arguments(tmp_path)


def srun_options(args: list[str]) -> list[str]:
    """srun's own options: everything before the program it starts."""
    return args[:next(i for i, a in enumerate(args) if not a.startswith("-"))]


def test_srun_gets_the_allocations_cpus_per_task(tmp_path):
    # Slurm >= 22.05: srun does not inherit sbatch's --cpus-per-task; launch.sh must pass it
    options = srun_options(srun_args(tmp_path, SLURM_CPUS_PER_TASK="32"))
    assert "--cpus-per-task=32" in options
    assert {"--nodes=1", "--ntasks=1", "--ntasks-per-node=1"} <= set(options)


def test_srun_without_cpus_per_task_gets_the_nodes_cpus(tmp_path):
    # salloc --exclusive with no -c: the one torchrun per node gets every CPU the job holds there
    options = srun_options(srun_args(tmp_path, SLURM_CPUS_ON_NODE="64"))
    assert "--cpus-per-task=64" in options
    (tmp_path / "both").mkdir()
    options = srun_options(srun_args(tmp_path / "both", SLURM_CPUS_PER_TASK="32", SLURM_CPUS_ON_NODE="64"))
    assert "--cpus-per-task=32" in options and "--cpus-per-task=64" not in options


@pytest.mark.parametrize("unset_as", [None, ""])
def test_srun_without_any_cpu_count_keeps_sruns_default(tmp_path, unset_as):
    env = {} if unset_as is None else {"SLURM_CPUS_PER_TASK": unset_as, "SLURM_CPUS_ON_NODE": unset_as}
    args = srun_args(tmp_path, **env)
    assert not any(a.startswith("--cpus-per-task") for a in args)
    program = args[len(srun_options(args)):]
    assert Path(program[0]).name == "node.sh" and Path(program[1]).name == "python"
    assert program[2:4] == ["-m", "torch.distributed.run"]
