"""Bad input at the cluster boundary is one line and status invalid before any rank starts, and
the commands a user types outside Slurm answer with one line (tests/slurm_stubs.py runs
slurm/launch.sh with stub srun and scontrol; the real cluster's refusal of a results folder
another node cannot see is in tests/experiments/test_slurm.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_stubs import REPO, run_launch, srun_arguments


def refused(tmp_path: Path, done: subprocess.CompletedProcess) -> str:
    """launch.sh's one line for input it refused, once checked: exit code 2, job_status.json
    invalid with the same message, and no srun of the ranks."""
    assert done.returncode == 2, (done.stdout, done.stderr)
    [line] = done.stderr.strip().splitlines()
    status = json.loads((tmp_path / "results" / "4242" / "job_status.json").read_text())
    assert status["status"] == "invalid" and f"error: {status['message']}" == line
    assert srun_arguments(tmp_path) is None, "no rank may start"
    return line


def test_gpus_not_a_multiple_of_the_nodes_is_invalid(tmp_path):
    done = run_launch(tmp_path, "gpus=3", nodes=("node1", "node2"))
    assert refused(tmp_path, done) == ("error: gpus=3 is not a multiple of the 2 GPUs per node (gpus over the "
                                       "job's 2 node(s)): every node runs as many ranks")


def test_gpus_not_a_multiple_of_the_allocations_gpus_per_node_is_invalid(tmp_path):
    done = run_launch(tmp_path, "gpus=12", nodes=("node1", "node2"), SLURM_GPUS_ON_NODE="8")
    assert refused(tmp_path, done) == ("error: gpus=12 is not a multiple of the 8 GPUs per node (the "
                                       "allocation's): every node runs as many ranks")


@pytest.mark.parametrize("per_node, allocated", [("4", "8"), ("16", "8")])
def test_gpus_per_node_that_does_not_match_the_allocation_is_invalid(tmp_path, per_node, allocated):
    """GPUS_PER_NODE=4 on nodes of 8 would leave half of each node idle and spread the job over
    twice the nodes; 16 would start ranks for GPUs the nodes do not have."""
    done = run_launch(tmp_path, "gpus=16", nodes=("node1", "node2", "node3", "node4"), GPUS_PER_NODE=per_node,
                      SLURM_GPUS_ON_NODE=allocated)
    assert refused(tmp_path, done) == (f"error: GPUS_PER_NODE={per_node} does not match the allocation's "
                                       f"{allocated} GPUs per node (SLURM_GPUS_ON_NODE)")


def test_gpus_per_node_must_be_a_count(tmp_path):
    done = run_launch(tmp_path, "gpus=2", GPUS_PER_NODE="two")
    assert refused(tmp_path, done) == "error: GPUS_PER_NODE=two is not a positive whole number"


def test_more_nodes_than_the_job_has_is_invalid(tmp_path):
    done = run_launch(tmp_path, "gpus=4", nodes=("node1", "node2"), GPUS_PER_NODE="1")
    assert refused(tmp_path, done) == "error: gpus=4 needs 4 nodes of 1 GPUs (GPUS_PER_NODE) and the job has 2"


def test_gpus_per_node_on_cpu_nodes_sets_the_ranks_per_node(tmp_path):
    """Nodes with no GPUs allocated (the CPU versions): GPUS_PER_NODE is the ranks per node."""
    done = run_launch(tmp_path, "gpus=2", nodes=("node1", "node2"), GPUS_PER_NODE="1")
    assert done.returncode == 0, done.stderr
    assert {"--nnodes=2", "--nproc-per-node=1"} <= set(srun_arguments(tmp_path))


def test_a_results_folder_another_node_cannot_see_is_invalid(tmp_path):
    done = run_launch(tmp_path, "gpus=2", nodes=("node1", "node2"), unseen="node2\n")
    line = refused(tmp_path, done)
    assert line == (f"error: the results folder {tmp_path}/results/4242 is not shared: node2 cannot read what node1 "
                    "wrote there; put it on a file system every node mounts (ZERO_REPRO_SLURM_RESULTS)")
    assert not list((tmp_path / "results" / "4242").glob(".node_check*")), "the marker is removed"


@pytest.mark.parametrize("cwd", [REPO, REPO / "docs"])
def test_a_run_script_outside_slurm_says_so_in_one_line(cwd):
    """`bash slurm/run_13b.sh` on a login node: launch.sh's own line, from any folder (the
    scripts found launch.sh under $SLURM_SUBMIT_DIR, empty outside Slurm: "/slurm/launch.sh:
    No such file or directory")."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(["bash", str(REPO / "slurm" / "run_13b.sh")], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr == ("error: slurm/launch.sh runs inside a Slurm job: submit a script with sbatch, "
                           "e.g. sbatch slurm/run_13b.sh\n")


def sweep_on_slurm(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "experiments/sweep.py", "-m", "hydra/launcher=slurm", "model=tiny_s",
                           "gpus=2", *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def slurm_tools(tmp_path: Path, **bodies: str) -> str:
    """A PATH whose `sbatch` and `sinfo` are shell stubs with the given bodies (default: succeed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sbatch", "sinfo"):
        (bin_dir / tool).write_text(f"#!/bin/sh\n{bodies.get(tool, 'exit 0')}\n")
        (bin_dir / tool).chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def test_the_slurm_launcher_without_sbatch_says_so_in_one_line(tmp_path):
    done = sweep_on_slurm(f"hydra.sweep.dir={tmp_path}", PATH=str(tmp_path))
    assert done.returncode == 2 and done.stderr == (
        "error: hydra/launcher=slurm submits with sbatch, which is not installed here: run it where Slurm is\n")
    assert not list(tmp_path.iterdir()), "nothing submitted"


def test_the_slurm_launcher_with_no_controller_says_so_in_one_line(tmp_path):
    """sbatch installed, but no Slurm answers (no slurm.conf here): sinfo's own last line says why."""
    path = slurm_tools(tmp_path, sbatch="exit 1",
                       sinfo='echo "sinfo: fatal: Could not establish a configuration source" >&2; exit 1')
    done = sweep_on_slurm(f"hydra.sweep.dir={tmp_path}/multirun", PATH=path)
    assert done.returncode == 2 and done.stderr == (
        "error: hydra/launcher=slurm: no Slurm controller answers here "
        "(sinfo: sinfo: fatal: Could not establish a configuration source)\n")


def test_the_slurm_launchers_tasks_must_be_the_points_gpus(tmp_path):
    done = sweep_on_slurm("hydra.launcher.nodes=2", f"hydra.sweep.dir={tmp_path}/multirun",
                          PATH=slurm_tools(tmp_path))
    assert done.returncode == 2 and done.stderr == (
        "error: gpus=2 but hydra.launcher starts 2 node(s) x 2 task(s): give hydra.launcher.tasks_per_node=1\n")


def test_the_slurm_launchers_gpus_per_node_must_be_its_tasks_per_node(tmp_path):
    """gpus_per_node follows gpus: two nodes of 1 task each would each ask Slurm for 2 GPUs."""
    done = sweep_on_slurm("hydra.launcher.nodes=2", "hydra.launcher.tasks_per_node=1",
                          f"hydra.sweep.dir={tmp_path}/multirun", PATH=slurm_tools(tmp_path))
    assert done.returncode == 2 and done.stderr == (
        "error: hydra.launcher.gpus_per_node=2 but tasks_per_node=1: every task is one GPU's rank; "
        "give hydra.launcher.gpus_per_node=1\n")
    assert not (tmp_path / "multirun" / ".submitit").exists(), "nothing submitted"
