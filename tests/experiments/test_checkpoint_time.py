"""A checkpoint must fit in Slurm's warning: the bytes a rank writes (checked against what DCP
writes), the time at the cluster's assumed bandwidth, and the refusal before anything runs."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import zero_impl
from experiments.launch import spawn
from experiments.models.megatron_gpt import build_gpt, gpt_loss, initialize_parallel
from experiments.models.gpt_shape import GPTShape
from experiments.models.tiny_gpt import synthetic_tokens
from experiments.points import ConfigError, Point, checkpoint_bytes_per_rank, checkpoint_seconds, expand
from experiments.schema import TrainSettings

REPO = Path(__file__).resolve().parents[2]
SHAPE = GPTShape(layers=2, hidden=256, heads=4, seq_len=16, vocab_size=500)


def test_slurm_scripts_and_config_agree_on_the_warning():
    leads = {p.name: re.findall(r"^#SBATCH --signal=B:USR1@(\d+)$", p.read_text(), re.M)
             for p in sorted((REPO / "slurm").glob("run_*.sh"))}
    assert len(leads) >= 4 and all(len(v) == 1 for v in leads.values()), leads
    assert {int(v[0]) for v in leads.values()} == {TrainSettings.stop_signal_lead_s}


def _bytes_written(path: str, stage: int, tp: int) -> dict:
    dp_group, tp_group = initialize_parallel(tp)
    model = build_gpt(SHAPE)
    engine = zero_impl.initialize(model, zero_impl.ZeroConfig(stage=stage),
                                  optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-3),
                                  dp_group=dp_group, mp_group=tp_group)
    engine.backward(gpt_loss(engine, synthetic_tokens(2, SHAPE.seq_len + 1, SHAPE.vocab_size, seed=1)))
    engine.step()  # Adam's moments exist from here on
    saved = zero_impl.checkpoint.save(engine, path)
    return {"files": {f.name: f.stat().st_size for f in saved.glob("*.distcp")}}


@pytest.mark.parametrize("stage, gpus, tp", [(2, 2, 1), (0, 2, 1), (1, 4, 2)])
def test_checkpoint_bytes_per_rank_is_what_dcp_writes(tmp_path, stage, gpus, tp):
    files = spawn(_bytes_written, gpus, str(tmp_path / "step_1"), stage, tp, timeout=180)[0]["files"]
    model = {"name": "t", "layers": SHAPE.layers, "hidden": SHAPE.hidden, "heads": SHAPE.heads,
             "seq_len": SHAPE.seq_len, "vocab_size": SHAPE.vocab_size}
    point = Point(experiment="e", model=model, stage=stage, gpus=gpus, tp=tp, micro_batch=2, note="", train={},
                  zero={}, cluster={})
    expected = checkpoint_bytes_per_rank(point)
    assert len(files) == gpus
    # what a node writes, the time's numerator: 1.5% above for DCP's per-tensor headers (~1 KB
    # each, ~170 KB of this 20 MB model, nothing at scale), never below
    assert gpus * expected <= sum(files.values()) <= 1.015 * gpus * expected
    # every rank its share, replicated pieces included (stage 0's masters, the LayerNorms of
    # every TP rank): DCP spreads them over their holders, whole tensors at a time (here +-3%)
    for name, size in files.items():
        assert size == pytest.approx(expected, rel=0.05), (name, size, expected)


def _point(compose, *overrides: str) -> Point:
    return expand(compose("experiment=fig4", "model=fig4_13b", "stage=2", "gpus=128", "tp=1", "micro_batch=2",
                          "cluster=dgx2_v100", "train.precision=fp16", *overrides))[0]


def test_checkpoint_seconds_from_the_node_share_of_bandwidth(compose):
    point = _point(compose)
    # 13B (12.69e9 parameters), DP 128: 12 bytes x 12.69e9 / 128 = 1.19 GB per rank; 16 ranks per node at 2 GB/s
    assert checkpoint_bytes_per_rank(point) == pytest.approx(12 * 12.69e9 / 128, rel=0.001)
    assert checkpoint_seconds(point) == pytest.approx(checkpoint_bytes_per_rank(point) * 16 / 2e9)
    assert checkpoint_seconds(_point(compose, "cluster=local")) is None  # unknown bandwidth: no check


def test_a_save_that_cannot_finish_in_the_warning_is_refused(compose):
    # 19.0 GB per node: at 0.05 GB/s one save takes 381 s, which fits in 600 s with a step;
    # with checkpoint_every two (one under way when the warning comes) do not
    _point(compose, "cluster.checkpoint_write_gb_per_s=0.05")
    with pytest.raises(ConfigError, match=r"1\.2 GB per rank x 16 ranks per node at "
                                          r"cluster\.checkpoint_write_gb_per_s=0\.05 takes 381 s; 2 save\(s\) .* do not "
                                          r"fit in train\.stop_signal_lead_s=600 .*--signal=B:USR1@600.*checkpoint_every"):
        _point(compose, "cluster.checkpoint_write_gb_per_s=0.05", "train.checkpoint_every=100")
    with pytest.raises(ConfigError, match=r"takes 762 s; 1 save\(s\)"):
        _point(compose, "cluster.checkpoint_write_gb_per_s=0.025")
    _point(compose, "cluster.checkpoint_write_gb_per_s=0.025", "train.stop_signal_lead_s=900")  # a longer warning
    _point(compose, "cluster.checkpoint_write_gb_per_s=0.025", "simulate=true")  # a simulation saves nothing
    with pytest.raises(ConfigError, match="train.stop_signal_lead_s must be a positive"):
        _point(compose, "train.stop_signal_lead_s=0")
