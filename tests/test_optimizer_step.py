"""The optimizer step's temporaries are bounded by optimizer_bucket_size (CB, zero_impl/optimizer.py).

Stepping a mixed-precision shard at once converts every owned gradient to fp32 before the torch
optimizer runs: 4 bytes per owned element on top of the model states (8 with a foreach Adam's
sqrt, as on CUDA), which is what put Figure 2's 170B point over 32 GB. In chunks, the step's
peak above its start is at most a chunk's worth, whatever the model size. Values are untouched:
the fp64 parity cases with tiny chunks are in test_parity.py's bucketing variants.
"""
from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import zero_impl
from experiments.launch import spawn
from experiments.models.tiny_gpt import TinyGPT, TinyGPTConfig, lm_loss

SHAPE = TinyGPTConfig(vocab_size=1000, seq_len=32, hidden=96, layers=4, heads=4)
CHUNK = 20_000  # elements of masters per update: several per rank (each rank owns ~250k)


def _live_tensors() -> list[torch.Tensor]:
    return [t for t in gc.get_objects() if torch.is_tensor(t)]


def _total(snapshot: dict) -> int:
    return sum(kinds["Total"] for kinds in snapshot.values())


def _step_peak(stage: int, optimizer_bucket_size: int | None) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(SHAPE).to(torch.float16)
    config = zero_impl.ZeroConfig(stage=stage, precision="fp16", loss_scale=1.0, reduce_bucket_size=40_000,
                                  optimizer_bucket_size=optimizer_bucket_size)
    engine = zero_impl.initialize(model, config, optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-3))
    tokens = torch.randint(0, SHAPE.vocab_size, (2, SHAPE.seq_len), generator=torch.Generator().manual_seed(1))
    peaks = []
    for _ in range(2):  # the first step also creates Adam's states: the second shows the temporaries alone
        engine.backward(lm_loss(engine(tokens).float(), tokens))
        tracker = MemTracker()
        tracker.track_external(*_live_tensors())  # what exists before the step is no allocation of it
        with warnings.catch_warnings(), tracker:
            warnings.simplefilter("ignore", UserWarning)  # MemTracker on a parameter-less view
            before = _total(tracker.get_tracker_snapshot())
            assert engine.step()
            peaks.append(_total(tracker.get_tracker_snapshot("peak")) - before)
    masters = [m.tensor.numel() for m in engine.sharded_optimizer.masters]
    return {"step_peak": peaks[1], "owned": sum(masters), "largest_master": max(masters),
            "chunks": len(engine.sharded_optimizer.chunks), "stats": engine.stats(),
            "params": engine.full_parameters()}


@pytest.mark.parametrize("stage", [1, 2])
def test_step_temporaries_are_bounded_by_the_chunk(stage):
    whole = spawn(_step_peak, 2, stage, None, timeout=120)
    chunked = spawn(_step_peak, 2, stage, CHUNK, timeout=120)
    for w, c in zip(whole, chunked):
        assert w["chunks"] == 1 and c["chunks"] >= 5
        # one update of the whole shard holds the fp32 copy of every owned gradient at once
        assert w["step_peak"] >= 4 * w["owned"]
        # in chunks: one chunk's fp32 gradients (a chunk is at most CHUNK elements or one larger
        # master) and two fp32 temporaries of one master: CPU AdamW is single-tensor, and its
        # denominator exp_avg_sq.sqrt() / bias_correction2_sqrt holds the root and the quotient
        bound = 4 * max(CHUNK, c["largest_master"]) + 2 * 4 * c["largest_master"] + 4096
        assert c["step_peak"] <= bound < w["step_peak"], (c["step_peak"], bound, w["step_peak"])
        buffers, limits = c["stats"]["buffers"], c["stats"]["buffer_limits"]
        assert 0 < buffers["optimizer_step"] <= limits["optimizer_step"] == 4 * max(CHUNK, c["largest_master"])
        assert w["stats"]["buffers"]["optimizer_step"] == w["stats"]["buffer_limits"]["optimizer_step"] == 4 * w["owned"]
        # and the same update, bit for bit
        assert all(torch.equal(w["params"][k], c["params"][k]) for k in w["params"])


def test_optimizer_bucket_size_is_validated():
    assert zero_impl.ZeroConfig(optimizer_bucket_size=4e7).optimizer_bucket_size == 40_000_000
    for bad in (0, -1, 2.5, "big", True):
        with pytest.raises(ValueError, match="optimizer_bucket_size"):
            zero_impl.ZeroConfig(optimizer_bucket_size=bad)


def test_paper_baselines_step_the_whole_shard():
    """The paper's baselines (Megatron-LM, PyTorch DDP) stepped the whole model at once; a
    point says so with its own zero override, and every other point keeps the default."""
    from test_zero_r import _compose
    from experiments.points import expand
    for experiment in ("fig2", "fig4", "table2"):
        for point in expand(_compose(f"experiment={experiment}", "dry_run=true")):
            expected = None if point.stage == 0 else zero_impl.ZeroConfig.optimizer_bucket_size
            assert point.zero["optimizer_bucket_size"] == expected, (experiment, point.describe())


@pytest.mark.parametrize("override,message", [
    ({"bogus_size": 1}, r"zero override\(s\) \['bogus_size'\] are not engine knobs; allowed: .*optimizer_bucket_size"),
    ({"optimizer_bucket_size": 0}, r"zero.optimizer_bucket_size must be an integer >= 1, got 0"),
    ({"stage": 3}, r"\['stage'\] are not engine knobs"),
])
def test_a_points_zero_override_is_checked_by_name(override, message):
    from omegaconf import OmegaConf
    from test_zero_r import _compose
    from experiments.points import ConfigError, expand
    cfg = _compose("experiment=table2", "dry_run=true")
    OmegaConf.update(cfg, "experiment.points", [dict(OmegaConf.to_container(cfg.experiment.points[0]), zero=override)])
    with pytest.raises(ConfigError, match=message):
        expand(cfg)
