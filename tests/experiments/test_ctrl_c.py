"""Ctrl-C in a simulated sweep and in the largest-model search: one line and exit code 130 at
once, no traceback from the simulations' children or from Python's exit, the running points
recorded as interrupted, and the search's finished simulations kept for the same command again."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from experiments import records
from experiments.points import expand
from experiments.commands import REPO

# sweep.py as a user runs it, with each simulation stuck until killed (it writes its pid first)
SWEEP = """
import os, runpy, sys, time
from pathlib import Path
from experiments.sweeps import simulated

STARTED = Path(sys.argv[1])

def stuck(point_dict, precision, rank, **kwargs):
    (STARTED / str(os.getpid())).touch()
    time.sleep(600)

simulated.simulate_point = stuck
sys.argv = ["experiments/sweep.py", *sys.argv[2:]]
runpy.run_path("experiments/sweep.py", run_name="__main__")
"""


def test_ctrl_c_records_the_running_simulations_and_leaves_at_once(tmp_path):
    started = tmp_path / "started"
    started.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", SWEEP, str(started), "model=tiny_s", "gpus=[1,2]", "stage=2", "simulate=true",
         "simulate_workers=2", f"results_dir={tmp_path}"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,  # a terminal's Ctrl-C reaches the whole process group
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while len(list(started.iterdir())) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        children = [int(p.name) for p in started.iterdir()]
        assert len(children) == 2, proc.communicate(timeout=5)
        os.killpg(proc.pid, signal.SIGINT)
        began = time.monotonic()
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and time.monotonic() - began < 10
    assert stderr.strip().startswith("interrupted: ") and "Traceback" not in stderr, stderr
    found = [records.read_record(p) for p in (tmp_path / "cpu_default" / "simulated").glob("*.json")]
    assert len(found) == 2 and all(r["status"] == "fail" and "interrupted" in r["error"] for r in found)
    time.sleep(0.5)
    for pid in children:  # killed with the sweep, none left behind
        try:
            os.kill(pid, 0)
            assert open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        except ProcessLookupError:
            pass


# sweep.py simulate_largest=true as a user runs it, each simulation cheap: a real one-layer tiny_s
# simulation (made once, then reused) whose peaks are set to 1 MB a layer. With STUCK, the first
# simulation of each row (by its GPU count) finishes and every later one hangs until killed.
LARGEST = """
import copy, os, pickle, runpy, sys, time
from pathlib import Path
from experiments.sweeps import simulated

HERE, STUCK = Path(sys.argv[1]), sys.argv[2] == "stuck"
real = simulated.simulate_point

def cheap(point_dict, precision, rank, **kwargs):
    layers, gpus = point_dict["model"]["layers"], point_dict["gpus"]
    (HERE / "calls" / f"{gpus}-{layers}").touch()
    if STUCK:
        try:
            os.close(os.open(HERE / f"first-{gpus}", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            (HERE / "stuck" / str(os.getpid())).touch()
            time.sleep(600)
    cached = HERE / f"one-layer-{gpus}.pkl"
    if not cached.exists():
        one = copy.deepcopy(point_dict)
        one["model"]["layers"] = 1
        cached.write_bytes(pickle.dumps(real(one, precision, rank, **kwargs)))
    result = pickle.loads(cached.read_bytes())
    result["memory"]["peak_bytes"] = layers * 10**6
    if result.get("reserved"):
        result["reserved"].update(reserved_peak_bytes=layers * 10**6, oom=layers * 10**6 > 5 * 10**7)
        result["reserved"].pop("unbounded", None)
    return result

simulated.simulate_point = cheap
sys.argv = ["experiments/sweep.py", *sys.argv[3:]]
runpy.run_path("experiments/sweep.py", run_name="__main__")
"""
LARGEST_ARGS = ("model=tiny_s", "gpus=[1,2]", "stage=2", "simulate=true", "simulate_largest=true", "cluster=dgx2_v100",
                "cluster.device_memory_gb=0.05", "cluster.cuda_reserve_gb=0", "simulate_workers=2")


def test_ctrl_c_in_the_largest_model_search_keeps_each_finished_simulation_and_a_rerun_goes_on(tmp_path):
    """Each simulation's record is written as it ends (under simulated/search/), the running ones
    as interrupted; the message says so; the same command again starts each row's search from the
    finished ones, simulating none of them again."""
    for folder in ("calls", "stuck"):
        (tmp_path / folder).mkdir()
    args = [sys.executable, "-c", LARGEST, str(tmp_path)]
    proc = subprocess.Popen(
        [*args, "stuck", *LARGEST_ARGS, f"results_dir={tmp_path}"], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    searched = tmp_path / "cpu_default" / "simulated"
    try:
        deadline = time.monotonic() + 120
        while len(list((tmp_path / "stuck").iterdir())) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert len(list((tmp_path / "stuck").iterdir())) == 2, proc.communicate(timeout=5)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == (
        "interrupted: the search's finished simulations are kept in cpu_default/simulated/search/ (the running ones "
        "say they were interrupted); the same command again starts each row's search from them")
    found = [records.read_record(p) for p in searched.glob("search/*.json")]
    finished = sorted(r["config"]["gpus"] for r in found if r["status"] in ("ok", "oom"))
    assert finished == [1, 2] and not list(searched.glob("*.json"))
    assert len(found) == 4
    assert all("interrupted" in r["error"] for r in found if r["status"] == "fail")
    first = {p.name for p in (tmp_path / "calls").iterdir()} - {f"{g}-{n}" for r in found if r["status"] == "fail"
                                                                for g, n in [(r["config"]["gpus"], r["model"]["layers"])]}
    for call in (tmp_path / "calls").iterdir():
        call.unlink()
    again = subprocess.run([*args, "finish", *LARGEST_ARGS, f"results_dir={tmp_path}"], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "reusing 2 simulated depths of an earlier search" in again.stderr
    assert not first & {p.name for p in (tmp_path / "calls").iterdir()}  # the finished depths are not simulated again
    best = [records.read_record(p) for p in searched.glob("*.json")]
    assert sorted(r["largest_search"]["simulated_max_layers"] for r in best) == [50, 50]
    for r in best:
        depths = {s["layers"] for s in r["largest_search"]["simulations"]}
        assert {f"{r['config']['gpus']}-{n}" for n in depths} >= {c for c in first if c.startswith(f"{r['config']['gpus']}-")}
    assert not any(r["status"] == "fail" for r in map(records.read_record, searched.glob("search/*.json")))


def test_ctrl_c_in_a_torchrun_sweep_records_the_running_point_as_interrupted(compose, tmp_path, monkeypatch):
    """launcher=torchrun: the sweep's line says the running point says it was interrupted; its
    ranks write no record on Ctrl-C, so the sweep writes it."""
    from experiments.sweeps import local

    class Interrupted:
        def __init__(self, *args, **kwargs):
            pass

        def communicate(self, timeout=None):
            raise KeyboardInterrupt
    [point] = expand(compose("model=tiny_s", "gpus=[2]", "stage=2"))
    monkeypatch.setattr(local, "subprocess", SimpleNamespace(**vars(subprocess) | {"Popen": Interrupted}))
    with pytest.raises(KeyboardInterrupt):
        local.run_point(point, "torchrun", tmp_path)
    record = records.read_record(tmp_path / f"{point.point_id}.json")
    assert record["status"] == "fail" and record["error"] == "interrupted by the user (Ctrl-C)"
