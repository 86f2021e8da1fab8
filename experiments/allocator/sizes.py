"""The caching allocator's sizes, as c10/cuda/CUDACachingAllocator.cpp defines them (torch 2.13).

    kMinBlockSize  512 B    every block is a multiple of it (round_size)
    kSmallSize     1 MiB    the largest request served by the small pool (get_pool)
    kSmallBuffer   2 MiB    a small-pool segment (get_allocation_size); an expandable small page
    kMinLargeAlloc 10 MiB   requests below it take a kLargeBuffer segment
    kLargeBuffer   20 MiB   a shared large segment; an expandable large page; max_non_split_rounding's default
                            (torch 2.13: AcceleratorAllocatorConfig::large_segment_size(), 20 MiB unless
                            large_segment_size_mb sets it; K_LARGE_BUFFER is that default)
    kRoundLarge    2 MiB    larger requests' segments are rounded up to it
"""
from __future__ import annotations

K_MIN_BLOCK_SIZE = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_LARGE_BUFFER = 20 << 20
K_ROUND_LARGE = 2 << 20
SIZE_MAX = (1 << 64) - 1  # std::numeric_limits<size_t>::max(): max_split_size's default (no limit)


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """DeviceCachingAllocator::roundup_power2_next_division: `size` up to the next of `divisions`
    equal steps between the powers of two around it (1200 with 4 divisions: 1280)."""
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    step = power2_floor >> (divisions.bit_length() - 1)  # >> (63 - countLeadingZeros(divisions))
    if step == 0:
        return power2_floor << 1
    floor = size & ~(step - 1)
    return size if floor == size else floor + step


def round_size(size: int, divisions: int = 0) -> int:
    """DeviceCachingAllocator::round_size: a request's block size. `divisions` is
    roundup_power2_divisions for this size (AllocatorConfig::roundup_power2_divisions(size))."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return roundup_power2_next_division(size, divisions)
    return K_MIN_BLOCK_SIZE * -(-size // K_MIN_BLOCK_SIZE)


def get_allocation_size(size: int, large_segment_size: int = K_LARGE_BUFFER) -> int:
    """DeviceCachingAllocator::get_allocation_size: the segment cudaMalloc'd for a (rounded)
    request no cached block serves."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return large_segment_size
    return K_ROUND_LARGE * -(-size // K_ROUND_LARGE)


def is_small(size: int) -> bool:
    """get_pool: the small pool serves rounded requests up to kSmallSize."""
    return size <= K_SMALL_SIZE
