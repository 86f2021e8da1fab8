"""Ctrl-C in a simulated sweep: one line and exit code 130 at once, no traceback from the
simulations' children or from Python's exit, and the running points recorded as interrupted."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from experiments import records
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
