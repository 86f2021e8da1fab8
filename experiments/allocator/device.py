"""What the caching allocator asks CUDA for: cudaMalloc/cudaFree of whole segments and, with
expandable segments, physical pages (cuMemCreate/cuMemRelease) inside reserved address space.

`capacity` is the bytes CUDA can hand out (the GPU's memory less the CUDA context and whatever
else holds device memory outside PyTorch's allocator, e.g. NCCL's buffers); None: unbounded.
Addresses only break ties between equal-size free blocks (BlockComparatorSize), so a replay of a
recorded trace takes cudaMalloc's addresses from the trace's segment_alloc entries, in order,
while they agree in size; otherwise each segment starts 2 MiB-aligned after the last.
"""
from __future__ import annotations

from collections import deque

_ALIGN = 2 << 20
_VA_BASE = 1 << 46  # expandable segments' reserved address space, apart from cudaMalloc's (cuMemAddressReserve)


class Device:
    """Device memory as the caching allocator sees it: what it has taken, and what is left."""

    def __init__(self, capacity: int | None = None, segment_addresses: list[tuple[int, int]] | None = None) -> None:
        self.capacity = capacity
        self.used = 0
        self._next = _ALIGN
        self._next_va = _VA_BASE
        self._recorded = deque(segment_addresses or ())  # (address, size) of the trace's segment_alloc entries
        self.address_mismatches = 0

    def _fits(self, nbytes: int) -> bool:
        return self.capacity is None or self.used + nbytes <= self.capacity

    def cuda_malloc(self, nbytes: int) -> int | None:
        """cudaMalloc: a new segment's address, or None (cudaErrorMemoryAllocation)."""
        if not self._fits(nbytes):
            return None
        self.used += nbytes
        if self._recorded:
            addr, size = self._recorded.popleft()
            if size == nbytes:
                return addr
            self.address_mismatches += 1
            self._recorded.clear()  # the replay took another path: the trace's addresses no longer apply
        addr = self._next
        self._next += -(-nbytes // _ALIGN) * _ALIGN
        return addr

    def cuda_free(self, nbytes: int) -> None:
        self.used -= nbytes

    def create_pages(self, nbytes: int) -> bool:
        """cuMemCreate for `nbytes` of pages (all or none, as ExpandableSegment::map releases the
        pages it made when one fails)."""
        if not self._fits(nbytes):
            return False
        self.used += nbytes
        return True

    def release_pages(self, nbytes: int) -> None:
        self.used -= nbytes

    def reserve_address_space(self, nbytes: int) -> int:
        """cuMemAddressReserve: virtual addresses only, no memory."""
        addr = self._next_va
        self._next_va += -(-nbytes // _ALIGN) * _ALIGN + _ALIGN
        return addr

    @property
    def total_memory(self) -> int:
        """prop.totalGlobalMem as far as the replay knows it (sizes an expandable segment's address space)."""
        return self.capacity if self.capacity is not None else 1 << 40
