"""Stage 3: what is gathered when, what moves, what stays, and how it is built."""
from __future__ import annotations

import zlib

import math

import pytest
import torch
import torch.distributed as dist

import zero_impl
from helpers import (CLIP, FP64_TOL, LR, MODEL, adamw, fp64_tolerance, global_batch, live_storages, lm_loss,
                     make_model, max_abs_diff, padding_bound, param_groups, reference_run, zero_run)
from zero_impl.comm import CommLedger, Communicator
from experiments.analysis.memory import predicted_for_engine
from experiments.launch import RankFailed, spawn
from experiments.models.tiny_gpt import TinyGPT, TinyGPTConfig

pytestmark = pytest.mark.numerical  # make test-matrix reruns these under every CPU setting

DEEP = TinyGPTConfig(vocab_size=67, seq_len=16, hidden=10, layers=5, heads=2)


def test_tied_weight_in_two_units_matches_adamw():
    params, losses, _ = reference_run(10, 3, 2, tie_blocks=True, precision="fp64")
    results = spawn(lambda: zero_run(10, 2, tie_blocks=True, stage=3, precision="fp64", clip_grad_norm=CLIP), 3,
                    timeout=120)
    assert max_abs_diff(results[0]["params"], params) < FP64_TOL
    assert max_abs_diff(results[0]["params"], results[2]["params"]) == 0.0


def _live_units(max_live: int, prefetch: int) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(DEEP)
    engine = zero_impl.initialize(model, zero_impl.ZeroConfig(stage=3, stage3_max_live_units=max_live,
                                                              stage3_prefetch_bucket_size=prefetch), adamw)
    seen = {"forward": [], "backward": []}
    for block in model.blocks:  # registered after the engine's hooks, so they see the gathered state
        block.register_forward_pre_hook(
            lambda m, a: seen["backward" if engine.params.in_backward else "forward"].append(engine.params.live_units))
        block.register_full_backward_hook(lambda m, gi, go: seen["backward"].append(engine.params.live_units))
    rank = dist.get_rank()
    for step in range(2):
        tokens = global_batch(step, dist.get_world_size(), 1)[0, rank]
        engine.backward(lm_loss(engine(tokens), tokens))
        engine.step()
    return {**seen, "peak": engine.params.peak_live_units, "after": engine.params.live_units}


@pytest.mark.parametrize("max_live,prefetch", [(2, 50_000_000), (3, 50_000_000), (4, 50_000_000), (3, 0)])
def test_gathered_units_never_exceed_the_bound(max_live, prefetch):
    for r in spawn(_live_units, 2, max_live, prefetch, timeout=60):
        assert max(r["forward"]) <= max_live and max(r["backward"]) <= max_live
        assert r["peak"] <= max_live and r["after"] == 0
        if prefetch:  # root + running layer + as many prefetched layers as the bound allows
            assert max(r["forward"]) == max_live
        else:
            assert max(r["forward"]) == 2  # root + running layer


def _after_step_storages(stage: int) -> dict:
    before = live_storages()
    model = make_model()
    engine = zero_impl.initialize(model, zero_impl.ZeroConfig(stage=stage, precision="bf16"), adamw,
                                  param_groups(model))
    rank = dist.get_rank()
    for step in range(2):
        tokens = global_batch(step, dist.get_world_size(), 1)[0, rank]
        engine.backward(lm_loss(engine(tokens), tokens))
        engine.step()
    gathered_layer = sum(p.numel() for p in make_model().blocks[0].parameters()) * 2  # a whole layer, bf16
    large = sorted(n for ptr, n in live_storages().items() if ptr not in before and n >= gathered_layer)
    return {"param_storage_bytes": [p.untyped_storage().nbytes() for p in model.parameters()], "large": large}


def test_no_full_parameter_outside_forward_and_backward():
    """After a step, no parameter has storage and no live tensor on any rank (found by walking
    the GC's objects) is as large as a gathered layer in bf16 (2 x 1300 bytes): the biggest
    things left are 1/4 shards in fp32 (gradients, masters, Adam states: 4 bytes x 1/4 of a
    layer and its alignment padding, under 2000 bytes)."""
    for r in spawn(_after_step_storages, 4, 3, timeout=60):
        assert set(r["param_storage_bytes"]) == {0}
        assert r["large"] == []


def test_storage_scan_finds_stage2_parameters():
    """The scan above sees full parameters when they exist: stage 2 keeps them all."""
    for r in spawn(_after_step_storages, 4, 2, timeout=60):
        assert min(r["param_storage_bytes"]) > 0
        assert r["large"] != []


def _stats(world_steps: int, precision: str, keep_root: bool = True) -> dict:
    model = make_model()
    engine = zero_impl.initialize(model, zero_impl.ZeroConfig(stage=3, precision=precision, stage3_keep_root=keep_root),
                                  adamw, param_groups(model))
    rank = dist.get_rank()
    for step in range(world_steps):
        tokens = global_batch(step, dist.get_world_size(), 1)[0, rank]
        engine.backward(lm_loss(engine(tokens), tokens))
        engine.step()
    scalars = sum(v.numel() * v.element_size() for s in engine.optimizer.state.values()
                  for v in s.values() if torch.is_tensor(v) and v.dim() == 0)
    return {"stats": engine.stats(), "scalars": scalars,
            "largest_unit": max(b.numel for b in engine.params.buckets),
            "reduced": sum(b.numel for b in engine.params.buckets if any(s.param.requires_grad for s in b.slots)),
            "padding_bound": padding_bound(engine.params.buckets),
            "root": engine.params.root.numel,
            "master_elements": sum(m.tensor.numel() for m in engine.sharded_optimizer.masters)}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_comm_is_3psi(world):
    """The paper's schedule (every unit gathered for forward and again for backward)."""
    r = spawn(_stats, world, 2, "fp32", False, timeout=60)[0]
    padded, psi = r["stats"]["padded_psi"], r["stats"]["psi"]
    purposes = r["stats"]["comm"]["last_step"]["by_purpose"]
    frozen = MODEL.seq_len * MODEL.hidden  # wpe: gathered like any parameter, never reduced
    assert padded - psi - frozen <= r["padding_bound"]  # each parameter and unit aligned (layout.py)
    assert purposes["params"]["elements"] == 2 * padded           # forward + backward all-gathers
    # One reduce-scatter per unit's trainable bucket: the frozen wpe's bucket is never reduced.
    assert purposes["grads"]["elements"] == r["reduced"] <= padded - frozen
    assert purposes["norm"]["elements"] <= 8


def test_keeping_the_root_saves_its_second_gather():
    """stage3_keep_root (the default): the root stays gathered from forward to backward, so a
    step gathers everything once and all but the root again; gradients are reduced as before."""
    kept, paper = (spawn(_stats, 2, 2, "fp32", flag, timeout=60)[0] for flag in (True, False))
    params = [r["stats"]["comm"]["last_step"]["by_purpose"]["params"]["elements"] for r in (kept, paper)]
    assert params[0] == params[1] - kept["root"] == 2 * kept["stats"]["padded_psi"] - kept["root"]
    assert kept["stats"]["stage3"]["root_kept_elements"] == kept["root"] > 0
    assert paper["stats"]["stage3"]["root_kept_elements"] == 0
    assert [r["stats"]["comm"]["last_step"]["by_purpose"]["grads"] for r in (kept, paper)][0] == \
        paper["stats"]["comm"]["last_step"]["by_purpose"]["grads"]


class _StopForward(Exception):
    pass


def _stop(*_) -> None:
    raise _StopForward


def _loss_after_a_forward_without_backward(evaluate: str | None, max_live: int) -> dict:
    """Two steps, with (`evaluate`) a forward between each backward and step that no backward
    follows: "grad" a whole forward with gradients (it keeps the root gathered); "early_exit" a
    no_grad forward that stops in the first block (the next blocks were prefetched and stay
    gathered). The step after it must leave no unit gathered with pre-step values."""
    model = make_model()
    # the grad-enabled early exit: no prefetch, and two blocks run, so their pending counts matter
    prefetch = 0 if evaluate == "early_exit_grad" else zero_impl.ZeroConfig().stage3_prefetch_bucket_size
    engine = zero_impl.initialize(model, zero_impl.ZeroConfig(stage=3, stage3_max_live_units=max_live,
                                                              stage3_prefetch_bucket_size=prefetch),
                                  adamw, param_groups(model))
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(2):
        tokens = global_batch(step, world, 1)[0, rank]
        engine.backward(lm_loss(engine(tokens), tokens))
        if evaluate == "grad":
            lm_loss(engine(tokens), tokens)
        elif evaluate in ("early_exit", "early_exit_grad"):
            handle = model.blocks[evaluate == "early_exit_grad"].register_forward_hook(_stop)
            with torch.set_grad_enabled(evaluate == "early_exit_grad"), pytest.raises(_StopForward):
                engine(tokens)
            handle.remove()
        kept = [u.name for u in engine.params.units if u.gathered]
        engine.step()
    tokens = global_batch(2, world, 1)[0, rank]
    out = {"kept_before_step": kept, "gathered_after_step": [u.name for u in engine.params.units if u.gathered]}
    engine.params.peak_live_units = 0
    loss = lm_loss(engine(tokens), tokens)
    engine.backward(loss)
    out.update(loss=loss.item(), peak_live_units=engine.params.peak_live_units)
    engine.close()
    return out


@pytest.mark.parametrize("evaluate", ["grad", "early_exit", "early_exit_grad"])
def test_units_kept_by_a_forward_without_backward_are_released_by_step(evaluate):
    """Else the next forward would compute with their values from before the step (and, on a
    GPU, a prefetch still in flight would read the shards the optimizer writes); and the next
    backward holds no more units than the bound (a forward with gradients that stopped early
    leaves pending-input counts that only its own backward would clear)."""
    max_live = 2 if evaluate == "early_exit_grad" else 3  # 2: the bound a stale count would break
    evaluated, plain = (spawn(_loss_after_a_forward_without_backward, 2, flag, max_live, timeout=60)
                        for flag in (evaluate, None))
    for e, p in zip(evaluated, plain):
        assert not p["kept_before_step"]
        if evaluate == "early_exit":  # the root and the first block ran; the second was prefetched
            assert "<root>" in e["kept_before_step"] and len(e["kept_before_step"]) >= 2
        elif evaluate == "grad":
            assert e["kept_before_step"] == ["<root>"]
        assert e["gathered_after_step"] == []
        assert e["loss"] == p["loss"]
        assert e["peak_live_units"] == p["peak_live_units"] <= max_live


@pytest.mark.parametrize("world", [2, 3, 4])
def test_model_state_bytes_are_16psi_over_n(world):
    results = spawn(_stats, world, 1, "fp16", timeout=60)  # the paper's P = G = 2
    for r in results:
        memory = {"measured": r["stats"]["memory"], "predicted": predicted_for_engine(r["stats"])}
        padded, psi = r["stats"]["padded_psi"], r["stats"]["psi"]
        assert memory["predicted"]["total"] == pytest.approx(16 * psi / world)
        assert memory["measured"]["params"] == 2 * padded // world
        assert memory["measured"]["grads"] == 2 * r["reduced"] // world  # none for the frozen wpe
        # One rank may own all the padding and the frozen embedding (no master, no Adam state).
        assert abs(memory["measured"]["total"] - memory["predicted"]["total"]) <= 16 * (padded - psi) + r["scalars"]
        # Peak of gathered parameters: root + two layers here (a 2-layer model: everything).
        assert 0 < memory["measured"]["peak_gathered_params"] <= 2 * padded
    optimizer_bytes = sum(r["stats"]["memory"]["optimizer_states"] - r["scalars"] for r in results)
    # masters + Adam states: each element once, alignment gaps inside a group's master included
    masters = sum(r["master_elements"] for r in results)
    assert optimizer_bytes == 12 * masters
    assert results[0]["stats"]["psi"] <= masters <= results[0]["stats"]["psi"] + results[0]["padding_bound"]


def _name_seeded_init(model: torch.nn.Module):
    """Deterministic init of a module's own parameters from their qualified names, so a model
    built normally and one built unit by unit from the meta device get identical weights."""
    module_names = {id(m): n for n, m in model.named_modules()}

    def init(module: torch.nn.Module) -> None:
        for name, p in module.named_parameters(recurse=False):
            g = torch.Generator().manual_seed(zlib.crc32(f"{module_names[id(module)]}.{name}".encode()))
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02 if p.dim() > 1 else torch.zeros(p.shape))
    return init


def _meta_run(world_steps: int) -> dict:
    with torch.device("meta"):
        model = TinyGPT(MODEL)
    init = _name_seeded_init(model)
    engine = zero_impl.initialize(model, zero_impl.ZeroConfig(stage=3, precision="fp64", clip_grad_norm=CLIP), adamw,
                                  param_init_fn=init)
    rank = dist.get_rank()
    for step in range(world_steps):
        tokens = global_batch(step, dist.get_world_size(), 1)[0, rank]
        engine.backward(lm_loss(engine(tokens), tokens))
        engine.step()
    return {"params": engine.full_parameters(), "meta_left": [n for n, p in model.named_parameters() if p.is_meta]}


def test_meta_device_model_builds_unit_by_unit():
    torch.manual_seed(0)
    reference = TinyGPT(MODEL).double()
    init = _name_seeded_init(reference)
    for m in reference.modules():
        init(m)
    opt = adamw(reference.parameters())
    for step in range(4):
        tokens = global_batch(step, 2, 1).reshape(-1, MODEL.seq_len)
        opt.zero_grad()
        lm_loss(reference(tokens), tokens).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        opt.step()
    results = spawn(_meta_run, 2, 4, timeout=60)
    assert results[0]["meta_left"] == []
    expected = {n: p.detach() for n, p in reference.named_parameters()}
    assert max_abs_diff(results[0]["params"], expected) < FP64_TOL


def test_meta_device_model_rejected_below_stage3():
    with torch.device("meta"):
        model = TinyGPT(MODEL)
    with pytest.raises(ValueError, match="meta device needs stage 3"):
        zero_impl.initialize(model, zero_impl.ZeroConfig(stage=2), adamw)


def _diverge() -> None:
    comm = Communicator(None, CommLedger(), "dp", check_order=True)
    x = torch.zeros(8)
    if dist.get_rank() == 0:
        comm.all_gather(x, x[:4].clone(), purpose="params")
    else:
        comm.reduce_scatter(x[4:], x.clone(), purpose="grads")


def test_diverging_collectives_fail_with_a_clear_message():
    with pytest.raises(RankFailed, match=r"collective order diverged on the dp group: "
                                         r"rank 0: call #1 all_gather/params of 8 torch.float32 elements; "
                                         r"rank 1: call #1 reduce_scatter/grads of 8 torch.float32 elements"):
        spawn(_diverge, 2, timeout=60)


def test_unknown_unit_class_is_rejected():
    with pytest.raises(ValueError, match=r"stage3_unit_classes \['Nope'\]: no such submodule in TinyGPT"):
        zero_impl.initialize(make_model(), zero_impl.ZeroConfig(stage=3, stage3_unit_classes=("Nope",)), adamw)


class _Plain(torch.nn.Module):
    """A ModuleList with a parameterless member, and a root that owns no parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5)]).double()

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _plain_run(stage: int) -> dict:
    model = _Plain()
    engine = zero_impl.initialize(model, zero_impl.ZeroConfig(stage=stage, precision="fp64"), adamw)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(dist.get_rank()), dtype=torch.float64)
    for _ in range(3):
        engine.backward(engine(x).square().mean())
        engine.step()
    return engine.full_parameters()


def test_units_without_parameters_are_skipped():
    stage3, stage0 = spawn(_plain_run, 2, 3, timeout=60)[0], spawn(_plain_run, 2, 0, timeout=60)[0]
    # float64: 3 steps; a gradient sums 4 samples on each of 2 ranks through widths 7 and 5
    assert max_abs_diff(stage3, stage0) < fp64_tolerance(steps=3, lr=LR, tokens=8, widest_sums=12)


def test_model_without_module_list_warns_and_still_trains():
    with pytest.warns(UserWarning, match="no ModuleList in Linear"):
        engine = zero_impl.initialize(torch.nn.Linear(4, 3), zero_impl.ZeroConfig(stage=3), adamw)
    engine.backward(engine(torch.ones(2, 4)).sum())
    assert engine.step()


def _meta_split_module(threshold: int) -> list[float]:
    """Linear layers built on the meta device whose bias is under the persistence threshold
    and whose weight is not: each module's parameters fall in two units."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)]))
    model.forward = lambda x: model[0][1](torch.relu(model[0][0](x)))
    torch.manual_seed(0)
    engine = zero_impl.initialize(model, zero_impl.ZeroConfig(stage=3, stage3_param_persistence_threshold=threshold),
                                  adamw)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    losses = []
    for _ in range(3):
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_meta_module_split_across_units_initializes_each_parameter_once():
    """Initializing the bias's unit must not write into the weight's released unit (it did: a
    segfault), whatever reset_parameters() touches."""
    for losses in spawn(_meta_split_module, 2, 16, timeout=60):
        assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
