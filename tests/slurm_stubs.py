"""slurm/launch.sh without a Slurm: the script runs with stub `srun`, `scontrol` and `python` first
on PATH. The stub srun writes the ranks' step's arguments to `srun_args` and answers the
results-folder check as every node seeing the marker, or names the nodes in `unseen`; the stub
scontrol expands the job's nodes and shows them with `show_node`'s text; the stub python accepts
the overrides' check and runs the real interpreter otherwise (launch.sh writes job_status.json
and asks experiments/slurm_nodes.py with it). tests/experiments/test_slurm.py runs a real cluster."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_launch(tmp_path: Path, *overrides: str, nodes: tuple[str, ...] = ("node1",), show_node: str = "",
               unseen: str = "", **env: str) -> subprocess.CompletedProcess:
    """slurm/launch.sh with `overrides` inside a stub allocation of `nodes` (job 4242; SLURM_*
    variables in `env` are added to it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {"srun": f'if [[ "$*" == *.node_check.* ]]; then printf "%s" {shlex.quote(unseen)}; exit 0; fi\n'
                     f'printf "%s\\n" "$@" > "{tmp_path}/srun_args"; env > "{tmp_path}/srun_env"',
             "scontrol": f'case "$1 $2" in\n"show hostnames") printf "%s\\n" {" ".join(nodes)} ;;\n'
                         f'"show node") printf "%s\\n" {shlex.quote(show_node)} ;;\nesac',
             "python": f'if [ "${{ZERO_REPRO_CHECK_ONLY:-}}" = 1 ]; then exit 0; fi; exec "{sys.executable}" "$@"'}
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": str(len(nodes)), "SLURM_JOB_NODELIST": ",".join(nodes)}
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_", "GPUS_PER_NODE"))}
    return subprocess.run([str(REPO / "slurm" / "launch.sh"), *overrides],
                          env={**base, **slurm, **env, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                               "PYTHON": str(bin_dir / "python"), "ZERO_REPRO_DIR": str(REPO),
                               "ZERO_REPRO_SLURM_RESULTS": str(tmp_path / "results")},
                          capture_output=True, text=True, timeout=60)


def srun_environment(tmp_path: Path) -> dict[str, str]:
    """The environment launch.sh gave the srun that starts the ranks."""
    lines = (tmp_path / "srun_env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def srun_arguments(tmp_path: Path) -> list[str] | None:
    """The arguments launch.sh passed to the srun that starts the ranks; None if it never did."""
    args = tmp_path / "srun_args"
    return args.read_text().splitlines() if args.exists() else None
