"""The runner's checkpoints (experiments/train.py): train.checkpoint_every saves, the launcher's
stop request saves and stops, train.resume continues to the uninterrupted run's losses."""
from __future__ import annotations

import pytest

from zero_impl import checkpoint
from experiments.launch import spawn

pytestmark = pytest.mark.numerical  # bitwise resume: rerun by make test-matrix


def _point(compose, tmp_path, *overrides):
    from experiments.points import expand
    [point] = expand(compose("model=tiny_s", "gpus=2", "stage=2", "train.warmup_steps=1", "train.steps=4",
                             f"results_dir={tmp_path}", *overrides))
    return point


def test_runner_checkpoints_stops_on_request_and_resumes(compose, tmp_path, monkeypatch):
    """train.checkpoint_every saves; the stop file (Slurm's warning, slurm/launch.sh) makes the
    ranks save and raise Preempted after the step in flight; train.resume continues from the
    latest checkpoint, losses and step times included, to the uninterrupted run's losses."""
    from experiments.launch import RankFailed
    from experiments.run.real import train_rank, with_checkpoint_dir
    straight = _point(compose, tmp_path, "train.checkpoint_every=2")
    done = spawn(train_rank, 2, with_checkpoint_dir(straight, tmp_path), "fp32", timeout=120)[0]
    root = tmp_path / "checkpoints" / straight.point_id
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4"] and len(done["losses"]) == 5
    monkeypatch.setenv("ZERO_REPRO_STOP_FILE", str(tmp_path / "stop_requested"))
    (tmp_path / "stop_requested").touch()
    stopped = _point(compose, tmp_path, f"train.checkpoint_dir={tmp_path}/interrupted")
    with pytest.raises(RankFailed, match="stopped after step 1 at the launcher's request"):
        spawn(train_rank, 2, with_checkpoint_dir(stopped, tmp_path), "fp32", timeout=120)
    assert checkpoint.latest(tmp_path / "interrupted") == tmp_path / "interrupted" / "step_1"
    monkeypatch.delenv("ZERO_REPRO_STOP_FILE")
    resumed = _point(compose, tmp_path, f"train.checkpoint_dir={tmp_path}/interrupted", "train.resume=true")
    assert resumed.point_id == straight.point_id  # checkpoint settings leave the point's id alone
    again = spawn(train_rank, 2, with_checkpoint_dir(resumed, tmp_path), "fp32", timeout=120)[0]
    assert again["losses"] == done["losses"] and len(again["step_times_s"]) == 4
    assert again["resume"] == {"last_step": 5, "checkpoint": str(tmp_path / "interrupted" / "step_1"),
                               "resumed_from": str(tmp_path / "interrupted" / "step_1")}
