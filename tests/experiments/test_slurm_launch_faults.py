"""slurm/launch.sh when Slurm or the nodes misbehave, without a Slurm (tests/slurm_stubs.py): the
node check failing closed and counting every node's GPUs, a failed requeue, a TERM before the
ranks start, and an edit to the script while a job runs it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from slurm_stubs import REPO, run_launch, srun_arguments


def status(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "results" / "4242" / "job_status.json").read_text())


def test_a_node_check_that_could_not_run_refuses_the_job(tmp_path):
    """srun failing prints no node's line: before, an empty answer meant every node saw the marker."""
    done = run_launch(tmp_path, "gpus=2", nodes=("node1", "node2"), STUB_CHECK_FAILS="1")
    assert done.returncode == 2 and srun_arguments(tmp_path) is None
    line = ("the node check (srun on node1,node2) heard from 0 of 2 nodes: srun: error: Unable to create step for "
            "job 4242: Invalid node name")
    assert done.stderr.strip().splitlines()[-1] == f"error: {line}"
    assert status(tmp_path)["status"] == "invalid" and status(tmp_path)["message"] == line
    assert not list((tmp_path / "results" / "4242").glob(".node_check*"))


def test_the_node_check_overlaps_and_its_marker_is_not_the_job_id(tmp_path):
    done = run_launch(tmp_path, "gpus=2", nodes=("node1", "node2"))
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "check_args").read_text().splitlines()
    assert "--overlap" in args
    [marker] = [a for a in args if "/.node_check." in a]
    assert len(marker.rsplit(".", 1)[1]) == 16 and "4242" not in marker.rsplit("/", 1)[1]


def test_a_node_with_other_gpus_than_the_job_runs_per_node_is_invalid(tmp_path):
    """The batch node's SLURM_GPUS_ON_NODE alone said 8; every node is counted in the check."""
    done = run_launch(tmp_path, "gpus=16", nodes=("node1", "node2"), SLURM_GPUS_ON_NODE="8",
                      gpus={"node1": 8, "node2": 4})
    assert done.returncode == 2 and srun_arguments(tmp_path) is None
    assert done.stderr == "error: node2 has 4 GPUs, and the job runs 8 ranks on each node (the allocation's)\n"
    assert status(tmp_path)["status"] == "invalid"


def test_a_cpu_job_counts_no_gpus(tmp_path):
    """--gpus-per-node=0 (the CPU versions): no node has a GPU, and none is asked for."""
    done = run_launch(tmp_path, "gpus=2", nodes=("node1", "node2"), GPUS_PER_NODE="1", SLURM_GPUS_PER_NODE="0",
                      gpus={"node1": 0, "node2": 0})
    assert done.returncode == 0, done.stderr


def test_a_checkpoint_dir_another_node_cannot_see_is_invalid(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    done = run_launch(tmp_path, "gpus=2", f"train.checkpoint_dir={checkpoints}", nodes=("node1", "node2"),
                      unseen="node2", STUB_UNSEEN_IN=str(checkpoints))
    assert done.returncode == 2 and srun_arguments(tmp_path) is None
    assert done.stderr == (f"error: the checkpoint folder {checkpoints} is not shared: node2 cannot read what node1 "
                           "wrote there; put it on a file system every node mounts (train.checkpoint_dir)\n")
    assert not list(checkpoints.iterdir()), "the marker is removed"


def test_a_failed_requeue_says_to_resubmit_and_exits_non_zero(tmp_path):
    """The ranks checkpointed at Slurm's warning, but scontrol requeue failed (a job without
    --requeue, or an account not allowed to): the status says so, not 'requeued'."""
    done = run_launch(tmp_path, "gpus=2", STUB_SAVED="1", STUB_RANKS_EXIT="1", STUB_REQUEUE_FAILS="1")
    assert done.returncode == 1
    assert (tmp_path / "requeued").read_text() == "requeue 4242\n"
    why = ("checkpointed at Slurm's warning, but scontrol requeue failed (scontrol: error: Requeue of job 4242 not "
           "permitted): resubmit with train.resume=true")
    assert status(tmp_path)["status"] == "timeout" and status(tmp_path)["message"] == why
    assert done.stderr.strip().splitlines()[-1] == f"job 4242: {why}"
    (tmp_path / "ok").mkdir()
    done = run_launch(tmp_path / "ok", "gpus=2", STUB_SAVED="1", STUB_RANKS_EXIT="1")
    assert done.returncode == 0 and "requeued to resume" in status(tmp_path / "ok")["message"]


def test_term_before_the_ranks_start_leaves_a_status(tmp_path):
    """Slurm's TERM (scancel, the time limit) during the node check: before, the trap read the
    ranks' pid, not yet set, and set -u aborted it with no status."""
    done = run_launch(tmp_path, "gpus=2", nodes=("node1", "node2"), STUB_CHECK_TERM="1")
    assert done.returncode == 143, done.stderr
    assert status(tmp_path)["status"] == "timeout" and srun_arguments(tmp_path) is None


def test_editing_launch_sh_while_a_job_runs_it_changes_nothing(tmp_path):
    """bash reads a script as it runs it: the ranks' srun rewrites launch.sh in place (as an editor
    saving over it), shifting what bash would read next; the job still ends as it began."""
    repo = tmp_path / "repo"
    (repo / "slurm").mkdir(parents=True)
    shutil.copytree(REPO / "experiments", repo / "experiments", ignore=shutil.ignore_patterns("__pycache__"))
    launch = repo / "slurm" / "launch.sh"
    shutil.copy2(REPO / "slurm" / "launch.sh", launch)
    done = run_launch(tmp_path, "gpus=2", launcher=launch, STUB_EDIT=str(launch))
    assert done.returncode == 0, done.stderr
    assert status(tmp_path)["status"] == "ok" and done.stdout.endswith("job 4242: ok, exit code 0\n")
    assert status(tmp_path)["commit"] is None  # the copy is no git checkout; REPO's is
    (tmp_path / "real").mkdir()
    run_launch(tmp_path / "real", "gpus=2")
    assert len(status(tmp_path / "real")["commit"]) == 40
