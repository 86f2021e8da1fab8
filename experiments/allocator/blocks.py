"""The allocator's bookkeeping: blocks, the per-pool sets they are found in, expandable segments.

As in c10/cuda/CUDACachingAllocator.cpp: a `Block` is a range of a segment, linked to its
neighbours in that segment (prev/next: split blocks of one cudaMalloc, or of one expandable
segment's address space); a `BlockPool` holds the free blocks of one size class ordered by
(stream, size, address) (BlockComparatorSize: best fit is the first block at or after the
request's key on the same stream) and the unmapped ranges of expandable segments ordered by
(stream, address) (BlockComparatorAddress). An `ExpandableSegment` is one reserved virtual
range whose pages (2 MiB small, large_segment_size large: 20 MiB) are mapped and unmapped on demand.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field


class Block:
    """One block (struct Block): free or allocated, mapped or not (expandable segments only)."""

    __slots__ = ("stream", "size", "addr", "pool", "allocated", "mapped", "prev", "next", "segment", "requested")

    def __init__(self, stream: int, size: int, pool: "BlockPool", addr: int, segment: "ExpandableSegment | None" = None):
        self.stream, self.size, self.pool, self.addr, self.segment = stream, size, pool, addr, segment
        self.allocated, self.mapped, self.requested = False, True, 0
        self.prev: Block | None = None
        self.next: Block | None = None

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def splice(self, before: "Block | None", after: "Block | None") -> None:
        """Insert this block between `before` and `after` (Block::splice)."""
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else "free" if self.mapped else "unmapped"
        return f"Block({state}, stream={self.stream}, size={self.size}, addr={self.addr:#x})"


class _SortedBlocks:
    """A std::set<Block*> with a comparator: blocks by a key, lower_bound by key."""

    def __init__(self, key) -> None:
        self._key, self._keys, self._blocks = key, [], []

    def insert(self, block: Block) -> None:
        k = self._key(block)
        i = bisect.bisect_left(self._keys, k)
        self._keys.insert(i, k)
        self._blocks.insert(i, block)

    def remove(self, block: Block) -> None:
        i = bisect.bisect_left(self._keys, self._key(block))
        if i == len(self._blocks) or self._blocks[i] is not block:
            raise AssertionError(f"{block} is not in this pool")  # a bookkeeping bug, never an input error
        del self._keys[i], self._blocks[i]

    def lower_bound(self, key: tuple) -> int:
        return bisect.bisect_left(self._keys, key)

    def __getitem__(self, i: int) -> Block:
        return self._blocks[i]

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self):
        return iter(list(self._blocks))


class BlockPool:
    """struct BlockPool: the free blocks of the small or the large pool, and its unmapped ranges."""

    def __init__(self, is_small: bool) -> None:
        self.is_small = is_small
        self.blocks = _SortedBlocks(lambda b: (b.stream, b.size, b.addr))
        self.unmapped = _SortedBlocks(lambda b: (b.stream, b.addr))


@dataclass
class ExpandableSegment:
    """struct ExpandableSegment: `pages` slots of `page_size` bytes from `base`, each mapped or not."""

    stream: int
    base: int
    page_size: int
    max_pages: int
    mapped: list[bool] = field(default_factory=list)  # handles_: one entry per page up to the last mapped one

    @property
    def size(self) -> int:
        return self.max_pages * self.page_size

    def page_range(self, addr: int, size: int, inner: bool) -> tuple[int, int]:
        """Pages covering [addr, addr + size) (map: segmentLeft..segmentRight), or only those
        wholly inside it (unmap: segmentRight..segmentLeft)."""
        lo, hi = addr - self.base, addr + size - self.base
        if inner:
            return -(-lo // self.page_size), hi // self.page_size
        return lo // self.page_size, -(-hi // self.page_size)

    def set_mapped(self, begin: int, end: int, value: bool) -> None:
        while len(self.mapped) < end:
            self.mapped.append(False)
        self.mapped[begin:end] = [value] * (end - begin)
        while self.mapped and not self.mapped[-1]:  # trimHandles
            self.mapped.pop()

    def mapped_ranges(self) -> int:
        """Contiguous mapped ranges: what a snapshot reports as this segment's segments."""
        return sum(1 for i, m in enumerate(self.mapped) if m and (i == 0 or not self.mapped[i - 1]))
