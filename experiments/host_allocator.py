"""CPU ranks keep the memory torch frees mapped, as CUDA's caching allocator keeps its segments.

On the CPU, torch allocates through glibc's malloc, which serves every block above its mmap
threshold (the logits and their gradient, a gradient bucket, a gathered layer) with a fresh
mmap and unmaps it when it is freed. So each step faults those pages in again, and the kernel
zeroes every one: on the engine benchmark's model (experiments/bench_engine.py) 150-185 thousand
minor faults a step on each rank, about a quarter of its CPU step, paid by every system alike,
and a cost no GPU run has (CUDA's caching allocator keeps what it freed for the next request).
A CPU run that stands in for a GPU run should not pay it, and the step-time model, calibrated
on benchmarks that reuse their buffers, does not price it.

`keep_freed_memory_mapped` sets two glibc options for this process: M_MMAP_MAX 0 (every block
from the heap, none from its own mmap) and M_TRIM_THRESHOLD at its maximum (the heap's free top
never given back). Freed memory then stays with the process, as a GPU's reserved bytes do;
the process's resident set does not shrink after a peak. Elsewhere than glibc it does nothing.
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
    """Whether this process keeps freed memory mapped (records.hardware states it)."""
    return _kept
