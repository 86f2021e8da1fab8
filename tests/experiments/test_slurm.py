"""slurm/ and the submitit launcher against a real one-node Slurm (tests/slurm_harness.py)."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.records import load_records, validate_record
from slurm_harness import LocalSlurm, ensure_installed

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
SMALL_NODE = ["--nodes=1", "--gpus-per-node=0", "--cpus-per-task=1"]  # fits a one-CPU node
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


def documented_tiny_command() -> list[str]:
    """The README's "tiny CPU version" of run_13b.sh, word for word (also in the script's header)."""
    [line] = [line for line in (REPO / "README.md").read_text().splitlines()
              if line.startswith("sbatch ") and "tiny CPU version" in line]
    command = line.split("#")[0].strip()
    assert command in (REPO / "slurm" / "run_13b.sh").read_text(), "run_13b.sh's header documents another command"
    return shlex.split(command)


def sbatch(slurm: LocalSlurm, tmp_path: Path, command: list[str]):
    """Run an `sbatch ...` command line as given, adding only --wait and a log path of the test's."""
    slurm.env["ZERO_REPRO_SLURM_RESULTS"] = str(tmp_path)
    assert command[0] == "sbatch"
    done = slurm.run("sbatch", "--wait", f"--output={tmp_path}/%x-%j.log", *command[1:], cwd=REPO)
    job = done.stdout.split()[-1] if done.stdout.strip() else "?"
    return done, tmp_path / job, next(tmp_path.glob(f"*-{job}.log"), None)


def test_run_13b_tiny_cpu_version_runs_as_documented(slurm, tmp_path):
    command = documented_tiny_command()
    assert "--cpus-per-task=1" in command  # run_13b.sh asks for 32: as written it would stay pending here
    done, job_dir, log = sbatch(slurm, tmp_path, command)
    assert done.returncode == 0, (done.stderr, log and log.read_text())
    status = json.loads((job_dir / "job_status.json").read_text())
    assert status["status"] == "ok" and status["exit_code"] == 0 and "model=fig4_13b" in status["overrides"]
    [record] = load_records(job_dir, "run_13b")
    assert record["status"] == "ok" and validate_record(record) == [] and record["config"]["launcher"] == "slurm"
    assert record["model"]["name"] == "tiny_s" and record["world_size"] == 2 and record["stage"] == 2
    text = log.read_text()
    assert "1 node(s) x 2 ranks" in text and f"job {job_dir.name}: ok, exit code 0" in text


def test_bad_override_leaves_an_invalid_status_and_a_readable_log(slurm, tmp_path):
    done, job_dir, log = sbatch(slurm, tmp_path, ["sbatch", *SMALL_NODE, "slurm/run_7b_zero2.sh", *TINY, "stage=7"])
    assert done.returncode != 0
    status = json.loads((job_dir / "job_status.json").read_text())
    assert status["status"] == "invalid" and status["exit_code"] == 2
    assert "error: stage must be one of [0, 1, 2, 3], got 7" in log.read_text()
    assert not list(job_dir.glob("*/*.json")), "no rank may start"


def test_submitit_launcher_runs_each_point_as_a_slurm_job(slurm, tmp_path):
    done = slurm.run(sys.executable, "experiments/sweep.py", "-m", "hydra/launcher=slurm",
                     "hydra.launcher.gpus_per_node=null", "hydra.launcher.cpus_per_task=1",
                     "hydra.launcher.timeout_min=10", f"hydra.sweep.dir={tmp_path}/multirun", "model=tiny_s",
                     "gpus=2", "stage=1,2", "train.steps=2", "train.warmup_steps=1", f"results_dir={tmp_path}/runs",
                     cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    found = load_records(tmp_path / "runs", "cpu_default")
    assert sorted(r["stage"] for r in found) == [1, 2]
    assert all(r["status"] == "ok" and r["config"]["launcher"] == "slurm (submitit)" and r["world_size"] == 2
               for r in found)
    assert all(validate_record(r) == [] for r in found)


def test_slurm_launcher_needs_one_gpu_count():
    import subprocess
    done = subprocess.run([sys.executable, "experiments/sweep.py", "-m", "hydra/launcher=slurm", "gpus=[1,2]"],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip() == (
        "error: with a Slurm launcher, give gpus one value (tasks per job follow it), e.g. gpus=8")


def test_a_job_at_its_time_limit_checkpoints_requeues_and_resumes(slurm, tmp_path):
    """A two-minute job warned 60 s before its limit (--time=2 --signal=B:USR1@60; the run_*.sh
    scripts ask for USR1 600 s ahead) saves a checkpoint after the step in flight, leaves a
    timeout record naming the step and the checkpoint, requeues itself and resumes from the
    checkpoint until it finishes, with the final losses of an uninterrupted run. Slurm checks
    time limits every 30 s and may signal that much early: the warning comes 30-60 s into each
    run. train.fault=slow adds a second to each step, so that the tiny run outlasts one."""
    point = ["cluster=local", "model=tiny_s", "gpus=2", "micro_batch=2", "train.steps=49", "train.warmup_steps=1",
             "train.precision=auto"]
    slurm.env["ZERO_REPRO_SLURM_RESULTS"] = str(tmp_path)
    done = slurm.run("sbatch", "--parsable", f"--output={tmp_path}/%x-%j.log", *SMALL_NODE, "--time=2",
                     "--signal=B:USR1@60", "slurm/run_7b_zero2.sh", *point, "train.fault=slow", cwd=REPO)
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip().split(";")[0]
    records_seen, deadline = [], time.monotonic() + 600
    while time.monotonic() < deadline:
        state = dict(word.split("=", 1) for word in slurm.run("scontrol", "show", "job", job).stdout.split()
                     if word.startswith(("JobState=", "Restarts=")))
        for record in load_records(tmp_path / job, "run_7b_zero2"):
            if record["status"] == "timeout" and record not in records_seen:
                records_seen.append(record)
        if state.get("JobState") in ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"):
            break
        time.sleep(1)
    log = next(tmp_path.glob(f"*-{job}.log")).read_text()
    assert state.get("JobState") == "COMPLETED" and int(state["Restarts"]) >= 1, (state, log[-3000:])
    assert "USR1, the time limit is near" in log and "checkpointed before the time limit; requeueing" in log
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


def test_a_job_killed_without_warning_leaves_a_timeout_record(slurm, tmp_path):
    """Ended by TERM with no warning (scancel here; the time limit's TERM takes the same path,
    also checked by hand with --time=1 and no --signal), the job's point still gets its record:
    status timeout, the last step reached, the checkpoint to resume from (train.checkpoint_every)."""
    slurm.env["ZERO_REPRO_SLURM_RESULTS"] = str(tmp_path)
    done = slurm.run("sbatch", "--parsable", f"--output={tmp_path}/%x-%j.log", *SMALL_NODE, "slurm/run_7b_zero2.sh",
                     *TINY, "train.steps=60", "train.fault=slow", "train.checkpoint_every=2", cwd=REPO)
    job = done.stdout.strip().split(";")[0]
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
