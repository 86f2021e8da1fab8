"""Gradient hooks and bucket collectives for stages 0, 1 and 2.

A hook on each parameter's gradient accumulation copies the fresh gradient into its bucket and
frees it. A bucket is reduced as soon as all its parameters have reported, in bucket order, so
every rank issues the same collectives in the same order even when backward visits parameters
in a different order on different ranks.

- stage 0: a persistent full-size gradient buffer, all-reduced bucket by bucket on the last
  micro-step of an accumulation (the paper's baseline, like torch DDP with no_sync);
- stage 1: the same buffer, reduce-scattered in place on the last micro-step: each rank keeps
  the reduced values of its own slice, the view megatron-core's distributed optimizer uses;
- stage 2: no full-size buffer at all: a bucket-sized staging buffer lives only from the
  bucket's first gradient until its reduce-scatter into the persistent 1/N gradient shard
  completes, on every micro-step;
- stage 3: as stage 2, with one bucket per unit's trainable parameters and one, never
  reduced, per unit's frozen ones (stage3.py).
"""
from __future__ import annotations

from collections import deque
from contextlib import nullcontext
from typing import Callable

import torch

from .comm import Communicator
from .hooks import WeakHook
from .layout import Bucket, Slot

MAX_INFLIGHT_STAGING = 2  # stages 2-3: staging buffers of launched but unfinished reduce-scatters


def divide_factors(world: int, dtype: torch.dtype) -> tuple[float, float]:
    """(pre, post): gradients enter the bucket divided by `pre` and the reduced sum is divided
    by `post`, pre * post = world, so the reduction averages over the data-parallel ranks.

    The loss scale stays whole in backward (engine.backward), so the division is here, around
    the sum, as FSDP2 does (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py,
    `_get_gradient_divide_factors`). In fp16, a sum of `world` gradients at full scale could
    overflow (128 ranks at scale 65536), and dividing everything before the sum could flush
    small ones into subnormals: divide by ~sqrt(world) (a power of two, exact) on each side.
    fp32, bf16 and fp64 have fp32's range or more: no overflow, so everything after the sum.
    The collective itself sums (ReduceOp.SUM, which gloo supports; NCCL's AVG is NCCL-only).
    """
    if dtype != torch.float16:
        return 1.0, float(world)
    pre = 1
    while world % pre == 0 and world / pre > pre:
        pre *= 2
    return float(pre), world / pre


class BucketedGradReducer:
    """Owns gradient storage for stages 0-2 and the hooks that fill and reduce it."""

    def __init__(self, buckets: list[Bucket], slots: list[Slot], stage: int, comm: Communicator,
                 dtype: torch.dtype, overlap: bool, device: torch.device,
                 on_bucket_complete: Callable[[int], None] | None = None) -> None:
        """`slots`: the trainable parameters; `on_bucket_complete(index)` is called when every
        trainable parameter of a bucket has reported its gradient in this backward."""
        self.buckets, self.stage, self.comm = buckets, stage, comm
        self.on_bucket_complete = on_bucket_complete
        self.dtype, self.overlap, self.device = dtype, overlap, device
        # CUDA: the waits and the bookkeeping after each reduction on a stream of their own (_finish_oldest)
        self.side = torch.cuda.Stream(device) if device.type == "cuda" and overlap else None
        self.slot_of = {id(s.param): s for s in slots}
        self.pre_divide, self.post_divide = divide_factors(comm.size, dtype)
        # Gradients with fp32's range leave the reduction as sums: the optimizer's unscale, a pass
        # over them it makes anyway, divides by the DP size too (`step_divisor`), so averaging costs
        # no pass at all, on any backend. fp16 divides here, to keep its headroom as the sum grows
        # over micro-steps at stages 2-3.
        self.step_divisor = 1.0
        if dtype != torch.float16:
            self.step_divisor, self.post_divide = self.post_divide, 1.0
        total = buckets[-1].end if buckets else 0
        if stage < 2:
            self.full = torch.zeros(total, dtype=dtype, device=device)
            self.shard_grads = [self.full[slice(*self._owned(b))] for b in buckets]
        else:
            self.full = None
            # A bucket of frozen parameters only (stage 3) is never reduced: no gradient shard.
            self.shard_grads = [torch.zeros(b.shard_numel if any(s.param.requires_grad for s in b.slots) else 0,
                                            dtype=dtype, device=device) for b in buckets]
        self.staging: dict[int, torch.Tensor] = {}
        self.inflight: deque = deque()
        # Buffers of finished reductions whose last use may still be queued on `side`: held until the
        # compute stream has waited for it (_release_finished); on CPU released at the same points.
        self.finished: list[torch.Tensor] = []
        self.pending = [0] * len(buckets)
        self.reported = set()
        self.next_launch = len(buckets)
        self.reducing = False
        self.first_micro_step = True
        self.written: set[int] = set()  # parameters whose gradient is in the buffer since the accumulation began
        self._padding: dict[int, list[tuple[int, int]]] = {}
        self._ranges: dict[int, list[tuple[int, int, int]]] = {}  # per bucket: (id(param), start, end)
        self.peak_buffer_bytes = 0
        # Weak: the model outlives this reducer, whose buffers its hooks must not keep alive.
        self.handles = [s.param.register_post_accumulate_grad_hook(WeakHook(self._on_grad)) for s in slots]

    def close(self) -> None:
        """Remove the hooks from the parameters: a later backward of the model is plain torch."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _owned(self, bucket: Bucket) -> tuple[int, int]:
        return (bucket.start, bucket.end) if self.stage == 0 else bucket.shard_range(self.comm.rank)

    # -- backward ---------------------------------------------------------------------------
    def begin_backward(self, reduce: bool, first_micro_step: bool) -> None:
        """Arm the hooks: `reduce` on the micro-steps whose gradients are reduced now."""
        self.reducing = reduce
        self.first_micro_step = first_micro_step
        if first_micro_step or self.full is None:  # stages 2-3 stage each micro-step afresh
            self.written = set()
        self.pending = [sum(s.param.requires_grad for s in b.slots) for b in self.buckets]
        self.reported: set[int] = set()
        self.next_launch = 0

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        slot = self.slot_of[id(param)]
        bucket = self.buckets[slot.bucket]
        if self.reducing and slot.bucket < self.next_launch:
            raise RuntimeError(
                f"parameter {slot.name!r} received a second gradient after its bucket was reduced "
                "in this backward pass; a parameter may be used in several places, but its "
                "gradient must be complete when its accumulation hook fires once")
        if self.full is not None:
            target, base = self.full, 0
        else:
            target, base = self._staging_for(bucket), bucket.start
        view, grad = target[slot.start - base:slot.end - base], param.grad.view(-1)
        if id(param) in self.written:  # a later micro-step (stages 0-1): accumulate
            view.add_(grad, alpha=1 / self.pre_divide)
        elif self.pre_divide != 1:     # the first: write, no zeroing before, no read of the old values
            torch.mul(grad, 1 / self.pre_divide, out=view)
        else:
            view.copy_(grad)
        self.written.add(id(param))
        param.grad = None
        if self.reducing and id(param) not in self.reported:
            self._report(slot)

    def _report(self, slot: Slot) -> None:
        """`slot`'s gradient is in its bucket: launch every bucket now complete, in bucket order."""
        self.reported.add(id(slot.param))
        self.pending[slot.bucket] -= 1
        if self.pending[slot.bucket] == 0 and self.on_bucket_complete is not None:
            self.on_bucket_complete(slot.bucket)
        while self.next_launch < len(self.buckets) and self.pending[self.next_launch] <= 0:
            self._launch(self.buckets[self.next_launch])
            self.next_launch += 1

    def report_unused(self, bucket_index: int) -> None:
        """Stage 3, once a unit's backward is over: its trainable parameters that got no gradient
        (a branch this rank skipped) count as reported with a zero gradient (_zero_unwritten), so
        the bucket is reduced here, at the same point of every rank's collective order. A real
        gradient arriving later still raises in _on_grad (its bucket was reduced)."""
        if self.reducing:
            for s in self.buckets[bucket_index].slots:
                if s.param.requires_grad and id(s.param) not in self.reported:
                    self._report(s)

    def _staging_for(self, bucket: Bucket) -> torch.Tensor:
        """Stages 2-3: the bucket's staging buffer, its padding zeroed (gradients are copied in)."""
        buf = self.staging.get(bucket.index)
        if buf is None:
            buf = self.staging[bucket.index] = torch.empty(bucket.numel, dtype=self.dtype, device=self.device)
            gaps = self._padding_of(bucket)
            if gaps:  # one foreach kernel for all of the bucket's alignment gaps
                torch._foreach_zero_([buf[lo:hi] for lo, hi in gaps])
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes())
        return buf

    def _padding_of(self, bucket: Bucket) -> list[tuple[int, int]]:
        """The ranges of `bucket` (relative) that no parameter covers: alignment and its tail."""
        gaps = self._padding.get(bucket.index)
        if gaps is None:
            gaps, at = [], 0
            for s in sorted(bucket.slots, key=lambda s: s.start):
                if s.start - bucket.start > at:
                    gaps.append((at, s.start - bucket.start))
                at = max(at, s.end - bucket.start)
            if at < bucket.numel:
                gaps.append((at, bucket.numel))
            self._padding[bucket.index] = gaps
        return gaps

    def _zero_unwritten(self, bucket: Bucket, target: torch.Tensor, base: int) -> None:
        """Parameters of `bucket` that got no gradient in this accumulation (unused, or frozen)
        hold stale values or none: zeros, before the bucket is reduced, in one foreach kernel
        whatever their count (their ranges are cut once per bucket)."""
        ranges = self._ranges.get(bucket.index)
        if ranges is None:
            ranges = self._ranges[bucket.index] = [(id(s.param), s.start, s.end) for s in bucket.slots]
        views = [target[lo - base:hi - base] for key, lo, hi in ranges if key not in self.written]
        if views:
            torch._foreach_zero_(views)

    def _launch(self, bucket: Bucket) -> None:
        if not any(s.param.requires_grad for s in bucket.slots):
            return  # only frozen parameters (a stage-3 unit): nothing to reduce
        whole = slice(bucket.start, bucket.end)
        if self.full is not None:
            self._zero_unwritten(bucket, self.full, 0)
        if self.stage == 0:
            work = self.comm.all_reduce(self.full[whole], purpose="grads", async_op=self.overlap)
            self.inflight.append((work, None, self.full[whole], None))
        elif self.stage == 1:
            work = self.comm.reduce_scatter(self.shard_grads[bucket.index], self.full[whole],
                                            purpose="grads", async_op=self.overlap)
            self.inflight.append((work, None, self.shard_grads[bucket.index], None))
        else:
            staging = self._staging_for(bucket)  # none yet: no parameter of it got a gradient
            self._zero_unwritten(bucket, staging, bucket.start)
            self.staging.pop(bucket.index)
            accumulate = not self.first_micro_step
            out = torch.empty_like(self.shard_grads[bucket.index]) if accumulate else self.shard_grads[bucket.index]
            work = self.comm.reduce_scatter(out, staging, purpose="grads", async_op=self.overlap)
            self.inflight.append((work, staging, out, self.shard_grads[bucket.index] if accumulate else None))
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes())
        if work is None:  # blocking collective (or a world of one): done already
            self._finish_oldest(bound=True)
        while self.stage >= 2 and len(self.inflight) > MAX_INFLIGHT_STAGING:
            self._finish_oldest(bound=True)

    def _finish_oldest(self, bound: bool = False) -> None:
        """Wait for the oldest reduction, average its sum (fp16: divide_factors) and, on a later
        micro-step of stage 2-3, add it into the gradient shard.

        On CUDA this runs on the reducer's own stream (`side`), FSDP2's arrangement: the wait
        makes that stream, not the compute stream, wait for NCCL, so backward's kernels keep
        running while the bucket is finished. The staging buffer and the reduce-scatter output
        were allocated on the compute stream and are last used on `side`. No record_stream: the
        caching allocator would hand such a block out again only once an event it records has
        completed as seen from the host, so a host running ahead would cut fresh memory for every
        bucket and MAX_INFLIGHT_STAGING would bound nothing on the device. Instead they are held
        (`finished`) until the compute stream waits for `side`, with `bound` (MAX_INFLIGHT_STAGING
        reached) and at the end of backward, then dropped: every later kernel of the compute
        stream is ordered after their last use, so the allocator reuses their memory at once
        and safely (FSDP2 frees its reduce-scatter input the same way). What holds: at most
        MAX_INFLIGHT_STAGING + 1 staging buffers alive at once, on the host and on the device."""
        work, staging, out, accumulate_into = self.inflight.popleft()
        with torch.cuda.stream(self.side) if self.side is not None else nullcontext():
            if work is not None:
                work.wait()
            if self.post_divide != 1:
                out.div_(self.post_divide)
            if accumulate_into is not None:
                accumulate_into.add_(out)
        self.finished += [t for t in (staging, out if accumulate_into is not None else None) if t is not None]
        if bound:
            self._release_finished()

    def _release_finished(self) -> None:
        """The compute stream waits for what `side` has queued, then the finished buffers go."""
        if self.side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.side)
        self.finished.clear()

    def end_backward(self) -> None:
        """Reduce what is left (buckets with unused parameters) and wait for every collective."""
        if self.reducing:
            while self.next_launch < len(self.buckets):
                self._launch(self.buckets[self.next_launch])
                self.next_launch += 1
        while self.inflight:
            self._finish_oldest()
        self._release_finished()  # the optimizer and the next backward read what the side stream wrote
        self.reducing = False

    def zero_grads(self) -> None:
        """Start a new accumulation: nothing to clear. The first micro-step copies gradients into
        the buffer (and stage 2-3's reduce-scatter overwrites the shard); the padding, never
        written, stays zero; a parameter without a gradient is zeroed as its bucket is reduced."""

    # -- accounting -------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The gradient buffer (stages 0-1) or shards (stages 2-3), and the working buffers alive
        now: staging buffers and reduce-scatter outputs of their own (ZeroEngine.state_tensors)."""
        alive = list(self.staging.values()) + self.finished
        for _work, staging, out, accumulate_into in self.inflight:
            alive += [t for t in (staging, out if accumulate_into is not None else None) if t is not None]
        return {"grads": [self.full] if self.full is not None else list(self.shard_grads), "buffers": alive}

    def buffer_bytes(self) -> int:
        """Bytes of gradient staging buffers and reduce-scatter outputs alive right now."""
        return sum(t.numel() * t.element_size() for t in self.state_tensors()["buffers"])

    def staging_limit_bytes(self, bucket_limit: int) -> int:
        """What the config holds peak_buffer_bytes to: at stages 2-3, MAX_INFLIGHT_STAGING + 1
        staging buckets of at most `bucket_limit` elements and, with accumulation, as many
        reduce-scatter outputs in flight (1/N of a bucket each) as staging buffers launched."""
        if self.stage < 2:
            return 0
        return ((MAX_INFLIGHT_STAGING + 1) * bucket_limit + MAX_INFLIGHT_STAGING * bucket_limit // self.comm.size) \
            * self.dtype.itemsize

    def abandon_backward(self) -> None:
        """After a backward that raised: finish what was launched, drop what was not, so the
        next backward starts clean (its first micro-step overwrites the stage-2/3 shards)."""
        for work, *_buffers in self.inflight:
            if work is not None:
                work.wait()
        self._release_finished()  # what the side stream still has queued on the gradient buffers
        self.inflight.clear()
        self.staging.clear()
        self.reducing = False
