"""Replay an event log (allocations and frees, in order, each on its stream) through the
caching allocator; what it would reserve.

The same log comes from a simulated rank (experiments/run/storage_tracker.py's `events`) or
from a GPU's recorded trace (snapshot.py). `fragmentation` is 1 - allocated peak / reserved
peak: the share of the reserved peak never holding a tensor at the allocated peak.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from experiments.allocator.caching_allocator import CachingAllocator, OutOfMemory
from experiments.allocator.config import AllocatorConfig


@dataclass(frozen=True)
class Event:
    """One allocator call: "alloc" of `nbytes` requested bytes on `stream`, or "free" of the
    allocation `key` names (keys are unique among live allocations)."""

    action: str
    key: int
    nbytes: int = 0
    stream: int = 0


@dataclass
class ReplayResult:
    """What the allocator held over the log (peaks over every event up to an out-of-memory)."""

    reserved_peak_bytes: int
    allocated_peak_bytes: int
    requested_peak_bytes: int
    rounded_peak_bytes: int
    segments_peak: int
    alloc_retries: int
    oom: bool
    oom_event: int | None
    oom_request_bytes: int | None
    events: int
    reserved_end_bytes: int
    config: dict

    @property
    def fragmentation(self) -> float:
        return 1.0 - self.allocated_peak_bytes / self.reserved_peak_bytes if self.reserved_peak_bytes else 0.0

    def as_dict(self) -> dict:
        return {"reserved_peak_bytes": self.reserved_peak_bytes, "allocated_peak_bytes": self.allocated_peak_bytes,
                "requested_peak_bytes": self.requested_peak_bytes, "segments_peak": self.segments_peak,
                "alloc_retries": self.alloc_retries, "oom": self.oom, "oom_event": self.oom_event,
                "oom_request_bytes": self.oom_request_bytes, "fragmentation": round(self.fragmentation, 6),
                "events": self.events, "reserved_end_bytes": self.reserved_end_bytes, "allocator": self.config}


class ReplayError(ValueError):
    """The log frees what it never allocated, or allocates a key twice."""


def replay(events: Iterable[Event], config: AllocatorConfig | None = None, capacity: int | None = None,
           segment_addresses: list[tuple[int, int]] | None = None, on_event=None) -> ReplayResult:
    """Run `events` through a fresh CachingAllocator of `capacity` bytes (None: unbounded).
    Zero-byte allocations never reach the allocator (CUDAAllocator::allocate returns null).
    An out-of-memory ends the replay, as it ends the program. `on_event(allocator)`, if given,
    is called after each event (tests check invariants with it)."""
    allocator = CachingAllocator(config, capacity, segment_addresses)
    live: dict[int, object] = {}
    zero: set[int] = set()
    oom_at = oom_bytes = None
    n = 0
    for n, ev in enumerate(events, 1):
        if ev.action == "alloc":
            if ev.key in live or ev.key in zero:
                raise ReplayError(f"event {n}: allocation {ev.key} is already live")
            if ev.nbytes == 0:
                zero.add(ev.key)
                continue
            try:
                live[ev.key] = allocator.malloc(ev.nbytes, ev.stream)
            except OutOfMemory:
                oom_at, oom_bytes = n, ev.nbytes
                break
        elif ev.action == "free":
            if ev.key in zero:
                zero.discard(ev.key)
                continue
            block = live.pop(ev.key, None)
            if block is None:
                raise ReplayError(f"event {n}: frees allocation {ev.key}, which is not live")
            allocator.free(block)
        else:
            raise ReplayError(f"event {n}: action must be alloc or free, got {ev.action!r}")
        if on_event is not None:
            on_event(allocator)
    s = allocator.stats
    return ReplayResult(
        reserved_peak_bytes=s.reserved_bytes.peak, allocated_peak_bytes=s.allocated_bytes.peak,
        requested_peak_bytes=s.requested_bytes.peak, rounded_peak_bytes=s.rounded_bytes.peak,
        segments_peak=s.segments.peak, alloc_retries=s.num_alloc_retries, oom=oom_at is not None,
        oom_event=oom_at, oom_request_bytes=oom_bytes, events=n, reserved_end_bytes=s.reserved_bytes.current,
        config=allocator.config.as_dict())
