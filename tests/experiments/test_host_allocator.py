"""CPU ranks keep the memory torch frees mapped (experiments/host_allocator.py): a block freed and
allocated again costs no page faults, where glibc's default maps it afresh and faults every page.
Each case runs in a forked child of its own (glibc's options are per process)."""
from __future__ import annotations

import ctypes
import resource

import pytest
import torch

from experiments.host_allocator import freed_memory_kept, keep_freed_memory_mapped
from experiments.launch import run_in_child, spawn

BLOCK_BYTES = 64 * 2**20          # above glibc's largest mmap threshold (32 MiB): mapped by default
PAGES = BLOCK_BYTES // 4096


def _faults_per_block(keep: bool) -> dict:
    """A block allocated, written and freed, ten times over: the faults of the last five."""
    if keep:
        assert keep_freed_memory_mapped()
    faults = []
    for _ in range(10):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(BLOCK_BYTES // 4).fill_(1.0)     # every page written, then freed
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return {"faults": faults[5:], "kept": freed_memory_kept()}


def _glibc() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallopt")
    except OSError:
        return False


@pytest.mark.skipif(not _glibc(), reason="glibc's mallopt: what the module sets")
def test_a_freed_block_comes_back_without_page_faults():
    default = run_in_child(_faults_per_block, False, timeout=60)
    kept = run_in_child(_faults_per_block, True, timeout=60)
    # glibc's default: each time a fresh mapping, its 16,384 pages faulted in and zeroed again
    assert not default["kept"] and min(default["faults"]) >= 0.9 * PAGES
    # kept: once the heap holds freed blocks (torch's 64-byte-aligned requests leave the first few
    # a little short, so the heap grows by some blocks first), a freed block serves the next
    assert kept["kept"] and max(kept["faults"]) < 0.05 * PAGES


def _kept_on_rank() -> bool:
    return freed_memory_kept()


@pytest.mark.skipif(not _glibc() or torch.cuda.is_available(), reason="CPU ranks on glibc")
def test_spawned_cpu_ranks_keep_freed_memory():
    assert spawn(_kept_on_rank, 2, backend="gloo", timeout=60) == [True, True]
