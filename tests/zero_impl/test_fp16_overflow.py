"""fp16 dynamic loss scaling: an overflow on one rank skips the step on every rank."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zero_impl
from helpers import LR, adamw, global_batch, lm_loss, make_model, max_abs_diff, param_groups
from experiments.launch import spawn

pytestmark = pytest.mark.numerical  # make test-matrix reruns these under every CPU setting

OVERFLOW_STEP = 2


def fused_adamw(groups) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR, fused=True)


def _run(stage: int, optimizer=adamw, on_device: bool | None = None) -> dict:
    """`on_device`: None, as the optimizer allows; False forces the host's reading of the flag."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    engine = zero_impl.initialize(model, zero_impl.ZeroConfig(stage=stage, precision="fp16", reduce_bucket_size=500),
                                  optimizer=optimizer, param_groups=param_groups(model))
    if on_device is not None:
        engine.sharded_optimizer.skips_on_device = on_device
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
        steps.append({"applied": bool(applied), "lazy": not isinstance(applied, bool), "scale_before": scale, "scale_after": engine.stats()["loss_scale"],
                      "changed": max_abs_diff(before, engine.full_parameters()) > 0,
                      "skipped": engine.stats()["skipped_steps"]})
    return {"steps": steps, "params": engine.full_parameters(), "scaler": (engine.scaler.clean_steps,
                                                                             engine.scaler.hysteresis_left)}


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


@pytest.mark.parametrize("stage", [1, 3])
def test_overflow_skipped_on_the_device_bitwise_as_on_the_host(stage):
    """torch's fused AdamW takes the overflow flag: the skip and the halving stay on the device
    (step() answers lazily), and give the very parameters and scales of the host's decision."""
    device = spawn(_run, 2, stage, fused_adamw, None, timeout=120)
    host = spawn(_run, 2, stage, fused_adamw, False, timeout=120)
    for d, h in zip(device, host):
        assert all(s["lazy"] for s in d["steps"]) and not any(s["lazy"] for s in h["steps"])
        assert [{k: v for k, v in s.items() if k != "lazy"} for s in d["steps"]] == \
            [{k: v for k, v in s.items() if k != "lazy"} for s in h["steps"]]
        assert [s["applied"] for s in d["steps"]] == [i != OVERFLOW_STEP for i in range(4)]
        assert d["steps"][OVERFLOW_STEP]["scale_after"] == d["steps"][OVERFLOW_STEP]["scale_before"] / 2
        assert d["scaler"] == h["scaler"]
        assert all(torch.equal(d["params"][k], h["params"][k]) for k in h["params"])


def _host_rule(events, power, window, min_scale, hysteresis, consecutive):
    """DeepSpeed's DynamicLossScaler.update_scale, in Python floats (the scaler's host rule)."""
    scale, clean, left, out = float(2 ** power), 0, hysteresis, []
    for overflow in events:
        if overflow:
            if left <= 1:
                scale = max(scale / 2, min_scale)
            else:
                left -= 1
            clean = 0
        else:
            clean += 1
            if consecutive:
                left = hysteresis
            if clean % window == 0:
                scale *= 2
                left = hysteresis
        out.append((scale, clean, left))
    return out


@pytest.mark.parametrize("hysteresis,consecutive", [(1, False), (2, False), (3, True)])
def test_device_scaler_follows_the_host_rule(hysteresis, consecutive):
    events = [bool(b) for b in torch.randint(0, 2, (200,), generator=torch.Generator().manual_seed(hysteresis))]
    events[40:60] = [True] * 20  # down to the floor
    events[150:] = [False] * 50    # and back up
    scaler = zero_impl.loss_scaler.LossScaler(enabled=True, initial_scale_power=5, window=3, min_scale=2.0,
                                              hysteresis=hysteresis, consecutive_hysteresis=consecutive)
    seen = []
    for overflow in events:
        scaler.update(overflow=torch.tensor(overflow))
        seen.append((scaler.scale, scaler.clean_steps, scaler.hysteresis_left))
    # hysteresis 1 runs torch's fused update, which counts clean steps modulo the window
    window = 3 if hysteresis == 1 else None
    assert seen == [(s, c % window if window else c, h) for s, c, h in _host_rule(events, 5, 3, 2.0, hysteresis,
                                                                                   consecutive)]
    assert min(s for s, _, _ in seen) == 2.0 and seen[-1][0] > 2 ** 5


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
