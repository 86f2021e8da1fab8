"""A replay of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, torch 2.13,
DeviceCachingAllocator), one device, no CUDA graphs. Each method names the function it follows.

malloc(size, stream):
  round_size (512 B, or roundup_power2_divisions) -> get_pool (small <= 1 MiB, else large)
  -> get_allocation_size (2 MiB small segment; large_segment_size, 20 MiB, below 10 MiB; else up to 2 MiB)
  -> get_free_block (best fit on this stream; max_split_size's oversize rules)
  -> else alloc_block (cudaMalloc; or map pages of an expandable segment; refused past the memory fraction)
     -> else release_available_cached_blocks (only with max_split_size: free oversize blocks) + alloc_block
     -> else release_cached_blocks (free every unsplit cached segment) + alloc_block, counted as a retry
     -> else out of memory
  -> should_split (small pool or expandable: remainder >= 512 B; large: request < max_split_size
     and remainder > 1 MiB) -> alloc_found_block
free(block): free_block -> try_merge_blocks with its neighbours in the same segment only.

What it leaves out: cross-stream uses (recordStream: a block returns to its pool when its
events complete, later than free); garbage_collection_threshold (acts only under
set_per_process_memory_fraction); CUDA graphs' private pools; free-memory callbacks.
"""
from __future__ import annotations

from dataclasses import dataclass

from experiments.allocator.blocks import Block, BlockPool, ExpandableSegment
from experiments.allocator.config import AllocatorConfig
from experiments.allocator.device import Device
from experiments.allocator.sizes import (K_MIN_BLOCK_SIZE, K_SMALL_BUFFER, K_SMALL_SIZE, SIZE_MAX, get_allocation_size,
                                         is_small, round_size)


class OutOfMemory(RuntimeError):
    """malloc's "CUDA out of memory" after freeing the cache and retrying."""


@dataclass
class Stat:
    """struct Stat: current and peak."""

    current: int = 0
    peak: int = 0

    def add(self, n: int) -> None:
        self.current += n
        self.peak = max(self.peak, self.current)


@dataclass
class Stats:
    """DeviceStats, the part a replay reports (aggregate over both pools)."""

    allocated_bytes: Stat  # block sizes handed out: torch.cuda.memory_allocated
    reserved_bytes: Stat   # segments (mapped pages): torch.cuda.memory_reserved
    requested_bytes: Stat  # the bytes asked for
    rounded_bytes: Stat    # each request rounded by round_size: what a per-storage tracker counts
    segments: Stat         # cudaMalloc'd segments, or mapped ranges of expandable segments
    num_alloc_retries: int = 0
    num_ooms: int = 0
    num_device_alloc: int = 0
    num_device_free: int = 0

    @classmethod
    def zero(cls) -> "Stats":
        return cls(Stat(), Stat(), Stat(), Stat(), Stat())


class CachingAllocator:
    """DeviceCachingAllocator's malloc/free over a `Device` of `capacity` bytes."""

    def __init__(self, config: AllocatorConfig | None = None, capacity: int | None = None,
                 segment_addresses: list[tuple[int, int]] | None = None) -> None:
        self.config = config or AllocatorConfig()
        self.device = Device(capacity, segment_addresses)
        # setMemoryFraction (from per_process_memory_fraction): allowed_memory_maximum is fraction x
        # totalGlobalMem, for which the capacity stands; an unbounded device has nothing to take a fraction of
        fraction = self.config.per_process_memory_fraction
        self.allowed_memory_maximum = int(fraction * capacity) if capacity is not None and fraction < 1.0 else None
        self.large_blocks, self.small_blocks = BlockPool(False), BlockPool(True)
        self.expandable_segments: list[ExpandableSegment] = []
        self.stats = Stats.zero()

    # -- malloc ---------------------------------------------------------------------------------
    def malloc(self, orig_size: int, stream: int = 0) -> Block:
        """DeviceCachingAllocator::malloc: a block of at least `orig_size` bytes on `stream`."""
        cfg = self.config
        size = round_size(orig_size, cfg.divisions(orig_size))
        pool = self.small_blocks if is_small(size) else self.large_blocks
        alloc_size = get_allocation_size(size, cfg.large_segment_size)
        block = self.get_free_block(pool, stream, size)
        if block is None:
            block = self.alloc_block(pool, stream, size, alloc_size, retry=False)
            if block is None and self.release_available_cached_blocks(pool, stream, size):
                block = self.alloc_block(pool, stream, size, alloc_size, retry=False)
            if block is None and self.release_cached_blocks():
                block = self.alloc_block(pool, stream, size, alloc_size, retry=True)
            if block is None:
                self.stats.num_ooms += 1
                raise OutOfMemory(f"out of memory: tried to allocate {alloc_size} bytes with {self.stats.reserved_bytes.current}"
                                  f" reserved and {self.stats.allocated_bytes.current} allocated")
        return self.alloc_found_block(block, size, orig_size, stream, pool, self.should_split(block, size))

    def alloc_found_block(self, block: Block, size: int, orig_size: int, stream: int, pool: BlockPool,
                          split_remainder: bool) -> Block:
        """alloc_found_block: split the remainder off into the pool, mark the block allocated."""
        if split_remainder:
            remaining = block
            block = Block(stream, size, pool, remaining.addr, remaining.segment)
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = remaining
            remaining.prev = block
            remaining.addr += size
            remaining.size -= size
            pool.blocks.insert(remaining)
        block.allocated, block.requested = True, orig_size
        s = self.stats
        s.allocated_bytes.add(block.size)
        s.requested_bytes.add(orig_size)
        s.rounded_bytes.add(size)
        return block

    def should_split(self, block: Block, size: int) -> bool:
        """should_split: is the remainder worth a block of its own?"""
        remaining = block.size - size
        if block.pool.is_small or self.config.expandable_segments:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self.config.max_split_size and remaining > K_SMALL_SIZE

    def get_free_block(self, pool: BlockPool, stream: int, size: int) -> Block | None:
        """get_free_block: the smallest cached block on this stream that fits, unless it is
        oversize (>= max_split_size) for a smaller request, or more than
        max_non_split_rounding_size larger than an oversize request."""
        blocks = pool.blocks
        i = blocks.lower_bound((stream, size, -1))
        if i == len(blocks) or blocks[i].stream != stream:
            return None
        if blocks[i].segment is not None:
            # best fit counts a free block's unmapped tail as room it can grow into
            def expandable_size(b: Block) -> int:
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)
            j = i + 1
            while (blocks[i].segment is not None and j < len(blocks) and blocks[j].stream == stream
                   and expandable_size(blocks[j]) < expandable_size(blocks[i])):
                i, j = j, j + 1
        block, cfg = blocks[i], self.config
        if size < cfg.max_split_size and block.size >= cfg.max_split_size:
            return None
        if size >= cfg.max_split_size and block.size >= size + cfg.max_non_split_rounding_size:
            return None
        blocks.remove(block)
        return block

    def alloc_block(self, pool: BlockPool, stream: int, size: int, alloc_size: int, retry: bool) -> Block | None:
        """alloc_block: a new segment from cudaMalloc (or pages mapped into an expandable one)."""
        if retry:
            self.stats.num_alloc_retries += 1
        if self.allowed_memory_maximum is not None and \
                self.stats.reserved_bytes.current + alloc_size > self.allowed_memory_maximum:
            return None  # past the fraction (total_allocated_memory + size): as if cudaMalloc had failed
        if self.config.expandable_segments:
            return self.try_allocate_expandable_block(stream, pool, size)
        addr = self.device.cuda_malloc(alloc_size)
        if addr is None:
            return None
        self.stats.segments.add(1)
        self.stats.reserved_bytes.add(alloc_size)
        self.stats.num_device_alloc += 1
        return Block(stream, alloc_size, pool, addr)

    # -- freeing the cache on out-of-memory -------------------------------------------------------
    def release_available_cached_blocks(self, pool: BlockPool, stream: int, size: int) -> bool:
        """release_available_cached_blocks: with max_split_size set, cudaFree one oversize cached
        block large enough, else oversize blocks from the largest down until enough is freed."""
        max_split = self.config.max_split_size
        if max_split == SIZE_MAX or self.config.expandable_segments:
            return False
        blocks = pool.blocks
        key_size = max_split if size < max_split else size
        i = blocks.lower_bound((stream, key_size, -1))
        if i < len(blocks) and blocks[i].stream == stream:
            self.release_block(blocks[i])
            return True
        if i == 0:
            return False
        released, i = 0, i - 1
        while released < key_size and blocks[i].size >= max_split and blocks[i].stream == stream:
            cur = blocks[i]
            released += cur.size
            self.release_block(cur)
            if i == 0:
                break
            i -= 1
        return released >= key_size

    def release_cached_blocks(self) -> bool:
        """release_cached_blocks (also emptyCache): free every unsplit cached segment, unmap every
        free page of expandable segments."""
        self.release_blocks(self.large_blocks)
        self.release_blocks(self.small_blocks)
        return True

    def release_blocks(self, pool: BlockPool) -> None:
        to_unmap = []
        for block in pool.blocks:
            if block.segment is not None:
                to_unmap.append(block)
            elif not block.is_split():
                self.release_block(block)
        for block in to_unmap:
            self.unmap_block(block)
            if not block.is_split():
                self.release_expandable_segment(block)

    def release_block(self, block: Block) -> None:
        """release_block: cudaFree a whole cached segment."""
        self.device.cuda_free(block.size)
        self.stats.segments.add(-1)
        self.stats.reserved_bytes.add(-block.size)
        self.stats.num_device_free += 1
        block.pool.blocks.remove(block)

    # -- free -----------------------------------------------------------------------------------
    def free(self, block: Block) -> None:
        """free / free_block: back to its pool, merged with free neighbours of its segment."""
        if not block.allocated:
            raise AssertionError(f"{block} freed twice")
        block.allocated = False
        s = self.stats
        s.allocated_bytes.add(-block.size)
        s.requested_bytes.add(-block.requested)
        s.rounded_bytes.add(-round_size(block.requested, self.config.divisions(block.requested)))
        pool = block.pool
        for candidate in (block.prev, block.next):
            self.try_merge_blocks(block, candidate, pool)
        pool.blocks.insert(block)

    @staticmethod
    def try_merge_blocks(dst: Block, src: Block | None, pool: BlockPool) -> int:
        """try_merge_blocks: absorb a free neighbour (same segment, same mapped state)."""
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        (pool.blocks if src.mapped else pool.unmapped).remove(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # -- expandable segments ----------------------------------------------------------------------
    def find_expandable_block(self, stream: int, pool: BlockPool, size: int) -> Block:
        """find_expandable_block: the lowest address on this stream with `size` bytes of free and
        unmapped room, or a new segment's whole unmapped range (address space for 1 1/8 of the
        device's memory, in 2 MiB pages for the small pool and large_segment_size for the large)."""
        def allocatable(b: Block | None) -> bool:
            return b is not None and not b.allocated

        def has_room(b: Block | None) -> bool:
            room = 0
            while room < size and allocatable(b):
                room += b.size
                b = b.next
            return room >= size

        unmapped = pool.unmapped
        i = unmapped.lower_bound((stream, -1))
        while i < len(unmapped) and unmapped[i].stream == stream:
            c = unmapped[i]
            if allocatable(c.prev):
                c = c.prev
            if has_room(c):
                return c
            i += 1
        page = K_SMALL_BUFFER if pool.is_small else self.config.large_segment_size
        total = self.device.total_memory
        pages = -(-(total + total // 8) // page)
        segment = ExpandableSegment(stream, self.device.reserve_address_space(pages * page), page, pages)
        self.expandable_segments.append(segment)
        candidate = Block(stream, segment.size, pool, segment.base, segment)
        candidate.mapped = False
        unmapped.insert(candidate)
        return candidate

    def map_block(self, to_map: Block, size: int) -> bool:
        """map_block: back the first `size` bytes of an unmapped block with pages (whole pages)."""
        segment = to_map.segment
        begin, end = segment.page_range(to_map.addr, size, inner=False)
        nbytes = (end - begin) * segment.page_size
        if begin == end or not self.device.create_pages(nbytes):
            return False
        before = segment.mapped_ranges()
        segment.set_mapped(begin, end, True)
        pool = to_map.pool
        pool.unmapped.remove(to_map)
        to_map.mapped = True
        if nbytes < to_map.size:
            remaining = Block(to_map.stream, to_map.size - nbytes, pool, to_map.addr + nbytes, segment)
            remaining.mapped = False
            remaining.splice(to_map, to_map.next)
            pool.unmapped.insert(remaining)
            to_map.size = nbytes
        self.try_merge_blocks(to_map, to_map.prev, pool)
        self.try_merge_blocks(to_map, to_map.next, pool)
        pool.blocks.insert(to_map)
        self.stats.reserved_bytes.add(nbytes)
        self.stats.segments.add(segment.mapped_ranges() - before)
        self.stats.num_device_alloc += 1
        return True

    def try_allocate_expandable_block(self, stream: int, pool: BlockPool, size: int) -> Block | None:
        """try_allocate_expandable_block: map pages until a free block of `size` bytes exists."""
        candidate = self.find_expandable_block(stream, pool, size)
        if not candidate.mapped and not self.map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            following = candidate.next
            if not self.map_block(following, min(size - candidate.size, following.size)):
                return None
            candidate = following
        pool.blocks.remove(candidate)
        return candidate

    def unmap_block(self, block: Block) -> None:
        """unmap_block: release the pages wholly inside a free block of an expandable segment."""
        segment = block.segment
        begin, end = segment.page_range(block.addr, block.size, inner=True)
        if begin >= end:
            return
        pool = block.pool
        pool.blocks.remove(block)
        start, nbytes = segment.base + begin * segment.page_size, (end - begin) * segment.page_size
        before_size = start - block.addr
        if before_size > 0:
            before_free = Block(block.stream, before_size, pool, block.addr, segment)
            before_free.splice(block.prev, block)
            pool.blocks.insert(before_free)
        after_size = block.size - before_size - nbytes
        if after_size > 0:
            after_free = Block(block.stream, after_size, pool, start + nbytes, segment)
            after_free.splice(block, block.next)
            pool.blocks.insert(after_free)
        block.addr, block.size, block.mapped = start, nbytes, False
        self.try_merge_blocks(block, block.prev, pool)
        self.try_merge_blocks(block, block.next, pool)
        pool.unmapped.insert(block)
        ranges = segment.mapped_ranges()
        segment.set_mapped(begin, end, False)
        self.device.release_pages(nbytes)
        self.stats.reserved_bytes.add(-nbytes)
        self.stats.segments.add(segment.mapped_ranges() - ranges)
        self.stats.num_device_free += 1

    def release_expandable_segment(self, block: Block) -> None:
        """release_expandable_segment: a wholly unmapped segment gives back its address space."""
        block.pool.unmapped.remove(block)
        self.expandable_segments.remove(block.segment)
