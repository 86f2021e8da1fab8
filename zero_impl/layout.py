"""Flat, bucketed layout of parameters: where every element lives and which rank owns it.

Parameters are packed back to back into one flat buffer, in reverse registration order (the
order backward produces their gradients), and cut into buckets of about `bucket_size`
elements. Parameters start at multiples of 64 elements and each bucket is padded to a
multiple of lcm(shard count, 128), so that rank r owns the equal, contiguous, aligned slice
[r*S, (r+1)*S) of every bucket (S = bucket size / shard count), the layout of megatron-core's
`param_and_grad_buffer.py`. Inside a bucket, parameters are sorted by optimizer param group;
a rank's slice splits into at most one piece per group, spanning the alignment gaps between
its parameters (zero padding, which an element-wise optimizer keeps zero): each piece becomes
one fp32 master tensor of that group, so the optimizer steps a few large tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

PARAM_ALIGN = 64    # elements: where each parameter may start (Megatron-core's choice)
BUCKET_ALIGN = 128  # elements: bucket sizes are multiples of lcm(shard count, this)


@dataclass
class Slot:
    """One parameter's place in the flat buffer."""

    name: str
    param: torch.nn.Parameter
    group: int | None          # optimizer param group index; None for a frozen parameter
    counted_in_norm: bool      # False for tensor-parallel duplicates on TP ranks > 0
    start: int = 0             # absolute offset in the flat buffer
    bucket: int = 0

    @property
    def numel(self) -> int:
        return self.param.numel()

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass
class Piece:
    """A contiguous range [start, end) of the flat buffer whose slots share one `key`."""

    key: object
    start: int
    end: int


@dataclass
class Bucket:
    """A contiguous range of the flat buffer, reduced (and gathered) as one unit."""

    index: int
    start: int
    numel: int                 # padded: a multiple of shard_count
    shard_count: int
    slots: list[Slot] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.numel

    @property
    def shard_numel(self) -> int:
        return self.numel // self.shard_count

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Absolute [start, end) of rank's equal slice of this bucket."""
        lo = self.start + rank * self.shard_numel
        return lo, lo + self.shard_numel

    def pieces(self, lo: int, hi: int, key) -> list[Piece]:
        """Intersections of [lo, hi) with this bucket's slots, consecutive equal keys merged (the
        alignment gap between two slots is padding: zero, and kept zero by an element-wise
        optimizer; one tensor per group and bucket keeps the optimizer's per-tensor work small)."""
        out: list[Piece] = []
        for slot in self.slots:
            s, e = max(lo, slot.start), min(hi, slot.end)
            if s >= e:
                continue
            k = key(slot)
            if out and out[-1].key == k:
                out[-1].end = e
            else:
                out.append(Piece(k, s, e))
        return out


def build_buckets(slots: list[Slot], bucket_size: int, shard_count: int) -> list[Bucket]:
    """Assign offsets to `slots` (given in gradient-ready order) and group them into buckets.

    A parameter larger than `bucket_size` gets a bucket of its own; parameters are never split.
    """
    groups: list[list[Slot]] = [[]]
    size = 0
    for slot in slots:
        if groups[-1] and size + slot.numel > bucket_size:
            groups.append([])
            size = 0
        groups[-1].append(slot)
        size += slot.numel
    return pack_buckets(groups, shard_count)


def pack_buckets(groups: list[list[Slot]], shard_count: int) -> list[Bucket]:
    """One bucket per non-empty list of slots, back to back from offset 0; inside a bucket,
    slots are sorted by param group (frozen last).

    Alignment as in Megatron-core's param_and_grad_buffer.py: every parameter starts at a
    multiple of PARAM_ALIGN elements and every bucket's size is a multiple of
    lcm(shard_count, BUCKET_ALIGN), so views and collective buffers stay aligned for vectorized
    kernels and NCCL, whatever the world size (the paper's include 25 and 400); each rank's
    shard is then a whole number of elements.
    """
    buckets: list[Bucket] = []
    offset = 0
    multiple = math.lcm(shard_count, BUCKET_ALIGN)
    for members in (g for g in groups if g):
        # Stable sort: keeps gradient-ready order within a group.
        members = sorted(members, key=lambda s: (s.group is None, s.group or 0))
        bucket = Bucket(index=len(buckets), start=offset, numel=0, shard_count=shard_count, slots=members)
        for slot in members:
            offset = round_up(offset, PARAM_ALIGN)
            slot.start, slot.bucket = offset, bucket.index
            offset += slot.numel
        bucket.numel = round_up(offset - bucket.start, multiple)
        offset = bucket.end
        buckets.append(bucket)
    return buckets


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
