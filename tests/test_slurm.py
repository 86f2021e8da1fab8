"""slurm/ and the submitit launcher against a real one-node Slurm (tests/slurm_harness.py)."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from experiments.records import load_records, validate_record
from slurm_harness import LocalSlurm, ensure_installed

REPO = Path(__file__).resolve().parents[1]
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
