"""Shared pieces of the engine tests: the test model, its data, and the single-process reference.

The reference is what ZeRO must equal: plain torch.optim.AdamW on the global batch (every
rank's micro-batches of a step concatenated), clipped with torch.nn.utils.clip_grad_norm_.
"""
from __future__ import annotations

import gc
import math

import torch
import torch.distributed as dist

import zero_impl
from experiments.models.tiny_gpt import TinyGPT, TinyGPTConfig, lm_loss, synthetic_tokens
from zero_impl.layout import BUCKET_ALIGN, PARAM_ALIGN

# Sizes chosen so that most tensors are not divisible by 3 or 4 (670, 110, 330, ...).
MODEL = TinyGPTConfig(vocab_size=67, seq_len=16, hidden=10, layers=2, heads=2)
LR = 1e-2
CLIP = 0.28  # between the gradient norms of the run (0.26-0.32): some steps clip, some not
MICRO_BATCH = 2


def make_model(tie_blocks: bool = False, dtype: torch.dtype = torch.float32) -> TinyGPT:
    """Same initial weights in every process; position embeddings frozen (a frozen parameter).
    `tie_blocks`: block 1's MLP input weight is block 0's (one Parameter in two stage-3 units).
    `dtype`: the weights are drawn in fp32 and then converted, so every dtype starts alike."""
    torch.manual_seed(0)
    model = TinyGPT(MODEL).to(dtype)
    model.wpe.weight.requires_grad_(False)
    if tie_blocks:
        model.blocks[1].fc.weight = model.blocks[0].fc.weight
    return model


def param_groups(model: torch.nn.Module) -> list[dict]:
    """Two groups as in GPT training: weight decay on matrices, none on biases and norms."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in trainable if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0}]


def adamw(groups) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR)


def global_batch(step: int, world: int, accum: int) -> torch.Tensor:
    """[accum, world, micro_batch, seq]: micro-batch k of rank r is batch[k, r]."""
    tokens = synthetic_tokens(accum * world * MICRO_BATCH, MODEL.seq_len, MODEL.vocab_size, seed=step)
    return tokens.view(accum, world, MICRO_BATCH, MODEL.seq_len)


def reference_run(steps: int, world: int, accum: int, clip: float = CLIP, precision: str = "fp32",
                  tie_blocks: bool = False):
    """Single-process AdamW on each step's global batch: (named parameters, losses, grad norms).

    With precision "bf16"/"fp16" it is the textbook mixed-precision loop, written independently
    of zero_impl: a low-precision model, fp32 master weights in the optimizer, fp16 loss scaled.
    With "fp64" everything is float64.
    """
    model = make_model(tie_blocks, dtype=torch.float64 if precision == "fp64" else torch.float32)
    names = [n for n, _ in model.named_parameters()]
    masters = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in model.named_parameters()}
    model.to(zero_impl.config.DTYPES[precision])
    for n, p in model.named_parameters():
        if not p.requires_grad:  # a frozen parameter only exists in model precision
            masters[n] = p.detach().to(masters[n].dtype)
    opt = adamw(param_groups(_MasterView(model, masters)))
    scale = 1024.0 if precision == "fp16" else 1.0
    losses, norms = [], []
    for step in range(steps):
        tokens = global_batch(step, world, accum).reshape(-1, MODEL.seq_len)
        loss = lm_loss(model(tokens), tokens)
        model.zero_grad()
        (loss * scale).backward()
        for n, p in model.named_parameters():
            if p.requires_grad:
                masters[n].grad = p.grad.to(masters[n].dtype) / scale
        trainable = [masters[n] for n in names if masters[n].requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(trainable, clip if clip > 0 else float("inf"))
        opt.step()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(masters[n])
        losses.append(loss.item())
        norms.append(norm.item())
    return masters, losses, norms


class _MasterView(torch.nn.Module):
    """Presents the fp32 masters with the model's parameter order, for param_groups()."""

    def __init__(self, model: torch.nn.Module, masters: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._list = [masters[n] for n, _ in model.named_parameters()]

    def parameters(self, recurse: bool = True):
        return iter(self._list)


def zero_run(steps: int, accum: int, tie_blocks: bool = False, **config) -> dict:
    """Runs inside a rank: the same training through the engine. Returns what the tests compare."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model(tie_blocks, dtype=torch.float64 if config.get("precision") == "fp64" else torch.float32)
    engine = zero_impl.initialize(model, zero_impl.ZeroConfig(grad_accum_steps=accum, **config),
                                  optimizer=adamw, param_groups=param_groups(model))
    losses, applied, norms = [], [], []
    for step in range(steps):
        batch = global_batch(step, world, accum)
        total = torch.zeros((), dtype=torch.float64)
        for k in range(accum):
            tokens = batch[k, rank]
            loss = lm_loss(engine(tokens), tokens)
            engine.backward(loss)
            total += loss.detach() / accum
            applied.append(engine.step())
        dist.all_reduce(total)
        losses.append(total.item() / world)
        norms.append(engine.stats()["grad_norm"])
    return {"params": engine.full_parameters(), "losses": losses, "applied": applied, "norms": norms,
            "stats": engine.stats()}


def fp64_tolerance(*, steps: int, lr: float, tokens: int, widest_sums: int, adam_eps: float = 1e-8) -> float:
    """Bound on |engine - reference| after `steps` float64 Adam steps that differ only in the
    order of their sums, the reason parity is checked in float64 on any CPU.

    Engine and reference add the same terms in different orders: per rank and then over ranks,
    and kernels block their sums differently on AVX2 / AVX-512 and at other thread counts. A
    gradient element sums `tokens` per-token terms, each a chain of products whose inner sums
    run over at most `widest_sums` elements in all (hidden, MLP and vocabulary widths along the
    chain); to first order a reordering moves it by at most (tokens + widest_sums)·u·Σ|terms|,
    u = 2^-53, with Σ|terms| ≤ 1 for these models (the loss is a mean over tokens of O(1)
    terms). Adam maps a gradient change δ to an update change of at most lr·δ/ε (its largest
    slope, at a gradient of zero), once per step. Measured differences are ~1e-15: the bound is
    loose, yet it stays orders of magnitude below any algorithmic error (a lost micro-batch, a
    wrong scale or clip moves parameters by ~lr per step), and in float32 the same bound would
    exceed lr itself: there no element-wise parity can be promised.
    """
    return steps * lr * (tokens + widest_sums) * 2.0 ** -53 / adam_eps


# The tiny model's parity bound: at most 10 steps; tokens per gradient: 2 accumulated
# micro-batches of MICRO_BATCH sequences on each of up to 4 ranks; widest sums along a chain:
# every layer's MLP width, then the vocabulary.
FP64_TOL = fp64_tolerance(steps=10, lr=LR, tokens=2 * 4 * MICRO_BATCH * MODEL.seq_len,
                          widest_sums=MODEL.layers * 4 * MODEL.hidden + MODEL.vocab_size)


def padding_bound(buckets) -> int:
    """Most padding elements the layout may add (layout.py): before each parameter, up to
    PARAM_ALIGN - 1 to align its start; after each bucket, up to lcm(N, BUCKET_ALIGN) - 1."""
    return sum(len(b.slots) * (PARAM_ALIGN - 1) + math.lcm(b.shard_count, BUCKET_ALIGN) - 1 for b in buckets)


def gather_tp(model: torch.nn.Module, values: dict[str, torch.Tensor], tp_group) -> dict[str, torch.Tensor]:
    """Full TP=1-shaped tensors: megatron's TP-sharded parameters (`values` keyed like
    model.named_parameters()) concatenated over the TP group along their partition dim."""
    tp = dist.get_world_size(tp_group)
    out = {}
    for name, p in model.named_parameters():
        t = values[name]
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
            t = torch.cat(parts, dim=p.partition_dim)
        out[name] = t
    return out


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n].double() - b[n].double()).abs().max().item() for n in a)


@torch.no_grad()
def relative_update_error(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """|params - reference| / |reference - initial| over all parameters (L2): how far a run's
    total update is from the reference's, relative to the update's size."""
    initial = dict(make_model().named_parameters())
    num = sum(((params[n].float() - reference[n]) ** 2).sum() for n in reference)
    den = sum(((reference[n] - initial[n].detach()) ** 2).sum() for n in reference)
    return float((num / den).sqrt())


def live_storages() -> dict[int, int]:
    """data_ptr -> nbytes of the storage of every tensor the garbage collector can reach.

    A forked rank inherits every object of the pytest process, so scans compare against a
    snapshot taken at the start of the rank's own work."""
    found = {}
    for obj in gc.get_objects():
        if torch.is_tensor(obj):
            storage = obj.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return found
