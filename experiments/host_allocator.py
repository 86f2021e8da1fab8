"""CPU ranks keep the memory torch frees mapped, as CUDA's caching allocator keeps its segments.

On the CPU, torch allocates through glibc's malloc, which serves a block above its mmap
threshold (128 KiB at first, raised to the size of a freed mapped block, at most 32 MiB) with
a fresh mmap and unmaps it when it is freed. So each step faults such blocks in again (the
logits and their gradient, a bucket above the threshold), and the kernel zeroes every page: on
the engine benchmark's model (experiments/bench_engine.py) that was 150-185 thousand minor faults
a step on each rank, about a quarter of its CPU step, and most for the systems that free and
allocate most. No GPU run pays it (CUDA's caching allocator keeps what it freed for the next
request), and the step-time model, calibrated on benchmarks that reuse their buffers, does not
price it; a CPU run that stands in for a GPU run should not pay it either.

`keep_freed_memory_mapped` sets two glibc options for this process: M_MMAP_MAX 0 (blocks come
from the heap, not from mmaps of their own) and M_TRIM_THRESHOLD at its maximum (the heap's free
top is never given back). Freed memory then stays with the process, as a GPU's reserved bytes
do, and with a caching allocator's cost: fragmentation. torch asks for 64-byte-aligned blocks,
so a freed block is a little short for the next request of its size until neighbours merge, and
the heap grows by a few blocks before it serves every request (tests/experiments/
test_host_allocator.py: one 64 MiB block in a loop settles after a few). What it does not cover: a thread other than the main one allocates from its own arena,
which glibc still grows by mmap (gloo's worker threads' temporaries). What it changes: the
process's resident set does not shrink after a peak, so a record's `peak_rss` holds freed
memory kept for reuse and fragmentation (the engine's own peaks, `peak_bytes`, count tensors and
are unchanged). Elsewhere than glibc it does nothing. Only CPU runs call it: on a GPU machine
the host memory (offload buffers, pinned copies) keeps glibc's own behaviour.
"""
from __future__ import annotations

import ctypes

# glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_INT_MAX = 2 ** 31 - 1

_kept = False


def keep_freed_memory_mapped() -> bool:
    """Have glibc keep freed memory mapped in this process (module docstring); True when it does."""
    global _kept
    if _kept:
        return True
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _kept = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, _INT_MAX) == 1
    return _kept


def freed_memory_kept() -> bool:
    """Whether this process keeps freed memory mapped (each CPU rank's record states it)."""
    return _kept
