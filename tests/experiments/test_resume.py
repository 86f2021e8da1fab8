"""train.resume=true finds the run's checkpoints when train.steps changed (the point's id does
depend on it), and every run of train.py says on stdout whether it resumed and at which step."""
from __future__ import annotations

import subprocess
import sys

from experiments.commands import REPO


def _train(tmp_path, *overrides: str) -> str:
    done = subprocess.run([sys.executable, "experiments/train.py", "model=tiny_s", "gpus=1", "stage=2",
                           "train.warmup_steps=0", "train.checkpoint_every=1", f"results_dir={tmp_path}", *overrides],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_resume_with_more_steps_continues_the_run_and_says_from_which_step(tmp_path):
    first = _train(tmp_path, "train.steps=2")
    assert first.splitlines()[-1] == "started at step 0"
    longer = _train(tmp_path, "train.steps=3", "train.resume=true")
    [ids] = [p.name for p in (tmp_path / "adhoc" / "checkpoints").iterdir()]
    assert longer.splitlines()[-1] == f"resumed at step 2 from {tmp_path}/adhoc/checkpoints/{ids}/step_2"
    assert len(list((tmp_path / "adhoc").glob("*.json"))) == 2   # two points: their steps differ


def test_a_resume_past_the_runs_end_is_refused_instead_of_recording_the_old_run(tmp_path):
    """A checkpoint at step 3 and a resumed run of 1 step: nothing would train, and the record would
    carry the earlier run's losses as this one's. It fails, saying why, and records no ok."""
    _train(tmp_path, "train.steps=3")
    done = subprocess.run([sys.executable, "experiments/train.py", "model=tiny_s", "gpus=1", "stage=2",
                           "train.warmup_steps=0", "train.checkpoint_every=1", f"results_dir={tmp_path}",
                           "train.steps=1", "train.resume=true"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "is at step 3, past this run's end (train.warmup_steps 0 + train.steps 1)" in done.stdout + done.stderr
    import json
    statuses = sorted(json.loads(p.read_text())["status"] for p in (tmp_path / "adhoc").glob("*.json"))
    assert statuses == ["fail", "ok"]
