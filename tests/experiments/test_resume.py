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
