"""A point run for real on CPU processes is refused before anything is built when its predicted
memory per process exceeds what the host has available (points.check_host_memory); a sweep
records it `invalid` and goes on; ignore_host_memory=true runs it anyway."""
from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import torch

from experiments import points, records
from experiments.commands import REPO
from experiments.points import ConfigError, check_host_memory, expand

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="GPU ranks hold their tensors on the device: the host check is the CPU path's")


def test_a_paper_sized_point_is_refused_in_one_line_before_anything_is_built(tmp_path):
    began = time.monotonic()
    done = subprocess.run([sys.executable, "experiments/train.py", "model=fig4_13b", "gpus=1",
                           f"results_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = done.stderr.splitlines()
    assert line.startswith("error: point (fig4_13b, stage 2, 1 GPUs") and "GB per process (predicted)" in line
    assert "MemAvailable" in line and "simulate=true" in line and "ignore_host_memory=true" in line
    assert not any(tmp_path.rglob("*.json")) and time.monotonic() - began < 60


def test_the_host_memory_is_divided_among_the_ranks_here(compose):
    [point] = expand(compose("model=tiny_s", "gpus=[4]", "stage=2"))
    needed = points.predicted_memory_bytes(point, "fp32", dropout=False)["total"]
    check_host_memory(point, 4, available=int(needed * 4.5))
    with pytest.raises(ConfigError, match=r"over 4 rank\(s\)"):
        check_host_memory(point, 4, available=int(needed * 3.5))


def test_a_sweep_records_a_refused_point_invalid_and_goes_on(compose, tmp_path, monkeypatch):
    from experiments.sweeps import local

    def must_not_run(*args, **kwargs):
        raise AssertionError("a refused point must not start")
    monkeypatch.setattr(points, "host_available_bytes", lambda: 1000)
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


def test_the_dry_run_says_a_point_that_the_host_cannot_hold_is_not_runnable_here(compose, capsys, monkeypatch):
    """dry_run=true's 'runnable here' makes the same host check as a real run: fig4_13b on one CPU
    rank (about 208 GB) is not runnable on a host with 24 GB available; tiny_s is."""
    from experiments.sweeps.dry_run import dry_run
    monkeypatch.setattr(points, "host_available_bytes", lambda: 24 * 10**9)
    dry_run(expand(compose("model=fig4_13b", "gpus=[1]", "stage=2", "dry_run=true"))
            + expand(compose("model=tiny_s", "gpus=[1]", "stage=2", "dry_run=true")))
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| fig4_13b") or line.startswith("| tiny_s")]
    here = [row.rstrip(" |").rsplit("| ", 1)[1] for row in rows]
    assert re.fullmatch(r"no \(host: (\d+\.\d\d) GB > 24\.00 GB per rank\)", here[0]) and here[1] == "yes", here
    # the row's sizes are the GPUs' half precision, the host check the CPU's fp32: the header says so
    assert float(here[0].split()[2]) != float(rows[0].split("|")[-4].split()[0])
    assert "precision a CPU run trains in (auto: fp32" in out
