"""What a GPU would be charged for a step, counted on the CPU (experiments/proxy_counts.py).

- No host sync in a whole training step (forward, backward, step) at any stage and precision,
  with clipping and accumulation, with the optimizer the suite uses on CUDA (torch's fused
  AdamW, which skips an overflowed step on the device): on a GPU one sync stalls every later
  launch until the queue drains.
- The step's kernel count does not grow with the bucket count: 2 buckets or 32, the same few
  foreach kernels over all masters (collectives are counted apart: one per bucket).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zero_impl
from experiments.launch import spawn
from experiments.models.tiny_gpt import TinyGPT, TinyGPTConfig, lm_loss
from experiments.proxy_counts import OpCounter
from helpers import CLIP, global_batch, make_model, param_groups

SHAPE = TinyGPTConfig(vocab_size=67, seq_len=16, hidden=16, layers=6, heads=2)  # 75 parameters tensors


def fused_adamw(groups) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=1e-2, fused=True)


def _count_one_step(model: torch.nn.Module, config: zero_impl.ZeroConfig, accum: int, groups: bool = True) -> dict:
    """Counts of one full step (accum micro-batches and step()) after a warm-up step; `groups`:
    two param groups (decay, no decay), else one."""
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = zero_impl.initialize(model, config, optimizer=fused_adamw,
                                  param_groups=param_groups(model) if groups else None)
    counter = OpCounter()
    for step in range(2):
        batch = global_batch(step, world, accum)
        for k in range(accum):
            tokens = batch[k, rank].remainder(model.wte.num_embeddings)
            with counter if step else _nothing():
                counter.phase = "forward"
                loss = lm_loss(engine(tokens), tokens)
                counter.phase = "backward"
                engine.backward(loss)
                counter.phase = "step"
                engine.step()
                counter.phase = "other"
    counts = counter.phases()
    counts["buckets"] = len(engine.params.buckets)
    counts["applied"] = bool(engine.stats()["skipped_steps"] == 0)
    engine.close()
    return counts


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _host_sync_cases() -> dict:
    out = {}
    for stage in (0, 1, 2, 3):
        for precision in ("fp32", "bf16", "fp16"):
            config = zero_impl.ZeroConfig(stage=stage, precision=precision, clip_grad_norm=CLIP, grad_accum_steps=2,
                                          reduce_bucket_size=500)
            out[(stage, precision)] = _count_one_step(make_model(), config, accum=2)
    return out


@pytest.mark.slow
def test_no_host_sync_in_a_step():
    results = spawn(_host_sync_cases, 2, timeout=300)
    for (stage, precision), counts in results[0].items():
        for phase in ("forward", "backward", "step"):
            assert counts[phase]["host_syncs"] == 0, (stage, precision, phase)
        assert counts["step"]["kernels"] > 0 and counts["applied"]  # the step ran, and applied
    for case, counts in results[0].items():  # every rank: the same collectives (its kernels may differ:
        for phase in ("forward", "backward", "step"):  # a rank's shard may hold one param group only)
            theirs = results[1][case][phase]
            assert (counts[phase]["collectives"], counts[phase]["collective_elements"]) == \
                (theirs["collectives"], theirs["collective_elements"]), (case, phase)


def _bucket_cases() -> dict:
    out = {}
    for stage in (0, 1, 2):
        for bucket_size in (12_000, 60):
            torch.manual_seed(0)
            config = zero_impl.ZeroConfig(stage=stage, precision="bf16", clip_grad_norm=CLIP,
                                          reduce_bucket_size=bucket_size)
            # one param group: the optimizer's kernels are per group a rank's shard touches
            out[(stage, bucket_size)] = _count_one_step(TinyGPT(SHAPE), config, accum=1, groups=False)
    return out


def test_step_kernels_do_not_grow_with_buckets():
    results = spawn(_bucket_cases, 2, timeout=300)[0]
    for stage in (0, 1, 2):
        few, many = results[(stage, 12_000)], results[(stage, 60)]
        assert few["buckets"] <= 3 and many["buckets"] >= 32, (few["buckets"], many["buckets"])
        assert abs(many["step"]["kernels"] - few["step"]["kernels"]) <= 0.1 * few["step"]["kernels"], \
            (stage, few["step"]["kernels"], many["step"]["kernels"])
        # the same traffic whatever the bucket count (padding aside)
        ratio = many["step"]["collective_elements"] / max(1, few["step"]["collective_elements"])
        assert 0.9 <= ratio <= 1.1 or stage == 0
