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
from torch import nn

from .comm import Communicator
from .hooks import WeakHook
from .layout import BUCKET_ALIGN, PARAM_ALIGN, Bucket, Slot, build_buckets, round_up


class FlatParamBuffer:
    """The bucketed parameter buffer of stages 0-2 and its post-step all-gather."""

    def __init__(self, slots: list[Slot], *, bucket_size: int, allgather_bucket_size: int, sharded: bool,
                 comm: Communicator, overlap: bool, dtype: torch.dtype, master_dtype: torch.dtype,
                 overlap_param_gather: bool = False) -> None:
        """`dtype`: model precision; `master_dtype`: the optimizer's (its master pieces are cut
        here, from the parameters' values, when it differs from `dtype`)."""
        self.slots, self.comm, self.overlap = slots, comm, overlap
        self.sharded, self.overlap_param_gather = sharded, overlap_param_gather
        self.bucket_size, self.allgather_bucket_size = bucket_size, allgather_bucket_size
        self.peak_inflight_elements = 0  # of post-step all-gathers launched and not yet waited on
        self._held_back: deque[int] = deque()  # buckets whose post-step gather is not issued yet
        self._inflight: deque = deque()        # (bucket index, work), issued and not waited on
        self._inflight_elements = 0
        self._stale: set[int] = set()          # buckets whose gather is not complete
        self.handles: list = []
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
        self.finish_gathers()  # backward reads every parameter, used in forward or not

    def end_backward(self) -> None:
        pass

    # -- the post-step all-gather, hidden behind the next forward --------------------------------
    def after_step(self, applied: bool) -> None:
        """Stages 1-2, after an update: every rank's updated slice to every rank, in place.

        The gathers go out in forward order (the buckets from last to first: the layout puts the
        first layers' parameters in the last buckets) and are waited on only when a module whose
        parameters live in a bucket is about to run (a forward pre-hook, `_before_module`), as
        megatron-core's overlap_param_gather: the next forward's first layers wait for their
        buckets, its later layers run while theirs arrive. At most allgather_bucket_size elements
        of gathers are in flight (a larger bucket alone), DeepSpeed's "elements all-gathered at a
        time": a wait lets the next buckets go out. The bound caps whatever a backend holds per
        call (gloo's own all-gather flattens each output into a host temporary; NCCL and
        the exchanges on gloo, comm.py, hold nothing for these in-place gathers). On NCCL a
        wait makes the waiting stream wait on the gather's event, with no host sync, and the
        gathers run one after another on NCCL's stream.

        Every rank must then enter the next forward, or anything else that needs the parameters
        (backward, step, full_parameters, state_dict, close, finish_gathers), as it issues the
        gathers still held back: a forward run by one rank alone (sampling on rank 0) is preceded
        by engine.finish_param_gathers() on every rank, or overlap_param_gather=False gathers
        everything inside step() instead.
        """
        if not self.sharded or not applied:
            return
        self.finish_gathers()
        self._held_back.extend(range(len(self.buckets) - 1, -1, -1))
        self._stale.update(range(len(self.buckets)))
        self._issue()
        if not (self.overlap and self.overlap_param_gather):
            self.finish_gathers()

    def _issue(self) -> None:
        """Send the held-back gathers, in order, while they fit in allgather_bucket_size."""
        while self._held_back:
            b = self.buckets[self._held_back[0]]
            if self._inflight and self._inflight_elements + b.numel > self.allgather_bucket_size:
                return
            self._held_back.popleft()
            self.peak_inflight_elements = max(self.peak_inflight_elements, self._inflight_elements + b.numel)
            work = self.comm.all_gather(self.data[b.index], self.shard_view(b), purpose="params",
                                        async_op=self.overlap)
            if work is None:  # blocking (or a world of one): complete already
                self._stale.discard(b.index)
            else:
                self._inflight.append((b.index, work))
                self._inflight_elements += b.numel

    def _wait_for(self, index: int) -> None:
        """Bucket `index` is needed now: wait for the gathers up to it (in issue order)."""
        while index in self._stale:
            if not self._inflight:
                self._issue()
                continue
            done, work = self._inflight.popleft()
            work.wait()
            self._stale.discard(done)
            self._inflight_elements -= self.buckets[done].numel
            self._issue()

    def _before_module(self, buckets: tuple[int, ...], module: nn.Module, args) -> None:
        """Forward pre-hook of a module owning parameters in `buckets`."""
        for index in buckets if self._stale else ():
            self._wait_for(index)

    def finish_gathers(self) -> None:
        """Complete every post-step gather: full, updated parameters on this rank."""
        for index in sorted(self._stale, key=lambda i: -i):
            self._wait_for(index)

    def before_step(self) -> None:
        """Before the optimizer writes the shards: the last step's gathers read them."""
        self.finish_gathers()

    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        """State-dict pre-hook of each module owning flat-buffer parameters: its state_dict(), or
        any ancestor's, sees updated values."""
        self.finish_gathers()

    def register_hooks(self, module: nn.Module) -> None:
        """Forward pre-hooks on each module owning flat-buffer parameters (stages 1-2) and, with
        overlap_param_gather, state-dict pre-hooks on the same modules that complete the post-step
        gathers (they may issue the held-back ones: every rank must call state_dict() then)."""
        if not self.sharded:
            return
        bucket_of = {id(s.param): s.bucket for s in self.slots}
        for m in module.modules():
            owned = tuple(sorted({bucket_of[id(p)] for p in m.parameters(recurse=False) if id(p) in bucket_of},
                                 reverse=True))
            if owned:
                self.handles.append(m.register_forward_pre_hook(WeakHook(self._before_module, owned)))
                if self.overlap and self.overlap_param_gather:  # a submodule's state_dict() too
                    self.handles.append(m.register_state_dict_pre_hook(WeakHook(self._before_state_dict)))

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
        values once the post-step gathers are complete; `gather` is stage 3's), so the flat
        buffer goes with this object."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if gather:
            self.finish_gathers()
        else:  # after an error: wait for what every rank issued, issue nothing more
            for _, work in self._inflight:
                work.wait()
            self._inflight.clear()
            self._held_back.clear()
        for s in self.slots:
            s.param.data = s.param.data.clone()
