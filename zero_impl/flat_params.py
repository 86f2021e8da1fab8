"""Stages 0-2: every trainable parameter becomes a view into one contiguous flat buffer.

The buffer is laid out in buckets (see layout.py). After an optimizer step each rank has
updated its own slice of every bucket; stages 1 and 2 then all-gather the slices in place,
bucket by bucket, so every rank again holds the full, identical parameters.
"""
from __future__ import annotations

import torch

from .comm import Communicator
from .layout import Bucket, Slot, build_buckets


class FlatParamBuffer:
    """The flat parameter buffer of stages 0-2 and its post-step all-gather."""

    def __init__(self, slots: list[Slot], *, bucket_size: int, allgather_bucket_size: int,
                 sharded: bool, comm: Communicator, overlap: bool, dtype: torch.dtype = torch.float32) -> None:
        """`dtype`: the masters' dtype, in which the buffer is built from the model's values."""
        self.slots, self.comm, self.overlap = slots, comm, overlap
        self.sharded = sharded
        self.allgather_bucket_size = allgather_bucket_size
        self.buckets: list[Bucket] = build_buckets(slots, bucket_size, comm.size if sharded else 1)
        self.numel = self.buckets[-1].end if self.buckets else 0
        device = slots[0].param.device if slots else torch.device("cpu")
        # Built in the masters' dtype from the model's current values; `bind` converts it to
        # model precision.
        self.data = torch.zeros(self.numel, dtype=dtype, device=device)
        for s in slots:
            self.data[s.start:s.end].copy_(s.param.detach().reshape(-1))

    def owned_range(self, bucket: Bucket) -> tuple[int, int]:
        return bucket.shard_range(self.comm.rank) if self.sharded else (bucket.start, bucket.end)

    def shard_view(self, bucket: Bucket) -> torch.Tensor:
        """This rank's slice of `bucket` (masters' dtype before `bind`, model precision after)."""
        lo, hi = self.owned_range(bucket)
        return self.data[lo:hi]

    def bind(self, dtype: torch.dtype) -> None:
        """Convert the buffer to `dtype` and make each parameter's .data a view into it."""
        self.data = self.data.to(dtype)
        for s in self.slots:
            s.param.data = self.data[s.start:s.end].view(s.param.shape)

    def begin_backward(self) -> None:
        pass

    def end_backward(self) -> None:
        pass

    def after_step(self, applied: bool) -> None:
        """Stages 1-2, after an update: every rank's updated slice to every rank, in place."""
        if not self.sharded or not applied:
            return
        works = []
        for b in self.buckets:
            lo, hi = self.owned_range(b)
            if b.numel <= self.allgather_bucket_size:
                works.append(self.comm.all_gather(self.data[b.start:b.end], self.data[lo:hi],
                                                  purpose="params", async_op=self.overlap))
                continue
            # Bound each collective to allgather_bucket_size elements: gather the shard in chunks,
            # each rank's chunk landing directly in its place in the bucket.
            step = max(1, self.allgather_bucket_size // self.comm.size)
            for off in range(0, b.shard_numel, step):
                n = min(step, b.shard_numel - off)
                outs = [self.data[b.start + r * b.shard_numel + off:][:n] for r in range(self.comm.size)]
                works.append(self.comm.all_gather_into_views(outs, self.data[lo + off:lo + off + n].clone(),
                                                             purpose="params", async_op=self.overlap))
        for w in works:
            if w is not None:
                w.wait()

    def param_tensors(self) -> list[torch.Tensor]:
        return [self.data]

    def close(self, gather: bool = True) -> None:
        """Give each parameter its own storage, a copy of its slice (every rank holds the full
        values: no collective, `gather` is stage 3's), so the flat buffer goes with this object."""
        for s in self.slots:
            s.param.data = s.param.data.clone()
