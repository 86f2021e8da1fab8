"""slurm/launch.sh's srun command line, without Slurm: the script runs with stub `srun` and
`scontrol` first on PATH (the stub srun writes its arguments to a file) and a stub $PYTHON
that accepts the overrides' check and runs the real interpreter otherwise (launch.sh writes
job_status.json with it). tests/experiments/test_slurm.py runs the real one-node cluster."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def srun_arguments(tmp_path: Path, **env: str) -> list[str]:
    """The arguments launch.sh passes to srun inside a one-node allocation of 2 GPUs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {"srun": f'printf "%s\\n" "$@" > "{tmp_path}/srun_args"',
             "scontrol": 'if [ "$1 $2" = "show hostnames" ]; then echo node1; fi',
             "python": f'if [ "${{ZERO_REPRO_CHECK_ONLY:-}}" = 1 ]; then exit 0; fi; exec "{sys.executable}" "$@"'}
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "node1", "SLURM_GPUS_ON_NODE": "2"}
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_"))}
    done = subprocess.run([str(REPO / "slurm" / "launch.sh"), "gpus=2", "model=tiny_s"],
                          env={**base, **slurm, **env, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                               "PYTHON": str(bin_dir / "python"), "ZERO_REPRO_DIR": str(REPO),
                               "ZERO_REPRO_SLURM_RESULTS": str(tmp_path / "results")},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return (tmp_path / "srun_args").read_text().splitlines()


def srun_options(args: list[str]) -> list[str]:
    """srun's own options: everything before the program it starts (the interpreter)."""
    return args[:next(i for i, a in enumerate(args) if not a.startswith("-"))]


def test_srun_gets_the_allocations_cpus_per_task(tmp_path):
    # Slurm >= 22.05: srun does not inherit sbatch's --cpus-per-task; launch.sh must pass it
    options = srun_options(srun_arguments(tmp_path, SLURM_CPUS_PER_TASK="32"))
    assert "--cpus-per-task=32" in options
    assert {"--nodes=1", "--ntasks=1", "--ntasks-per-node=1"} <= set(options)


def test_srun_without_cpus_per_task_gets_the_nodes_cpus(tmp_path):
    # salloc --exclusive with no -c: the one torchrun per node gets every CPU the job holds there
    options = srun_options(srun_arguments(tmp_path, SLURM_CPUS_ON_NODE="64"))
    assert "--cpus-per-task=64" in options
    (tmp_path / "both").mkdir()
    options = srun_options(srun_arguments(tmp_path / "both", SLURM_CPUS_PER_TASK="32", SLURM_CPUS_ON_NODE="64"))
    assert "--cpus-per-task=32" in options and "--cpus-per-task=64" not in options


@pytest.mark.parametrize("unset_as", [None, ""])
def test_srun_without_any_cpu_count_keeps_sruns_default(tmp_path, unset_as):
    env = {} if unset_as is None else {"SLURM_CPUS_PER_TASK": unset_as, "SLURM_CPUS_ON_NODE": unset_as}
    args = srun_arguments(tmp_path, **env)
    assert not any(a.startswith("--cpus-per-task") for a in args)
    assert args[len(srun_options(args)):][:3] == [str(tmp_path / "bin" / "python"), "-m", "torch.distributed.run"]
