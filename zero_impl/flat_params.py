"""Stages 0-2: every trainable parameter becomes a view into a flat, bucketed buffer.

The buffer is laid out in buckets (see layout.py), one tensor per bucket. After an optimizer
step each rank has updated its own slice of every bucket; stages 1 and 2 then all-gather the
slices in place, bucket by bucket, so every rank again holds the full, identical parameters.
Rank r's slice is the contiguous [r*S, (r+1)*S) of its bucket, so each bucket is one
all_gather_into_tensor whose input is a view of its output: no temporary anywhere (a list of
outputs would make NCCL gather into a hidden flat copy of the whole output, held by the Work).

Construction never holds two copies of the model: bucket by bucket, the parameters are copied
into the bucket's tensor (model precision) and re-pointed at it, which frees their old storage
before the next bucket is allocated. With mixed precision, this rank's fp32 master pieces are
cut from the parameters' original values on the way (not from their bf16/fp16 rounding) and
handed to the optimizer, which keeps them. Peak: the model as passed plus one bucket, plus the
masters the optimizer will hold anyway.
"""
from __future__ import annotations

import math
from collections import deque

import torch

from .comm import Communicator
from .layout import BUCKET_ALIGN, PARAM_ALIGN, Bucket, Slot, build_buckets, round_up


class FlatParamBuffer:
    """The bucketed parameter buffer of stages 0-2 and its post-step all-gather."""

    def __init__(self, slots: list[Slot], *, bucket_size: int, allgather_bucket_size: int, sharded: bool,
                 comm: Communicator, overlap: bool, dtype: torch.dtype, master_dtype: torch.dtype) -> None:
        """`dtype`: model precision; `master_dtype`: the optimizer's (its master pieces are cut
        here, from the parameters' values, when it differs from `dtype`)."""
        self.slots, self.comm, self.overlap = slots, comm, overlap
        self.sharded = sharded
        self.bucket_size, self.allgather_bucket_size = bucket_size, allgather_bucket_size
        self.peak_inflight_elements = 0  # of post-step all-gathers launched and not yet waited on
        self.buckets: list[Bucket] = build_buckets(slots, bucket_size, comm.size if sharded else 1)
        self.numel = self.buckets[-1].end if self.buckets else 0
        device = slots[0].param.device if slots else torch.device("cpu")
        self.data: list[torch.Tensor] = []
        self._initial_masters: list[dict[int, torch.Tensor] | None] = []
        for b in self.buckets:
            data = torch.zeros(b.numel, dtype=dtype, device=device)  # zeros: the padding is summed too
            masters = None
            if master_dtype != dtype:
                lo, hi = self.owned_range(b)
                masters = {piece.start: torch.zeros(piece.end - piece.start, dtype=master_dtype, device=device)
                           for piece in b.pieces(lo, hi, key=lambda s: s.group)}
            for s in b.slots:
                values = s.param.detach().reshape(-1)
                for start, master in (masters or {}).items():
                    lo, hi = max(start, s.start), min(start + master.numel(), s.end)
                    if lo < hi:
                        master[lo - start:hi - start].copy_(values[lo - s.start:hi - s.start])
                view = data[s.start - b.start:s.end - b.start]
                view.copy_(values)
                s.param.data = view.view(s.param.shape)  # the old storage goes now
            self.data.append(data)
            self._initial_masters.append(masters)

    def owned_range(self, bucket: Bucket) -> tuple[int, int]:
        return bucket.shard_range(self.comm.rank) if self.sharded else (bucket.start, bucket.end)

    def _slice(self, bucket: Bucket, lo: int, hi: int) -> torch.Tensor:
        """Absolute range [lo, hi) of `bucket`, as a view of its tensor."""
        return self.data[bucket.index][lo - bucket.start:hi - bucket.start]

    def shard_view(self, bucket: Bucket) -> torch.Tensor:
        """This rank's slice of `bucket`, in model precision."""
        return self._slice(bucket, *self.owned_range(bucket))

    def initial_masters(self, bucket: Bucket) -> dict[int, torch.Tensor] | None:
        """{piece start: master-dtype values} of this rank's slice, until `bind` (None when the
        masters are the model's own shard)."""
        return self._initial_masters[bucket.index]

    def bind(self, dtype: torch.dtype) -> None:
        """The optimizer has taken its masters: drop our references to them."""
        self._initial_masters = [None] * len(self.buckets)

    def begin_backward(self) -> None:
        pass

    def end_backward(self) -> None:
        pass

    def after_step(self, applied: bool) -> None:
        """Stages 1-2, after an update: every rank's updated slice to every rank, in place.

        At most allgather_bucket_size elements of gathers are in flight (a larger bucket alone),
        DeepSpeed's "elements all-gathered at a time": the oldest is waited on and dropped before
        the next would pass it, which bounds whatever a backend holds per call (gloo flattens
        each output into a host temporary; NCCL holds nothing for these in-place gathers). On
        NCCL a wait makes the compute stream wait on an event, with no host sync, and the
        gathers run one after another on NCCL's stream anyway, so the bound costs no overlap.
        """
        if not self.sharded or not applied:
            return
        inflight: deque = deque()  # (work, elements)
        elements = 0
        for b in self.buckets:
            while inflight and elements + b.numel > self.allgather_bucket_size:
                work, n = inflight.popleft()
                work.wait()
                elements -= n
            self.peak_inflight_elements = max(self.peak_inflight_elements, elements + b.numel)
            work = self.comm.all_gather(self.data[b.index], self.shard_view(b), purpose="params",
                                        async_op=self.overlap)
            if work is not None:
                inflight.append((work, b.numel))
                elements += b.numel
        for work, _ in inflight:
            work.wait()

    def allgather_bytes(self) -> int:
        """Bytes of post-step all-gathers in flight at once, at most so far (in place: the
        parameter buffer's own bytes, no memory beyond it)."""
        return self.peak_inflight_elements * self._itemsize()

    def allgather_limit_bytes(self) -> int:
        """What the config holds allgather_bytes() to: allgather_bucket_size elements, or one
        larger bucket (a bucket is never split)."""
        largest = max([b.numel for b in self.buckets], default=0)
        return max(self.allgather_bucket_size, largest) * self._itemsize() if self.sharded else 0

    def _itemsize(self) -> int:
        return self.data[0].element_size() if self.data else 0

    def bucket_limit(self) -> int:
        """Elements the config holds a bucket to: reduce_bucket_size plus up to PARAM_ALIGN - 1 of
        alignment per parameter, rounded up to the buckets' multiple (layout.py); a parameter
        larger than that is a bucket of its own."""
        multiple = math.lcm(self.comm.size if self.sharded else 1, BUCKET_ALIGN)
        return max([round_up(b.slots[0].numel if len(b.slots) == 1 else
                             self.bucket_size + (PARAM_ALIGN - 1) * len(b.slots), multiple)
                    for b in self.buckets], default=0)

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The flat buffer's bucket tensors, the parameters' storage (ZeroEngine.state_tensors)."""
        return {"params": list(self.data)}

    def close(self, gather: bool = True) -> None:
        """Give each parameter its own storage, a copy of its slice (every rank holds the full
        values: no collective, `gather` is stage 3's), so the flat buffer goes with this object."""
        for s in self.slots:
            s.param.data = s.param.data.clone()
