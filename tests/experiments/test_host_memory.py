"""A point run for real on CPU processes is refused before anything is built when its predicted
memory per process exceeds what the host has available (points.check_host_memory: the least of
MemAvailable and the memory cgroups' limits, or ZERO_REPRO_HOST_MEMORY_BYTES); a sweep, a Slurm
job's check (slurm/launch.sh) and a submitit job record it `invalid` with the refusal's line;
ignore_host_memory=true runs it anyway."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from experiments import points, records
from experiments.commands import REPO
from experiments.points import HOST_MEMORY_ENV, ConfigError, HostMemory, check_host_memory, expand, host_available

on_gpus = pytest.mark.skipif(torch.cuda.is_available(),
                             reason="GPU ranks hold their tensors on the device: a real run here checks no host memory")


@pytest.fixture(autouse=True)
def cpu_ranks(monkeypatch):
    """The logic as on a CPU host, on any machine."""
    monkeypatch.setattr(points, "ranks_on_gpus", lambda: False)


@on_gpus
def test_a_paper_sized_point_is_refused_in_one_line_before_anything_is_built(tmp_path):
    began = time.monotonic()
    done = subprocess.run([sys.executable, "experiments/train.py", "model=fig4_13b", "gpus=1",
                           f"results_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, HOST_MEMORY_ENV: "24e9"})  # whatever this host has
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = done.stderr.splitlines()
    assert line.startswith("error: point (fig4_13b, stage 2, 1 GPUs") and "GB per process (predicted)" in line
    assert f"({HOST_MEMORY_ENV} 24.00 GB over 1 rank(s))" in line
    assert "simulate=true" in line and "ignore_host_memory=true" in line
    assert not any(tmp_path.rglob("*.json")) and time.monotonic() - began < 60


def test_the_host_memory_is_divided_among_the_ranks_here(compose):
    [point] = expand(compose("model=tiny_s", "gpus=[4]", "stage=2"))
    needed = points.predicted_memory_bytes(point, "fp32", dropout=False)["total"]
    check_host_memory(point, 4, available=HostMemory(int(needed * 4.5), "MemAvailable"))
    with pytest.raises(ConfigError, match=r"\(MemAvailable [\d.]+ GB over 4 rank\(s\)\)"):
        check_host_memory(point, 4, available=HostMemory(int(needed * 3.5), "MemAvailable"))


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_host_gives_the_least_of_memavailable_and_its_memory_cgroups(tmp_path, monkeypatch):
    """Slurm and containers enforce their cgroup's limit whatever the host has free: a Slurm step's
    cgroup (v2) under its job's, which holds the limit; v1's memory controller; 'max' is no
    limit; ZERO_REPRO_HOST_MEMORY_BYTES replaces them all."""
    monkeypatch.delenv(HOST_MEMORY_ENV, raising=False)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       263000000 kB\nMemAvailable:   250000000 kB\n")
    job = "system.slice/slurmstepd.scope/job_7"
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    _write(tmp_path, {"self_v2": f"0::/{job}/step_0/user/task_0\n", "self_v1": "4:cpu,cpuacct:/x\n9:memory:/slurm/job_7\n",
                      f"v2/{job}/memory.max": "32000000000\n", f"v2/{job}/memory.current": "2000000000\n",
                      f"v2/{job}/step_0/user/task_0/memory.max": "max\n",
                      f"v2/{job}/step_0/user/task_0/memory.current": "1000000000\n",
                      "v1/memory/slurm/job_7/memory.limit_in_bytes": "16000000000\n",
                      "v1/memory/slurm/job_7/memory.usage_in_bytes": "4000000000\n",
                      "v1/memory/memory.limit_in_bytes": "9223372036854771712\n",  # unlimited, as v1 writes it
                      "v1/memory/memory.usage_in_bytes": "50000000000\n"})
    assert host_available(meminfo, tmp_path / "absent", v2) == HostMemory(250000000 * 1024, "MemAvailable")
    assert host_available(meminfo, tmp_path / "self_v2", v2) == \
        HostMemory(30_000_000_000, f"{v2 / job / 'memory.max'} less memory.current")
    assert host_available(meminfo, tmp_path / "self_v1", v1) == \
        HostMemory(12_000_000_000, f"{v1 / 'memory/slurm/job_7/memory.limit_in_bytes'} less memory.usage_in_bytes")
    assert host_available(tmp_path / "absent", tmp_path / "absent", v2) is None
    monkeypatch.setenv(HOST_MEMORY_ENV, "24e9")
    assert host_available(meminfo, tmp_path / "self_v2", v2) == HostMemory(24 * 10**9, HOST_MEMORY_ENV)
    monkeypatch.setenv(HOST_MEMORY_ENV, "lots")
    with pytest.raises(ConfigError, match=f"^{HOST_MEMORY_ENV}='lots' is not a number of bytes$"):
        host_available()


def test_under_torchrun_local_rank_0_alone_says_why(compose, capsys, monkeypatch):
    """Every local rank refuses; rank 0 prints the one line, the others exit 2 quietly."""
    from experiments.train import check_host_memory_once
    [point] = expand(compose("model=tiny_s", "gpus=[2]", "stage=2"))
    monkeypatch.setenv(HOST_MEMORY_ENV, "1000")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit) as quiet:
        check_host_memory_once(point)
    assert quiet.value.code == 2 and capsys.readouterr() == ("", "")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ConfigError, match=r"over 2 rank\(s\)"):
        check_host_memory_once(point)


def test_a_sweep_records_a_refused_point_invalid_and_goes_on(compose, tmp_path, monkeypatch):
    from experiments.sweeps import local

    def must_not_run(*args, **kwargs):
        raise AssertionError("a refused point must not start")
    monkeypatch.setenv(HOST_MEMORY_ENV, "1000")
    monkeypatch.setattr(local, "run_point", must_not_run)
    sweep = expand(compose("model=tiny_s", "gpus=[1,2]", "stage=2"))
    assert local.run_local_sweep(sweep, tmp_path, "fork", False, "cpu_default") == 0
    for point in sweep:
        record = records.read_record(tmp_path / f"{point.point_id}.json")
        assert record["status"] == "invalid" and "ignore_host_memory=true" in record["error"]
    ran = []
    monkeypatch.setattr(local, "run_point", lambda point, *args: ran.append(point) or {"status": "ok"})
    monkeypatch.setattr(local, "print_summary", lambda rows: None)
    local.run_local_sweep(sweep, tmp_path, "fork", False, "cpu_default", ignore_host_memory=True)
    assert ran == sweep


class _Store:
    """The job's TCPStore, for one task."""
    def __init__(self, *args, **kwargs):
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.values[key]


def test_a_submitit_job_records_a_point_its_nodes_cannot_hold_invalid(compose, tmp_path, monkeypatch):
    """The submitit path checks each point for the job's tasks per node (rank 0 decides for every
    task) and records the refusal as a local sweep does; the fitting point runs."""
    from experiments.sweeps import slurm_job
    big, small = (expand(compose(f"model={m}", "gpus=[2]", "stage=2", f"results_dir={tmp_path}"))[0]
                  for m in ("fig4_13b", "tiny_s"))
    needed = points.predicted_memory_bytes(small, "fp32", dropout=False)["total"]
    monkeypatch.setenv(HOST_MEMORY_ENV, str(needed * 2 + 1))  # two tasks a node hold tiny_s, not 13B
    monkeypatch.setattr(slurm_job.dist, "TCPStore", _Store)
    monkeypatch.setattr(slurm_job, "query_addresses", lambda hosts: {h: h for h in hosts})
    ran = []
    monkeypatch.setattr(slurm_job, "run_as_rank", lambda point, *args: ran.append(point))
    job = SimpleNamespace(global_rank=0, num_tasks=2, local_rank=0, hostnames=["node1"], raw_job_id="7")
    results_dir = tmp_path / big.experiment
    slurm_job.run_job_points([big, small], job, results_dir, force=False)
    record = records.read_record(results_dir / f"{big.point_id}.json")
    assert ran == [small] and record["status"] == "invalid" and "over 2 rank(s)" in record["error"]


@on_gpus
def test_a_slurm_jobs_check_records_a_point_its_node_cannot_hold_invalid_with_the_line(tmp_path):
    """slurm/launch.sh's once-per-job check divides the node's memory among its ranks per node and
    writes the refusal's line to job_status.json; no rank starts."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "scontrol"):
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\ntouch {tmp_path}/{name}_ran\n")
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GPUS_PER_NODE"))}
    done = subprocess.run([str(REPO / "slurm" / "launch.sh"), "model=tiny_s", "gpus=2", "stage=2"],
                          env={**env, "SLURM_JOB_ID": "4242", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "node1",
                               "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": sys.executable,
                               "ZERO_REPRO_DIR": str(REPO), "ZERO_REPRO_SLURM_RESULTS": str(tmp_path / "results"),
                               HOST_MEMORY_ENV: "1000"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    status = json.loads((tmp_path / "results" / "4242" / "job_status.json").read_text())
    assert status["status"] == "invalid" and status["message"].startswith("point (tiny_s, stage 2, 2 GPUs")
    assert f"({HOST_MEMORY_ENV} 0.00 GB over 2 rank(s))" in status["message"], status
    assert not (tmp_path / "srun_ran").exists()


def test_the_dry_run_says_a_point_that_the_host_cannot_hold_is_not_runnable_here(compose, capsys, monkeypatch):
    """dry_run=true's 'runnable here' makes the same host check as a real run: fig4_13b on one CPU
    rank (about 211 GB) is not runnable on a host with 24 GB available; tiny_s is."""
    from experiments.sweeps.dry_run import dry_run
    monkeypatch.setenv(HOST_MEMORY_ENV, "24e9")
    dry_run(expand(compose("model=fig4_13b", "gpus=[1]", "stage=2", "dry_run=true"))
            + expand(compose("model=tiny_s", "gpus=[1]", "stage=2", "dry_run=true")))
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| fig4_13b") or line.startswith("| tiny_s")]
    here = [row.rstrip(" |").rsplit("| ", 1)[1] for row in rows]
    assert re.fullmatch(r"no \(host: (\d+\.\d\d) GB > 24\.00 GB per rank\)", here[0]) and here[1] == "yes", here
    # the row's sizes are the GPUs' half precision, the host check the CPU's fp32: the header says so
    assert float(here[0].split()[2]) != float(rows[0].split("|")[-4].split()[0])
    assert "precision a CPU run trains in (auto: fp32" in out
