"""slurm/ and the submitit launcher against a real two-node Slurm (tests/slurm_harness.py): jobs on
one node and across both, at a time limit, with a rank killed, and with a results folder one node
cannot see."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import zero_impl
from experiments.records import load_records, validate_record
from slurm_harness import LocalSlurm, ensure_installed

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
SMALL_NODE = ["--nodes=1", "--gpus-per-node=0", "--cpus-per-task=1"]  # fits a one-CPU node
TWO_NODES = ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1"]  # a rank on each
TINY = ["cluster=local", "model=tiny_s", "gpus=2", "micro_batch=2", "train.steps=2", "train.warmup_steps=1",
        "train.precision=auto"]


@pytest.fixture(scope="module")
def slurm():
    why = ensure_installed()
    if why:
        pytest.skip(f"SLURM TESTS SKIPPED: {why}")
    cluster = LocalSlurm()
    cluster.start()
    yield cluster
    cluster.stop()


def documented_command(doc: str, marker: str) -> tuple[dict[str, str], list[str]]:
    """The `[VAR=value ...] sbatch ...` line of `doc` (under the repository) whose comment holds
    `marker`, word for word: its environment and its command."""
    [line] = [line for line in (REPO / doc).read_text().splitlines()
              if " sbatch " in f" {line}" and marker in line]
    words = shlex.split(line.split("#")[0])
    at = words.index("sbatch")
    return dict(word.split("=", 1) for word in words[:at]), words[at:]


def documented_tiny_command() -> list[str]:
    """The README's "tiny CPU version" of run_13b.sh, word for word (also in the script's header)."""
    env, command = documented_command("README.md", "tiny CPU version")
    assert not env and shlex.join(command) in (REPO / "slurm" / "run_13b.sh").read_text(), \
        "run_13b.sh's header documents another command"
    return command


def sbatch(slurm: LocalSlurm, tmp_path: Path, command: list[str],
           env: dict[str, str] | None = None) -> tuple[dict[str, str], str, Path | None]:
    """Run an `sbatch ...` command line as given, adding only --parsable and a log path of the
    test's, until the job ends (polled here: sbatch --wait polls at growing intervals, which cost
    the tier 10-15 s a job); the job's final state, its id and its log."""
    assert command[0] == "sbatch"
    job = submit(slurm, tmp_path, *command[1:], env=env)
    return wait_for_end(slurm, job, timeout=600), job, next(tmp_path.glob(f"*-{job}.log"), None)


def submit(slurm: LocalSlurm, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """`sbatch args` without waiting, log and records under tmp_path (unless `env` says where); the job's id."""
    done = slurm.run("sbatch", "--parsable", f"--output={tmp_path}/%x-%j.log", *args, cwd=REPO,
                     env={"ZERO_REPRO_SLURM_RESULTS": str(tmp_path), **(env or {})})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def job_state(slurm: LocalSlurm, job: str) -> dict[str, str]:
    return dict(word.split("=", 1) for word in slurm.run("scontrol", "show", "job", job).stdout.split()
                if word.startswith(("JobState=", "Restarts=", "NodeList=", "ExitCode=")))


def wait_for_end(slurm: LocalSlurm, job: str, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_state(slurm, job)
        if state.get("JobState") in ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL"):
            return state
        time.sleep(0.5)
    raise AssertionError(f"job {job} still {state} after {timeout:.0f} s")


def test_run_13b_tiny_cpu_version_runs_as_documented(slurm, tmp_path):
    command = documented_tiny_command()
    assert "--cpus-per-task=1" in command  # run_13b.sh asks for 32: as written it would stay pending here
    state, job, log = sbatch(slurm, tmp_path, command)
    assert state["JobState"] == "COMPLETED", (state, log and log.read_text())
    job_dir = tmp_path / job
    status = json.loads((job_dir / "job_status.json").read_text())
    assert status["status"] == "ok" and status["exit_code"] == 0 and "model=fig4_13b" in status["overrides"]
    [record] = load_records(job_dir, "run_13b")
    assert record["status"] == "ok" and validate_record(record) == [] and record["config"]["launcher"] == "slurm"
    assert record["model"]["name"] == "tiny_s" and record["world_size"] == 2 and record["stage"] == 2
    text = log.read_text()
    assert "1 node(s) x 2 ranks" in text and f"job {job_dir.name}: ok, exit code 0" in text


def test_run_13b_tiny_cpu_version_across_two_nodes(slurm, tmp_path):
    """docs/slurm.md's two-node tiny version, word for word: one rank on each node, rendezvous at
    node1's NodeAddr (the names resolve nowhere: at node1's name torchrun would retry until the
    job's time limit), the ZeRO-2 traffic of the theory across the nodes."""
    env, command = documented_command("docs/slurm.md", "the tiny CPU version on two nodes")
    state, job, log = sbatch(slurm, tmp_path, command, env)
    text, job_dir = log.read_text(), tmp_path / job
    assert state["JobState"] == "COMPLETED", (state, text[-3000:])
    assert "2 node(s) x 1 ranks, rendezvous 127.0.0.1:" in text and "(node1's NodeAddr)" in text
    status = json.loads((job_dir / "job_status.json").read_text())
    assert status["status"] == "ok" and status["nodes"] == ["node1", "node2"]
    [record] = load_records(job_dir, "run_13b")
    assert record["status"] == "ok" and validate_record(record) == [] and record["world_size"] == 2
    by_purpose = record["comm"]["by_purpose"]  # the gradients' reduce-scatter and the parameters' all-gather
    assert by_purpose["grads"]["elements"] + by_purpose["params"]["elements"] == \
        record["comm"]["theory_elements_per_step"] > 0
    assert record["comm"]["elements_per_step"] - record["comm"]["theory_elements_per_step"] == \
        by_purpose["norm"]["elements"]  # and the clipping norm's two scalars


def test_bad_override_leaves_an_invalid_status_and_a_readable_log(slurm, tmp_path):
    state, job, log = sbatch(slurm, tmp_path, ["sbatch", *SMALL_NODE, "slurm/run_7b_zero2.sh", *TINY, "stage=7"])
    assert state["JobState"] == "FAILED" and state["ExitCode"] == "2:0"
    job_dir = tmp_path / job
    status = json.loads((job_dir / "job_status.json").read_text())
    assert status["status"] == "invalid" and status["exit_code"] == 2
    assert "error: stage must be one of [0, 1, 2, 3], got 7" in log.read_text()
    assert not list(job_dir.glob("*/*.json")), "no rank may start"


def test_a_results_folder_another_node_cannot_see_is_refused(slurm, tmp_path):
    """Records under a folder only node1 sees (node2 has a disk of its own there): one line, status
    invalid, before any rank starts. Without the check node2's rank would write its checkpoint
    shards where nobody reads them, and a resume would find half a checkpoint."""
    if slurm.node_local is None:
        pytest.skip("this machine allows no mount namespace: node2 cannot have a folder of its own")
    results = slurm.node_local / tmp_path.name
    state, job, log = sbatch(slurm, tmp_path, ["sbatch", *TWO_NODES, "slurm/run_7b_zero2.sh", *TINY],
                             {"ZERO_REPRO_SLURM_RESULTS": str(results)})
    log = log.read_text()
    assert state["JobState"] == "FAILED" and state["ExitCode"] == "2:0"
    status = json.loads((results / job / "job_status.json").read_text())
    assert status["status"] == "invalid" and status["exit_code"] == 2
    assert f"error: the results folder {results / job} is not shared: node2 cannot read what node1 wrote" in log
    assert "rendezvous" not in log and not list((results / job).glob("*/*")), "no rank may start"


def test_submitit_launcher_runs_each_point_as_a_two_node_slurm_job(slurm, tmp_path):
    """hydra/launcher=slurm with a task on each node: the job's store (every point's rendezvous and
    the ranks' agreement) is served at node1's NodeAddr, not at its name."""
    done = slurm.run(sys.executable, "experiments/sweep.py", "-m", "hydra/launcher=slurm", "hydra.launcher.nodes=2",
                     "hydra.launcher.tasks_per_node=1", "hydra.launcher.gpus_per_node=null",
                     "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=10",
                     f"hydra.sweep.dir={tmp_path}/multirun", "model=tiny_s", "gpus=2", "stage=1,2", "train.steps=2",
                     "train.warmup_steps=1", f"results_dir={tmp_path}/runs", cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    found = load_records(tmp_path / "runs", "cpu_default")
    assert sorted(r["stage"] for r in found) == [1, 2]
    assert all(r["status"] == "ok" and r["config"]["launcher"] == "slurm (submitit)" and r["world_size"] == 2
               for r in found)
    assert all(validate_record(r) == [] for r in found)
    [job] = {d.name.split("_")[0] for d in (tmp_path / "multirun" / ".submitit").iterdir() if d.is_dir()}
    assert "NodeList=node[1-2]" in slurm.run("scontrol", "show", "job", job).stdout


def test_slurm_launcher_needs_one_gpu_count():
    done = subprocess.run([sys.executable, "experiments/sweep.py", "-m", "hydra/launcher=slurm", "gpus=[1,2]"],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip() == (
        "error: with a Slurm launcher, give gpus one value (tasks per job follow it), e.g. gpus=8")


def test_a_two_node_job_at_its_time_limit_checkpoints_requeues_and_resumes(slurm, tmp_path):
    """A two-minute job with a rank on each node, warned 60 s before its limit (--time=2
    --signal=B:USR1@60; the run_*.sh scripts ask for USR1 600 s ahead): both ranks save their
    shards after the step in flight, rank 0 leaves a timeout record naming the step and the
    checkpoint, the job requeues itself and resumes on both nodes from the checkpoint until it
    finishes, with the losses and the parameters of an uninterrupted run, bitwise. Slurm checks
    time limits every 30 s and may signal that much early: the warning comes 30-60 s into each
    run. train.fault=slow adds a second to each step, so that the tiny run outlasts one."""
    point = ["cluster=local", "model=tiny_s", "gpus=2", "micro_batch=2", "train.steps=49", "train.warmup_steps=1",
             "train.precision=auto", "train.checkpoint_every=25"]
    job = submit(slurm, tmp_path, *TWO_NODES, "--time=2", "--signal=B:USR1@60", "slurm/run_7b_zero2.sh", *point,
                 "train.fault=slow")
    records_seen, deadline = [], time.monotonic() + 600
    while time.monotonic() < deadline:
        state = job_state(slurm, job)
        for record in load_records(tmp_path / job, "run_7b_zero2"):
            if record["status"] == "timeout" and record not in records_seen:
                records_seen.append(record)
        if state.get("JobState") in ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"):
            break
        time.sleep(1)
    log = next(tmp_path.glob(f"*-{job}.log")).read_text()
    assert state.get("JobState") == "COMPLETED" and int(state["Restarts"]) >= 1, (state, log[-3000:])
    assert "USR1, the time limit is near" in log and "checkpointed before the time limit; requeueing" in log
    assert log.count("2 node(s) x 1 ranks") == int(state["Restarts"]) + 1 and state["NodeList"] == "node[1-2]"
    # Stopped at the warning: the point's record said timeout, with the step and where to resume.
    stopped = records_seen[0]
    assert stopped["resume"]["last_step"] >= 1 and Path(stopped["resume"]["checkpoint"]).name == \
        f"step_{stopped['resume']['last_step']}"
    assert "resume from" in stopped["error"] and validate_record(stopped) == []
    [final] = load_records(tmp_path / job, "run_7b_zero2")
    assert final["status"] == "ok" and validate_record(final) == [] and len(final["losses"]) == 50
    assert final["resume"]["resumed_from"] is not None
    assert json.loads((tmp_path / job / "job_status.json").read_text())["status"] == "ok"
    reference = subprocess.run([sys.executable, "experiments/sweep.py", *point[1:], "stage=2",
                                f"results_dir={tmp_path}/reference"], cwd=REPO, capture_output=True, text=True,
                               timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    [uninterrupted] = load_records(tmp_path / "reference", "cpu_default")
    assert final["losses"] == uninterrupted["losses"]
    resumed = zero_impl.checkpoint.export(final["resume"]["checkpoint"])
    straight = zero_impl.checkpoint.export(uninterrupted["resume"]["checkpoint"])
    assert Path(final["resume"]["checkpoint"]).name == "step_50" and resumed.keys() == straight.keys()
    assert all(torch.equal(resumed[name], straight[name]) for name in resumed)


def test_a_rank_killed_on_node_2_fails_the_job_at_once_naming_it(slurm, tmp_path):
    """SIGKILL to the rank on node2 mid-step (as the OOM killer sends): the job ends within two
    minutes, not at its time limit (node2's torchrun fails, and srun ends node1's), and although
    rank 0 died before it could write, the point's record says fail and names the rank and the
    node, as does job_status.json."""
    job = submit(slurm, tmp_path, *TWO_NODES, "--time=10", "slurm/run_7b_zero2.sh", *TINY, "train.steps=60",
                 "train.fault=slow", "train.checkpoint_every=2")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not list((tmp_path / job).glob("run_7b_zero2/checkpoints/*/step_2")):
        time.sleep(0.5)
    [victim] = [pid for pid in _rank_processes(job) if _environ(pid).get("SLURMD_NODENAME") == "node2"]
    rank = _environ(victim)["RANK"]  # torch numbers the nodes by (address, pid): both are 127.0.0.1 here
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    state = wait_for_end(slurm, job, timeout=120)
    assert state["JobState"] == "FAILED" and time.monotonic() - killed < 120
    status = json.loads((tmp_path / job / "job_status.json").read_text())
    died = f"rank {rank} on node2 died of signal 9 (SIGKILL)"
    assert status["status"] == "fail" and status["message"].startswith(died)
    [record] = load_records(tmp_path / job, "run_7b_zero2")
    assert record["status"] == "fail" and validate_record(record) == []
    assert record["error"].startswith(f"{died} after step ")
    assert record["resume"]["checkpoint"] and "resume from" in record["error"]


def _rank_processes(job: str) -> list[int]:
    """The pids of the job's ranks: train.py's interpreters that torchrun started (they have a RANK)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            env = _environ(int(proc.name))
        except (ValueError, OSError):
            continue
        if argv[0].endswith(b"python") and any(a.endswith(b"experiments/train.py") for a in argv[1:2]) \
                and env.get("SLURM_JOB_ID") == job and "RANK" in env:
            found.append(int(proc.name))
    return found


def _environ(pid: int) -> dict[str, str]:
    words = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(word.split("=", 1) for word in words if "=" in word)


def test_a_job_killed_without_warning_leaves_a_timeout_record(slurm, tmp_path):
    """Ended by TERM with no warning (scancel here; the time limit's TERM takes the same path,
    also checked by hand with --time=1 and no --signal), the job's point still gets its record:
    status timeout, the last step reached, the checkpoint to resume from (train.checkpoint_every)."""
    job = submit(slurm, tmp_path, *SMALL_NODE, "slurm/run_7b_zero2.sh", *TINY, "train.steps=60", "train.fault=slow",
                 "train.checkpoint_every=2")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not list((tmp_path / job).glob("run_7b_zero2/checkpoints/*/step_4")):
        time.sleep(0.5)
    slurm.run("scancel", job)
    while time.monotonic() < deadline and "JobState=CANCELLED" not in slurm.run("scontrol", "show", "job", job).stdout:
        time.sleep(0.5)
    time.sleep(2)  # the batch script's TERM trap finishes
    status = json.loads((tmp_path / job / "job_status.json").read_text())
    assert status["status"] == "timeout", status
    [record] = load_records(tmp_path / job, "run_7b_zero2")
    assert record["status"] == "timeout" and validate_record(record) == [], record
    last, checkpoint = record["resume"]["last_step"], Path(record["resume"]["checkpoint"])
    assert last >= 4 and checkpoint.name == f"step_{last // 2 * 2}" and (checkpoint / ".metadata").is_file()
    assert f"after step {last}; resume from {checkpoint}" in record["error"]
