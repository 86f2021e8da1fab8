"""Stages 0-2: every trainable parameter becomes a view into a flat, bucketed buffer.

The buffer is laid out in buckets (see layout.py), one tensor per bucket. After an optimizer
step each rank has updated its own slice of every bucket; stages 1 and 2 then all-gather the
slices in place, bucket by bucket, so every rank again holds the full, identical parameters.

Construction never holds two copies of the model: bucket by bucket, the parameters are copied
into the bucket's tensor (model precision) and re-pointed at it, which frees their old storage
before the next bucket is allocated. With mixed precision, this rank's fp32 master pieces are
cut from the parameters' original values on the way (not from their bf16/fp16 rounding) and
handed to the optimizer, which keeps them. Peak: the model as passed plus one bucket, plus the
masters the optimizer will hold anyway.
"""
from __future__ import annotations

import torch

from .comm import Communicator
from .layout import Bucket, Slot, build_buckets


class FlatParamBuffer:
    """The bucketed parameter buffer of stages 0-2 and its post-step all-gather."""

    def __init__(self, slots: list[Slot], *, bucket_size: int, allgather_bucket_size: int, sharded: bool,
                 comm: Communicator, overlap: bool, dtype: torch.dtype, master_dtype: torch.dtype) -> None:
        """`dtype`: model precision; `master_dtype`: the optimizer's (its master pieces are cut
        here, from the parameters' values, when it differs from `dtype`)."""
        self.slots, self.comm, self.overlap = slots, comm, overlap
        self.sharded = sharded
        self.allgather_bucket_size = allgather_bucket_size
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
        """Stages 1-2, after an update: every rank's updated slice to every rank, in place."""
        if not self.sharded or not applied:
            return
        works = []
        for b in self.buckets:
            lo, hi = self.owned_range(b)
            if b.numel <= self.allgather_bucket_size:
                works.append(self.comm.all_gather(self.data[b.index], self._slice(b, lo, hi),
                                                  purpose="params", async_op=self.overlap))
                continue
            # Bound each collective to allgather_bucket_size elements: gather the shard in chunks,
            # each rank's chunk landing directly in its place in the bucket.
            step = max(1, self.allgather_bucket_size // self.comm.size)
            for off in range(0, b.shard_numel, step):
                n = min(step, b.shard_numel - off)
                outs = [self.data[b.index][r * b.shard_numel + off:][:n] for r in range(self.comm.size)]
                works.append(self.comm.all_gather_into_views(outs, self._slice(b, lo + off, lo + off + n).clone(),
                                                             purpose="params", async_op=self.overlap))
        for w in works:
            if w is not None:
                w.wait()

    def param_tensors(self) -> list[torch.Tensor]:
        return list(self.data)

    def close(self, gather: bool = True) -> None:
        """Give each parameter its own storage, a copy of its slice (every rank holds the full
        values: no collective, `gather` is stage 3's), so the flat buffer goes with this object."""
        for s in self.slots:
            s.param.data = s.param.data.clone()
