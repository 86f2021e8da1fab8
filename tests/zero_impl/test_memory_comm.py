"""What each stage keeps and sends, measured from the actual tensors and collectives.

Memory (bf16 parameters and gradients, AdamW, K = 12): stage 0 holds 16Ψ, stage 1
4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N (the paper's Table 1), up to the padding that aligns every
parameter and bucket (layout.py). Communication: 2Ψ elements per step for every stage (Section 7), up to padding
and the scalars of the global norm.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zero_impl
from helpers import adamw, global_batch, live_storages, lm_loss, make_model, padding_bound, param_groups
from experiments.launch import spawn
from experiments.analysis.memory import model_state_bytes, predicted_for_engine

pytestmark = pytest.mark.numerical  # make test-matrix reruns these under every CPU setting


def _engine(stage: int, precision: str = "fp16", **config) -> zero_impl.ZeroEngine:
    """The paper's arrangement by default: fp16 parameters and gradients (P = G = 2), K = 12."""
    model = make_model()
    return zero_impl.initialize(model, zero_impl.ZeroConfig(stage=stage, precision=precision,
                                                            reduce_bucket_size=500, **config),
                                optimizer=adamw, param_groups=param_groups(model))


def _train_step(engine, step: int = 0) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = global_batch(step, world, 1)[0, rank]
    engine.backward(lm_loss(engine(tokens), tokens))


def _large_live_storages(engine, min_bytes: int, before: dict[int, int]) -> list[int]:
    """Sizes of live tensor storages of at least `min_bytes`, new since `before`, that are not
    the model's parameters or the optimizer's masters and states."""
    known = set(before) | {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    for m in engine.sharded_optimizer.masters:
        known.add(m.tensor.untyped_storage().data_ptr())
    for state in engine.optimizer.state.values():
        known.update(v.untyped_storage().data_ptr() for v in state.values() if torch.is_tensor(v))
    return sorted(n for ptr, n in live_storages().items() if ptr not in known and n >= min_bytes)


def _after_backward(stage: int) -> dict:
    before = live_storages()
    engine = _engine(stage)
    _train_step(engine)
    full_grad_bytes = 2 * engine.psi
    return {"param_grads": [n for n, p in engine.module.named_parameters() if p.grad is not None],
            "large": _large_live_storages(engine, full_grad_bytes // 2, before),
            "grad_bytes": engine.memory()["grads"], "padded": engine.params.numel,
            "peak_buffers": engine.memory()["peak_buffers"]}


@pytest.mark.parametrize("world", [2, 4])
def test_stage2_keeps_no_full_gradient(world):
    results = spawn(_after_backward, world, 2, timeout=60)
    for r in results:
        assert r["param_grads"] == []
        assert r["large"] == [], "a tensor of half the full gradient's size or more is alive"
        assert r["grad_bytes"] == 2 * r["padded"] // world
        assert 0 < r["peak_buffers"] < 2 * r["padded"]  # staging never held all buckets at once


def test_full_gradient_scan_finds_stage1_buffer():
    """The scan above is able to see a full-size gradient: stage 1 keeps one by design."""
    for r in spawn(_after_backward, 2, 1, timeout=60):
        assert r["param_grads"] == []
        assert r["large"] == [2 * r["padded"]]


def _memory(stage: int) -> dict:
    engine = _engine(stage)
    _train_step(engine)
    engine.step()
    frozen = sum(p.numel() * p.element_size() for p in engine.module.parameters() if not p.requires_grad)
    scalars = sum(v.numel() * v.element_size() for s in engine.optimizer.state.values()
                  for v in s.values() if torch.is_tensor(v) and v.dim() == 0)
    return {"memory": {"measured": engine.memory(), "predicted": predicted_for_engine(engine.stats())}, "psi": engine.psi, "padded": engine.params.numel,
            "frozen": frozen, "scalars": scalars, "stats": engine.stats(),
            "master_elements": sum(m.tensor.numel() for m in engine.sharded_optimizer.masters),
            "padding_bound": padding_bound(engine.params.buckets)}


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_model_state_bytes_match_table1(stage, world):
    results = spawn(_memory, world, stage, timeout=60)
    psi, padded, frozen = results[0]["psi"], results[0]["padded"], results[0]["frozen"]
    expected = {0: 16 * psi, 1: 4 * psi + 12 * psi / world, 2: 2 * psi + 14 * psi / world}[stage]
    for r in results:
        predicted, measured = r["memory"]["predicted"], r["memory"]["measured"]
        assert predicted["total"] == pytest.approx(expected)
        assert measured["params"] == 2 * padded + frozen
        assert measured["grads"] == (2 * padded // world if stage == 2 else 2 * padded)
        # Masters and Adam states cover exactly the real elements of this rank's slices.
        slack = 16 * (padded - psi) + frozen + r["scalars"]
        assert abs(measured["total"] - predicted["total"]) <= slack
    optimizer_bytes = sum(r["memory"]["measured"]["optimizer_states"] - r["scalars"] for r in results)
    # 12 bytes per master element: the real elements, plus the alignment gaps a group's master
    # spans inside a bucket (padding, kept zero)
    masters = sum(r["master_elements"] for r in results)
    assert optimizer_bytes == 12 * masters
    copies = world if stage == 0 else 1  # stage 0: every rank updates everything
    assert psi * copies <= masters <= (psi + results[0]["padding_bound"]) * copies


def test_prediction_formulas():
    psi, nd = 7.5e9, 64
    assert model_state_bytes(psi, 0, nd)["total"] == 120e9
    assert model_state_bytes(psi, 1, nd)["total"] / 1e9 == pytest.approx(31.4, abs=0.05)
    assert model_state_bytes(psi, 2, nd)["total"] / 1e9 == pytest.approx(16.6, abs=0.05)
    assert model_state_bytes(psi, 3, nd)["total"] / 1e9 == pytest.approx(1.875)


def _comm(stage: int, accum: int) -> dict:
    engine = _engine(stage, precision="fp32", grad_accum_steps=accum)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(2):
        batch = global_batch(step, world, accum)
        for k in range(accum):
            engine.backward(lm_loss(engine(batch[k, rank]), batch[k, rank]))
            engine.step()
    engine.full_parameters()  # export traffic stays out of the per-step figures
    stats = engine.stats()
    return {"comm": stats["comm"]["last_step"], "psi": engine.psi, "padded": engine.params.numel,
            "padding_bound": padding_bound(engine.params.buckets)}


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_comm_volume_is_2psi(stage, world):
    r = spawn(_comm, world, stage, 1, timeout=60)[0]
    psi, padded, comm = r["psi"], r["padded"], r["comm"]
    assert padded - psi <= r["padding_bound"]
    purposes = comm["by_purpose"]
    assert purposes["grads"]["elements"] + purposes.get("params", {"elements": 0})["elements"] == 2 * padded
    # the global norm's scalar, all-reduced over DP at stages 1-2; at stage 0 every rank holds the
    # whole all-reduced gradient, so its own norm is the global one: no norm traffic
    assert set(purposes) == {"grads", "params", "norm"} - ({"params", "norm"} if stage == 0 else set())
    assert stage == 0 or purposes["norm"]["elements"] == 2  # one fp32 sum (the ledger's convention: 2x)
    kinds = comm["by_kind"]
    if stage == 0:
        assert kinds["all_reduce"]["elements"] == 2 * padded
    else:
        assert kinds["reduce_scatter"]["elements"] == padded
        assert kinds["all_gather"]["elements"] == padded
    assert comm["bytes"] == 4 * comm["elements"]


@pytest.mark.parametrize("stage,expected_psi_multiple", [(0, 2), (1, 2), (2, 3)])
def test_comm_with_accumulation(stage, expected_psi_multiple):
    """With 2 micro-batches, stages 0-1 still reduce once; stage 2 reduce-scatters every micro-step."""
    r = spawn(_comm, 2, stage, 2, timeout=60)[0]
    purposes = r["comm"]["by_purpose"]
    moved = purposes["grads"]["elements"] + purposes.get("params", {"elements": 0})["elements"]
    assert moved == expected_psi_multiple * r["padded"]
