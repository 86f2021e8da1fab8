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


def test_runner_checkpoints_stops_on_request_and_resumes(compose, tmp_path, monkeypatch, capfd):
    """train.checkpoint_every saves; the stop file (Slurm's warning, slurm/launch.sh) makes the
    ranks save and raise Preempted after the step in flight; train.resume continues from the
    latest complete checkpoint, losses and step times included, to the uninterrupted run's
    losses, and says which, passing over a later save that was cut off (no manifest)."""
    from experiments.launch import RankFailed
    from experiments.run.real import train_rank, with_checkpoint_dir
    straight = _point(compose, tmp_path, "train.checkpoint_every=2")
    done = spawn(train_rank, 2, with_checkpoint_dir(straight, tmp_path), "fp32", timeout=120)[0]
    root = tmp_path / "checkpoints" / straight.checkpoint_id
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4"] and len(done["losses"]) == 5
    monkeypatch.setenv("ZERO_REPRO_STOP_FILE", str(tmp_path / "stop_requested"))
    (tmp_path / "stop_requested").touch()
    stopped = _point(compose, tmp_path, f"train.checkpoint_dir={tmp_path}/interrupted")
    with pytest.raises(RankFailed, match="stopped after step 1 at the launcher's request"):
        spawn(train_rank, 2, with_checkpoint_dir(stopped, tmp_path), "fp32", timeout=120)
    assert checkpoint.latest(tmp_path / "interrupted") == tmp_path / "interrupted" / "step_1"
    monkeypatch.delenv("ZERO_REPRO_STOP_FILE")
    cut_off = tmp_path / "interrupted" / "step_3.tmp"  # a later save killed midway (tests/zero_impl/test_checkpoint.py)
    cut_off.mkdir()
    (cut_off / "__0_0.distcp").write_bytes(b"\0" * 100)
    capfd.readouterr()
    resumed = _point(compose, tmp_path, f"train.checkpoint_dir={tmp_path}/interrupted", "train.resume=true")
    assert resumed.point_id == straight.point_id  # checkpoint settings leave the point's id alone
    again = spawn(train_rank, 2, with_checkpoint_dir(resumed, tmp_path), "fp32", timeout=120)[0]
    assert again["losses"] == done["losses"] and len(again["step_times_s"]) == 4
    assert f"train.resume: from {tmp_path}/interrupted/step_1, the newest complete checkpoint in {tmp_path}/interrupted; " \
           "passing over the unfinished save(s) step_3.tmp\n" in capfd.readouterr().out
    assert again["resume"] == {"last_step": 5, "checkpoint": str(tmp_path / "interrupted" / "step_1"),
                               "resumed_from": str(tmp_path / "interrupted" / "step_1"), "resumed_step": 1}


def _listing_lags_on_rank_1(point_dict: dict, hidden: str) -> dict:
    """train_rank, rank 1 not seeing the folder `hidden` yet (a shared file system's cached listing)."""
    from pathlib import Path
    import torch.distributed as dist
    from experiments.run.real import train_rank
    if dist.get_rank() == 1:
        glob = Path.glob
        Path.glob = lambda self, pattern, *a, **k: (p for p in glob(self, pattern, *a, **k) if p.name != hidden)
    return train_rank(point_dict, "fp32")


def test_every_rank_resumes_from_rank_0s_choice(compose, tmp_path):
    """Rank 1 lists the checkpoints before step_4 shows there: it resumes from step_4 too, the
    one rank 0 found, and the run ends at the uninterrupted run's losses."""
    from experiments.run.real import train_rank, with_checkpoint_dir
    straight = _point(compose, tmp_path, "train.checkpoint_every=2", f"train.checkpoint_dir={tmp_path}/ck")
    done = spawn(train_rank, 2, with_checkpoint_dir(straight, tmp_path), "fp32", timeout=120)[0]
    resumed = _point(compose, tmp_path, "train.checkpoint_every=2", f"train.checkpoint_dir={tmp_path}/ck",
                     "train.resume=true")
    ranks = spawn(_listing_lags_on_rank_1, 2, with_checkpoint_dir(resumed, tmp_path), "step_4", timeout=90)
    for again in ranks:
        assert again["resume"]["resumed_from"] == str(tmp_path / "ck" / "step_4")
        assert again["losses"] == done["losses"]


def _barriers_and_times(point_dict: dict) -> dict:
    import sys
    import torch.distributed as dist
    from experiments.run.real import train_rank
    barrier, calls = dist.barrier, []

    def counted(*args, **kwargs):  # the training loop's own barriers (not the build's)
        if sys._getframe(1).f_code.co_name == "train_rank":
            calls.append(1)
        return barrier(*args, **kwargs)
    dist.barrier = counted
    try:
        out = train_rank(point_dict, "fp32")
    finally:
        dist.barrier = barrier
    return {"barriers": len(calls), "times": out["step_times_s"], "losses": out["losses"]}


def test_timed_steps_run_back_to_back(compose, tmp_path, monkeypatch):
    """The timed steps form one window: no barrier (and on CUDA no sync) between them, so the
    post-step parameter gathers can hide behind the next forward as in training (StepClock);
    a barrier for the warm-up step and one where the window starts. A checkpoint closes the
    window (its save is not timed) and the next step opens another."""
    from experiments.run.real import with_checkpoint_dir
    plain = _point(compose, tmp_path)
    [r, _] = spawn(_barriers_and_times, 2, with_checkpoint_dir(plain, tmp_path), timeout=120)
    assert r["barriers"] == 2 and len(r["times"]) == 4 and all(t > 0 for t in r["times"]) and len(r["losses"]) == 5
    saving = _point(compose, tmp_path, "train.checkpoint_every=2", f"train.checkpoint_dir={tmp_path}/ck")
    [s, _] = spawn(_barriers_and_times, 2, with_checkpoint_dir(saving, tmp_path), timeout=120)
    assert s["losses"] == r["losses"] and len(s["times"]) == 4
    assert s["barriers"] - r["barriers"] >= 1  # the window after step 2's save starts aligned again
    # under Slurm's stop file (not there yet) the window stays open up to STOP_CHECK_STEPS steps
    monkeypatch.setenv("ZERO_REPRO_STOP_FILE", str(tmp_path / "not_requested"))
    [w, _] = spawn(_barriers_and_times, 2, with_checkpoint_dir(plain, tmp_path), timeout=120)
    assert w["barriers"] == 2 and len(w["times"]) == 4 and w["losses"] == r["losses"]
