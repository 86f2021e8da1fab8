"""Stage 3's schedule with frozen parameters and with activation recomputation.

- Frozen parameters: a unit is released when its backward is over (its trainable parameters
  have their gradients and its inputs theirs), so the live-unit bound holds with frozen
  weights or even a unit with nothing to train; frozen parameters are never reduce-scattered,
  and training with them equals float64 AdamW on the trainable ones.
- Recomputation: megatron-core's checkpoint (and torch's reentrant one) runs the forward under
  no_grad, so no hook on a layer's outputs starts its backward; the recomputed forward inside
  backward does, and prefetches the next layer in backward order. At most one gather per pass
  (forward, backward) is waited on demand: the root's, the first unit of each pass.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import zero_impl
from helpers import CLIP, LR, MICRO_BATCH, adamw, fp64_tolerance, global_batch, lm_loss, max_abs_diff, padding_bound
from experiments.launch import spawn
from experiments.models.tiny_gpt import TinyGPT, TinyGPTConfig

pytestmark = pytest.mark.numerical  # make test-matrix reruns these under every CPU setting

DEEP = TinyGPTConfig(vocab_size=67, seq_len=16, hidden=10, layers=8, heads=2)
WIDE = TinyGPTConfig(vocab_size=67, seq_len=16, hidden=32, layers=3, heads=2)
SMALL = TinyGPTConfig(vocab_size=67, seq_len=16, hidden=10, layers=3, heads=2)


class RecomputedGPT(TinyGPT):
    """TinyGPT with one activation checkpoint per block: torch's reentrant checkpoint (forward
    under no_grad, recomputed and backpropagated inside backward, as megatron-core's) or the
    non-reentrant one (forward with grad, recomputed when backward unpacks a saved tensor)."""

    def __init__(self, cfg: TinyGPTConfig, recompute: str | None) -> None:
        super().__init__(cfg)
        self.recompute = recompute

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.recompute is None:
            return super().forward(idx)
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.recompute == "reentrant")
        return F.linear(self.ln_f(x), self.wte.weight)


def build(cfg: TinyGPTConfig, freeze: str, recompute: str | None = None, dtype=torch.float32) -> TinyGPT:
    """Same weights in every process. freeze: "lora" (every Linear weight of the blocks and both
    embeddings frozen: biases and norms train, the first block's input needs no gradient),
    "layer" (block 1 frozen whole: a unit with nothing to train), "linear" (block 1's MLP input
    layer frozen, weight and bias: a unit with both kinds), or "none"."""
    torch.manual_seed(0)
    model = RecomputedGPT(cfg, recompute).to(dtype)
    if freeze == "lora":
        model.wte.weight.requires_grad_(False)
        model.wpe.weight.requires_grad_(False)
        for block in model.blocks:
            for linear in (block.qkv, block.attn_out, block.fc, block.proj):
                linear.weight.requires_grad_(False)
    elif freeze == "layer":
        model.blocks[1].requires_grad_(False)
    elif freeze == "linear":
        model.blocks[1].fc.requires_grad_(False)
    return model


def _tokens(step: int) -> torch.Tensor:
    return global_batch(step, dist.get_world_size(), 1)[0, dist.get_rank()]


# -- (a) the live-unit bound with frozen parameters --------------------------------------------
def _live_units(freeze: str, recompute: str | None) -> dict:
    model = build(DEEP, freeze, recompute)
    engine = zero_impl.initialize(model, zero_impl.ZeroConfig(stage=3, stage3_max_live_units=3), adamw)
    seen = {"forward": [], "backward": []}

    def observe(module, args, output=None) -> None:
        seen["backward" if engine.params.in_backward else "forward"].append(engine.params.live_units)
        if output is not None and output.requires_grad:  # the block's backward begins
            output.register_hook(lambda grad: seen["backward"].append(engine.params.live_units))

    for block in model.blocks:  # registered after the engine's hooks, so they see the gathered state
        block.register_forward_pre_hook(observe)
        block.register_forward_hook(observe)
    for step in range(2):
        tokens = _tokens(step)
        engine.backward(lm_loss(engine(tokens), tokens))
        engine.step()
    return {**seen, "peak": engine.params.peak_live_units, "after": engine.params.live_units}


@pytest.mark.parametrize("freeze,recompute", [("lora", None), ("layer", None), ("layer", "reentrant"),
                                              ("lora", "non_reentrant")])
def test_frozen_parameters_keep_the_live_bound(freeze, recompute):
    """Before: a unit with a frozen parameter stayed gathered to the end of backward (LoRA-like:
    all 9 units at once)."""
    for r in spawn(_live_units, 2, freeze, recompute, timeout=60):
        assert r["backward"], "no observation inside backward"
        assert max(r["forward"]) <= 3 and max(r["backward"]) <= 3
        assert r["peak"] <= 3 and r["after"] == 0


# -- (b) no gradient traffic for frozen parameters ---------------------------------------------
def _traffic() -> dict:
    model = build(WIDE, "linear")
    engine = zero_impl.initialize(model, zero_impl.ZeroConfig(stage=3), adamw)
    for step in range(2):
        tokens = _tokens(step)
        engine.backward(lm_loss(engine(tokens), tokens))
        engine.step()
    stats = engine.stats()
    reduced = [b for b in engine.params.buckets if any(s.param.requires_grad for s in b.slots)]
    return {"stats": stats, "frozen": sum(p.numel() for p in model.parameters() if not p.requires_grad),
            "reduced_frozen_slots": [s.name for b in reduced for s in b.slots if not s.param.requires_grad],
            "reduced_padding": sum(b.numel - sum(s.numel for s in b.slots) for b in reduced),
            "units": len(engine.params.units)}


def test_frozen_parameters_cost_no_gradient_traffic():
    """A frozen Linear inside a trained block (4224 of 41k elements): before, its zero gradient
    was reduce-scattered with the rest of its unit (11% more than the trainable parameters)."""
    r = spawn(_traffic, 2, timeout=60)[0]
    psi, padded = r["stats"]["psi"], r["stats"]["padded_psi"]
    grads = r["stats"]["comm"]["last_step"]["by_purpose"]["grads"]["elements"]
    assert r["reduced_frozen_slots"] == []
    assert grads == psi + r["reduced_padding"]  # the trainable parameters and their buckets' padding
    assert grads < psi + r["frozen"]
    kept_root = r["stats"]["stage3"]["root_kept_elements"]  # the root's second gather: saved (stage3_keep_root)
    assert r["stats"]["comm"]["last_step"]["by_purpose"]["params"]["elements"] == 2 * padded - kept_root  # frozen: gathered
    assert r["stats"]["memory"]["grads"] == 4 * grads // 2  # fp32 gradient shards of the trainable buckets only


# -- (c) training with frozen parameters equals float64 AdamW ----------------------------------
STEPS = 4


def _reference(freeze: str) -> dict:
    model = build(SMALL, freeze, dtype=torch.float64)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = adamw(trainable)
    for step in range(STEPS):
        tokens = global_batch(step, 2, 1).reshape(-1, SMALL.seq_len)
        opt.zero_grad()
        lm_loss(model(tokens), tokens).backward()
        torch.nn.utils.clip_grad_norm_(trainable, CLIP)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def _zero(freeze: str, recompute: str | None) -> dict:
    model = build(SMALL, freeze, recompute, dtype=torch.float64)
    engine = zero_impl.initialize(model, zero_impl.ZeroConfig(stage=3, precision="fp64", clip_grad_norm=CLIP), adamw)
    for step in range(STEPS):
        tokens = global_batch(step, dist.get_world_size(), 1)[0, dist.get_rank()]
        engine.backward(lm_loss(engine(tokens), tokens))
        engine.step()
    return {"params": engine.full_parameters(), "masters": sum(m.tensor.numel() for m in engine.sharded_optimizer.masters),
            "padding_bound": padding_bound(engine.params.buckets),
            "psi": engine.psi}


@pytest.mark.parametrize("freeze,recompute", [("layer", None), ("linear", None), ("lora", None),
                                              ("layer", "reentrant"), ("lora", "non_reentrant")])
def test_frozen_parameters_train_like_adamw(freeze, recompute):
    expected = _reference(freeze)
    results = spawn(_zero, 2, freeze, recompute, timeout=60)
    # float64, 4 steps; a gradient sums 2 ranks x 2 sequences of 16 tokens through 3 MLPs and the vocabulary
    tol = fp64_tolerance(steps=STEPS, lr=LR, tokens=2 * MICRO_BATCH * SMALL.seq_len,
                         widest_sums=SMALL.layers * 4 * SMALL.hidden + SMALL.vocab_size)
    assert max_abs_diff(results[0]["params"], expected) < tol
    assert max_abs_diff(results[0]["params"], results[1]["params"]) == 0.0
    # masters: trainable elements only, plus the alignment gaps inside a group's master
    assert results[0]["psi"] <= sum(r["masters"] for r in results) <= results[0]["psi"] + results[0]["padding_bound"]


# -- (d) backward prefetch with activation recomputation ---------------------------------------
def _tiny_gathers(freeze: str, recompute: str | None) -> list[dict]:
    model = build(DEEP, freeze, recompute)
    engine = zero_impl.initialize(model, zero_impl.ZeroConfig(stage=3), adamw)
    out = []
    for step in range(2):
        tokens = _tokens(step)
        engine.backward(lm_loss(engine(tokens), tokens))
        engine.step()
        out.append(engine.stats()["stage3"])
    return out


def _megatron_gathers(recompute: bool) -> list[dict]:
    from experiments.models.megatron_gpt import build_gpt, initialize_parallel, lm_inputs
    from experiments.models.gpt_shape import GPTShape
    from experiments.models.tiny_gpt import synthetic_tokens
    dp_group, tp_group = initialize_parallel(1)
    shape = GPTShape(layers=6, hidden=16, heads=4, seq_len=8, vocab_size=256)
    model = build_gpt(shape, recompute=recompute)
    engine = zero_impl.initialize(model, zero_impl.ZeroConfig(stage=3), adamw, dp_group=dp_group, mp_group=tp_group)
    out = []
    for step in range(2):
        inputs = lm_inputs(synthetic_tokens(4, shape.seq_len + 1, shape.vocab_size, seed=step))
        labels = inputs.pop("labels")
        logits = engine(**inputs)
        engine.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)))
        engine.step()
        out.append(engine.stats()["stage3"])
    return out


def _assert_one_on_demand_per_pass(per_step: list[dict], layers: int) -> None:
    for stats in per_step:
        # on demand: the root in forward; in backward it is still gathered (stage3_keep_root)
        assert stats["forward"] == {"prefetched": layers, "on_demand": 1}, stats
        assert stats["backward"] == {"prefetched": layers, "on_demand": 0}, stats
        assert stats["peak_live_units"] <= 3
    assert per_step[-1]["total"] == {"prefetched": 4 * layers, "on_demand": 2}


@pytest.mark.parametrize("recompute", [False, True])
def test_megatron_backward_prefetch_with_recomputation(recompute):
    """Before, with recomputation: 2 of the 6 layers prefetched in backward (by the root), the
    other 4 and the root gathered on demand."""
    for per_step in spawn(_megatron_gathers, 2, recompute, timeout=120):
        _assert_one_on_demand_per_pass(per_step, layers=6)


@pytest.mark.parametrize("freeze,recompute", [("none", None), ("none", "reentrant"), ("none", "non_reentrant"),
                                              ("lora", None), ("layer", "reentrant")])
def test_tiny_backward_prefetch_with_recomputation(freeze, recompute):
    for per_step in spawn(_tiny_gathers, 2, freeze, recompute, timeout=60):
        _assert_one_on_demand_per_pass(per_step, layers=DEEP.layers)
