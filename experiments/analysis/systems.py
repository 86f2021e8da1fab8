"""How each training system reduces gradients and gathers parameters across data parallelism,
and what of it hides under backward: the collectives of one step, as they ran.

- megatron2019: Megatron-LM Sept 2019 (`model/distributed.py` @ a1d04b79): after backward, the
  fp16 gradients are flattened into one buffer, divided by the DP size, all-reduced in one
  blocking `dist.all_reduce`, `torch.cuda.synchronize()`, and copied back. Nothing overlaps.
- deepspeed2020: DeepSpeed's ZeRO-2 of the paper (`deepspeed_zero_optimizer.py` @ 97787881,
  2020-06-29): gradients are copied into a 5e8-element bucket and divided by the DP size; each
  full bucket issues one `dist.reduce` per partition it overlaps (to that partition's owner) and
  waits on them. overlap_comm defaults to False (the paper's configs do not set it): the reduces
  block the backward. After the step the fp16 parameters come back by `dist.all_gather` over
  shards of at most 5e8 elements in all. No stage 3 in 2020.
- pytorch_ddp: PyTorch DDP (Li et al., VLDB 2020): gradients copied into 25 MB buckets, each
  all-reduced as soon as it is full, during backward, and copied back; only the last bucket
  (the first layers' gradients, ready when backward ends) cannot hide.
- zero_repro: this suite's engine with its defaults (zero_impl/config.py): a reduce-scatter per
  reduce_bucket_size bucket (an all-reduce at stage 0), launched as it fills when overlap_comm
  (the default), the post-step all-gather at stages 1-2 in allgather_bucket_size buckets, and
  stage 3's per-layer gathers in forward and backward, prefetched under compute.

A record of the suite's engine brings its own counts (calls and bytes per purpose): those
replace the formula.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import ceil

DDP_BUCKET_BYTES = 25 * 2 ** 20   # torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=25)
DEEPSPEED_BUCKET = 500_000_000    # reduce_bucket_size = allgather_bucket_size = 5e8 (DeepSpeed 2020 defaults)


@dataclass(frozen=True)
class System:
    """One system's DP path: which collectives, whether they hide under backward, and the
    gradient passes around them."""

    name: str
    label: str
    stages: tuple[int, ...]       # ZeRO stages it runs
    overlap: bool                 # default: gradient collectives launched during backward
    grad_copy_passes: int         # read+write passes over the local gradients per reduction
    source: str


SYSTEMS = {
    "megatron2019": System("megatron2019", "Megatron-LM 2019", (0,), False, 3,
                           "Megatron-LM model/distributed.py @ a1d04b79: flatten, divide, one blocking all_reduce "
                           "after backward, copy back"),
    "deepspeed2020": System("deepspeed2020", "ZeRO-100B (DeepSpeed 2020)", (0, 1, 2), False, 2,
                            "DeepSpeed deepspeed_zero_optimizer.py @ 97787881: bucket copy and divide, one "
                            "dist.reduce per partition a 5e8 bucket overlaps; overlap_comm False; all_gather after "
                            "the step"),
    "pytorch_ddp": System("pytorch_ddp", "PyTorch DDP", (0,), True, 2,
                          "PyTorch DDP (Li et al., VLDB 2020): 25 MB buckets copied in and out, all-reduced "
                          "during backward"),
    "zero_repro": System("zero_repro", "zero_repro (this engine)", (0, 1, 2, 3), True, 1,
                         "zero_impl: reduce-scatter per bucket (all-reduce at stage 0), overlap_comm, post-step "
                         "all-gather, stage 3 prefetch"),
}


@dataclass(frozen=True)
class DpPlan:
    """A step's DP collectives: (kind, nbytes) calls per gradient reduction (once per step at
    stages 0-1, every micro-batch at 2-3), the post-step parameter gathers (stages 1-2), stage 3's
    gathers per micro-batch, and the gradient bytes the copies pass over per reduction."""

    grad_calls: tuple[tuple[str, float], ...]
    grad_reductions: int
    param_calls_after_step: tuple[tuple[str, float], ...]
    param_calls_per_micro_batch: tuple[tuple[str, float], ...]
    copy_bytes: float
    copy_kernels: int


def _chunks(total: float, size: float) -> list[float]:
    n = max(1, ceil(total / size))
    return [size] * (n - 1) + [total - size * (n - 1)]


def _reduces_per_partition(psi: float, dp: int, bucket: float, e: int) -> list[tuple[str, float]]:
    """DeepSpeed 2020: buckets of `bucket` elements over the flat gradient; a bucket issues one
    reduce per partition (psi / dp elements each) it overlaps."""
    part = ceil(psi / dp)
    calls, lo = [], 0.0
    for size in _chunks(psi, bucket):
        hi = lo + size
        first, last = int(lo // part), int((hi - 1) // part)
        for p in range(first, last + 1):
            calls.append(("reduce", (min(hi, (p + 1) * part) - max(lo, p * part)) * e))
        lo = hi
    return calls


def dp_plan(system: System, *, psi: float, dp: int, stage: int, layers: int, element_bytes: int,
            grad_accum: int, reduce_bucket: float, allgather_bucket: float) -> DpPlan:
    """The DP collectives of one step of `system` (module docstring); psi = the parameters one
    TP rank holds, buckets in elements (the zero_repro engine's; the others use their own)."""
    e = element_bytes
    reductions = grad_accum if stage >= 2 else 1
    copies = system.grad_copy_passes * 2 * psi * e
    after: list[tuple[str, float]] = []
    per_micro: list[tuple[str, float]] = []
    if dp <= 1:
        return DpPlan((), reductions, (), (), 0.0, 0)
    if system.name == "megatron2019":
        grads = [("all_reduce", psi * e)]
    elif system.name == "pytorch_ddp":
        grads = [("all_reduce", b) for b in _chunks(psi * e, DDP_BUCKET_BYTES)]
    elif system.name == "deepspeed2020":
        if stage == 0:
            grads = [("all_reduce", b * e) for b in _chunks(psi, DEEPSPEED_BUCKET)]
        else:
            grads = _reduces_per_partition(psi, dp, DEEPSPEED_BUCKET, e)
            part = ceil(psi / dp)
            shards = max(1, part * dp // DEEPSPEED_BUCKET)
            after = [("all_gather", dp * part / shards * e)] * shards
    else:
        grads = [("all_reduce" if stage == 0 else "reduce_scatter", b * e) for b in _chunks(psi, reduce_bucket)]
        if stage in (1, 2):
            after = [("all_gather", b * e) for b in _chunks(psi, allgather_bucket)]
        if stage == 3:
            per_micro = [("all_gather", psi / layers * e)] * (2 * layers)   # each layer: forward and backward
    return DpPlan(tuple(grads), reductions, tuple(after), tuple(per_micro), copies, system.grad_copy_passes)


def record_plan(system: System, by_purpose: dict, stage: int, grad_accum: int, element_bytes: int,
                psi: float, layers: int) -> DpPlan:
    """The plan a record's engine counts give (comm.by_purpose: calls and bytes per purpose, in
    the suite's convention: an all-reduce counted twice its size)."""
    grads, params = by_purpose.get("grads", {}), by_purpose.get("params", {})
    reductions = grad_accum if stage >= 2 else 1

    def calls(entry: dict, kind: str, per: int, halve: bool) -> tuple[tuple[str, float], ...]:
        n = int(entry.get("calls", 0))
        if n == 0 or not entry.get("bytes"):
            return ()
        each = entry["bytes"] / n / (2 if halve else 1)
        return ((kind, each),) * max(1, n // per)

    grad_calls = calls(grads, "all_reduce" if stage == 0 else "reduce_scatter", reductions, stage == 0)
    param_calls = calls(params, "all_gather", grad_accum if stage == 3 else 1, False)
    copies = system.grad_copy_passes * 2 * psi * element_bytes if grad_calls else 0.0
    return DpPlan(grad_calls, reductions, param_calls if stage in (1, 2) else (),
                  param_calls if stage == 3 else (), copies, system.grad_copy_passes if grad_calls else 0)
