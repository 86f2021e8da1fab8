"""fp16 dynamic loss scaling: an overflow on one rank skips the step on every rank."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zero_impl
from helpers import adamw, global_batch, lm_loss, make_model, max_abs_diff, param_groups
from experiments.launch import spawn

pytestmark = pytest.mark.numerical  # make test-matrix reruns these under every CPU setting

OVERFLOW_STEP = 2


def _run(stage: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    engine = zero_impl.initialize(model, zero_impl.ZeroConfig(stage=stage, precision="fp16", reduce_bucket_size=500),
                                  optimizer=adamw, param_groups=param_groups(model))
    inject = {"on": False}
    if rank == 1:
        # Only rank 1's gradient of a few elements becomes inf; after a reduce-scatter only the
        # owner of those elements sees it, so the others must learn of it from the shared decision.
        model.blocks[0].fc.weight.register_hook(
            lambda g: g.index_fill(0, torch.tensor([0]), float("inf")) if inject["on"] else g)
    steps = []
    for step in range(4):
        inject["on"] = step == OVERFLOW_STEP
        before = engine.full_parameters()
        tokens = global_batch(step, world, 1)[0, rank]
        engine.backward(lm_loss(engine(tokens), tokens))
        scale = engine.stats()["loss_scale"]
        applied = engine.step()
        steps.append({"applied": applied, "scale_before": scale, "scale_after": engine.stats()["loss_scale"],
                      "changed": max_abs_diff(before, engine.full_parameters()) > 0,
                      "skipped": engine.stats()["skipped_steps"]})
    return {"steps": steps, "params": engine.full_parameters()}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_overflow_on_one_rank_skips_everywhere(stage):
    results = spawn(_run, 2, stage, timeout=120)
    for r in results:
        for i, s in enumerate(r["steps"]):
            overflow = i == OVERFLOW_STEP
            assert s["applied"] is not overflow
            assert s["changed"] is not overflow
            assert s["scale_after"] == (s["scale_before"] / 2 if overflow else s["scale_before"])
        assert r["steps"][-1]["skipped"] == 1
        assert r["steps"][0]["scale_before"] == 2.0 ** 16
    assert max_abs_diff(results[0]["params"], results[1]["params"]) == 0.0


def test_loss_scaler_grows_after_clean_window():
    scaler = zero_impl.loss_scaler.LossScaler(enabled=True, initial_scale_power=4, window=3, min_scale=2.0)
    for _ in range(3):
        scaler.update(overflow=False)
    assert scaler.scale == 32.0
    for _ in range(10):
        scaler.update(overflow=True)
    assert scaler.scale == 2.0
    static = zero_impl.loss_scaler.LossScaler(enabled=True, static_scale=128.0)
    static.update(overflow=True)
    assert static.scale == 128.0
