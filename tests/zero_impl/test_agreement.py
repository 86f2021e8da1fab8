"""Ranks that agree before they train (zero_impl/agreement.py, issue 37 item 3).

initialize() broadcasts every parameter and buffer from the DP group's first rank, so ranks
that built different initial models (seeded by rank) train the first rank's model: checked
against the single-process reference from that model at every stage, in fp64. Ranks whose
ZeroConfig or parameters differ are refused in one line naming the key and both values,
instead of hanging in a collective. A parameter one rank uses and another skips (a
data-dependent branch) trains like one process on the global batch, at stage 3 too.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_impl
from helpers import CLIP, FP64_TOL, LR, MODEL, adamw, global_batch, max_abs_diff, param_groups, reference_run
from experiments.launch import RankFailed, spawn
from experiments.models.tiny_gpt import TinyGPT, TinyGPTConfig, lm_loss

STEPS, ACCUM = 3, 2


def _seeded_by_rank(stage: int) -> dict:
    """Each rank draws its own model (rank 0's is the helpers' make_model); 3 steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = TinyGPT(MODEL).to(torch.float64)
    model.wpe.weight.requires_grad_(False)  # a frozen parameter is broadcast too
    engine = zero_impl.initialize(model, zero_impl.ZeroConfig(stage=stage, precision="fp64", grad_accum_steps=ACCUM,
                                                              clip_grad_norm=CLIP, reduce_bucket_size=500),
                                  optimizer=adamw, param_groups=param_groups(model))
    for step in range(STEPS):
        batch = global_batch(step, world, ACCUM)
        for k in range(ACCUM):
            engine.backward(lm_loss(engine(batch[k, rank]), batch[k, rank]))
            engine.step()
    init = engine.stats()["comm"]["total"]["by_purpose"].get("init", {"elements": 0})
    return {"params": engine.full_parameters(), "init": init}


@pytest.mark.numerical
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ranks_seeded_apart_train_the_first_ranks_model(stage):
    reference, _, _ = reference_run(STEPS, 2, ACCUM, precision="fp64")
    results = spawn(_seeded_by_rank, 2, stage, timeout=120)
    for r in results:
        assert max_abs_diff(r["params"], reference) < FP64_TOL
    psi = sum(p.numel() for p in TinyGPT(MODEL).parameters())
    assert results[0]["init"]["elements"] >= psi  # broadcast once, at initialization


class _Plain(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width), nn.Linear(width, width)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _Ordered(nn.Module):
    """The same two parameters, registered in the order `first` says."""

    def __init__(self, first: str) -> None:
        super().__init__()
        for name in (first, "b" if first == "a" else "a"):
            self.register_parameter(name, nn.Parameter(torch.zeros(4)))


def _disagreeing(what: str) -> None:
    rank = dist.get_rank()
    model = _Plain(width=12 if what == "shape" and rank == 1 else 8)
    if what == "buffer":  # broadcast like a parameter: a shape that differs would hang it
        model.layers[0].register_buffer("count", torch.zeros(3 if rank == 1 else 2))
    if what == "order":
        model = _Ordered("b" if rank == 1 else "a")
    config = {"stage": 2, "reduce_bucket_size": 600 if what == "config" and rank == 1 else 500}
    zero_impl.initialize(model, zero_impl.ZeroConfig(**config), optimizer=adamw)


@pytest.mark.parametrize("what,message", [
    ("config", r"ranks disagree on ZeroConfig.reduce_bucket_size: 500 on DP rank 0, 600 on DP rank 1"),
    ("shape", r"ranks disagree on the model: parameter 'layers.0.weight' is \(8, 8\) float32 on DP rank 0, "
              r"\(12, 12\) float32 on DP rank 1"),
    ("buffer", r"ranks disagree on the model: buffer 'layers.0.count' is \(2,\) float32 on DP rank 0, \(3,\) float32 "
               r"on DP rank 1"),
    ("order", r"ranks disagree on the model: registered in another order: number 0 is parameter 'a' on DP rank 0, "
              r"parameter 'b' on DP rank 1"),
])
def test_ranks_that_disagree_are_refused_in_one_line(what, message):
    with pytest.raises(RankFailed, match=message):  # raised on every rank, not a hang
        spawn(_disagreeing, 2, what, timeout=30)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main, self.extra = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, take: bool) -> torch.Tensor:
        return self.main(x) + self.extra(x) if take else self.main(x)


class _Branchy(nn.Module):
    """Two stage-3 units; each runs `extra` only when its batch says so (data-dependent)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layers = nn.ModuleList([_Layer(), _Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        take = bool(x[0, 0] > 0)
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x, take)
        return x


def _inputs(takers: tuple[int, ...], world: int) -> list[torch.Tensor]:
    """Rank r's batch: its own values, positive (the branch taken) where r is in `takers`."""
    return [torch.randn(4, 8, generator=torch.Generator().manual_seed(r), dtype=torch.float64).abs()
            * (1 if r in takers else -1) for r in range(world)]


def _branch(stage: int, takers: tuple[int, ...]) -> dict:
    torch.manual_seed(0)
    engine = zero_impl.initialize(_Branchy().double(), zero_impl.ZeroConfig(stage=stage, precision="fp64",
                                                                          check_collective_order=True),
                                  optimizer=adamw)  # the ranks' collectives in one order, or a raise
    x = _inputs(takers, dist.get_world_size())[dist.get_rank()]
    for _ in range(STEPS):
        engine.backward(engine(x).square().mean())
        engine.step()
    return engine.full_parameters()


def _branch_reference(takers: tuple[int, ...], world: int) -> tuple[dict, dict]:
    """(initial, final) parameters of one process running AdamW on the global batch: each rank's
    batch through the model as that rank's forward took it, losses averaged; a parameter no
    batch used gets a zero gradient (the engine's, and DDP's, semantics: weight decay only)."""
    torch.manual_seed(0)
    model = _Branchy().double()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = adamw(model.parameters())
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        sum(model(x).square().mean() for x in _inputs(takers, world)).div(world).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    return initial, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.numerical
@pytest.mark.parametrize("stage", [0, 3])
def test_branch_only_one_rank_takes_trains_like_one_process(stage):
    """At stage 3 the rank that skipped the branch reports its parameters with zero gradients
    where the unit's backward ends: the reduce-scatter is issued at the same point on every rank
    (before, the ranks' collectives parted ways: a hang on NCCL), and the gradient is the
    average of one rank's with zeros."""
    _, reference = _branch_reference((0,), 2)
    results = spawn(_branch, 2, stage, (0,), timeout=60)
    for r in results:
        assert max_abs_diff(r, reference) < FP64_TOL


@pytest.mark.numerical
def test_stage3_parameter_no_rank_uses_changes_by_weight_decay_only():
    initial, reference = _branch_reference((), 2)
    results = spawn(_branch, 2, 3, (), timeout=60)
    for r in results:
        assert max_abs_diff(r, reference) < FP64_TOL
        for name in ("layers.0.extra.weight", "layers.1.extra.bias"):  # AdamW's default decay, 0.01
            assert torch.allclose(r[name], initial[name] * (1 - LR * 0.01) ** STEPS, rtol=0, atol=1e-15)


class _RootBranchy(nn.Module):
    """The branch outside the layers: its parameters are the root unit's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.extra = nn.Linear(8, 8), nn.Linear(8, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        take = bool(x[0, 0] > 0)
        x = self.embed(x)
        x = x + self.extra(x) if take else x
        for layer in self.layers:
            x = layer(x)
        return x


def _root_branch(stage: int) -> dict:
    torch.manual_seed(0)
    engine = zero_impl.initialize(_RootBranchy(), zero_impl.ZeroConfig(stage=stage), optimizer=adamw)
    x = torch.randn(4, 8).abs() * (1 if dist.get_rank() == 0 else -1)
    for _ in range(3):
        engine.backward(engine(x).square().mean())
        engine.step()
    return engine.full_parameters()


def test_stage3_branch_in_the_root_unit_trains_as_stage_0():
    """The root is reduced last, at the end of backward on every rank: a branch there keeps the
    ranks' collectives in one order, and its gradient is zero where it was skipped."""
    stage0, stage3 = spawn(_root_branch, 2, 0, timeout=60), spawn(_root_branch, 2, 3, timeout=60)
    assert max_abs_diff(stage0[0], stage3[0]) == 0.0 and max_abs_diff(stage3[0], stage3[1]) == 0.0
