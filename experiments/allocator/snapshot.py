"""Read what torch.cuda.memory._dump_snapshot() writes: a pickle (or the same dict as JSON) whose
`device_traces[d]` lists the allocator's actions on device d, recorded while
torch.cuda.memory._record_memory_history() was on.

The replay takes `alloc` (its `size` is the requested bytes) and `free_completed` (the block is
back in its pool: later than `free_requested` when another stream still used it); a trace with
no free_completed at all (recorded with skip_actions) falls back to free_requested. The trace's
own segment_alloc / segment_free / segment_map / segment_unmap entries give what the GPU
reserved, to compare the replay with: exact only if recording began before the first allocation.
"""
from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path

from experiments.allocator.replay import Event


class SnapshotError(ValueError):
    """Not a snapshot, or a trace that cannot be replayed."""


@dataclass
class Trace:
    """One device's trace as replayable events, with what the GPU itself reserved."""

    events: list[Event]
    segment_addresses: list[tuple[int, int]]  # (address, size) of each segment_alloc, in order
    reserved_peak_bytes: int
    segments_peak: int
    ooms: int
    alloc_conf: str | None  # the PYTORCH_CUDA_ALLOC_CONF the snapshot was taken under, if it says


def load(path: str | Path) -> dict:
    """The snapshot dict from a pickle or JSON file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise SnapshotError(f"cannot read snapshot {path}: {e.strerror or e}") from None
    try:
        data = pickle.loads(raw)
    except Exception:
        try:
            data = json.loads(raw)
        except ValueError:
            raise SnapshotError(f"{path} is neither a pickle nor JSON of torch.cuda.memory._snapshot()") from None
    if not isinstance(data, dict) or not isinstance(data.get("device_traces"), list):
        raise SnapshotError(f"{path} has no device_traces list: record with "
                            "torch.cuda.memory._record_memory_history() before _dump_snapshot()")
    return data


def _mapped_ranges(intervals: list[list[int]], addr: int, size: int, mapped: bool) -> None:
    """Add or remove [addr, addr + size) in a sorted list of disjoint [start, end) ranges."""
    end = addr + size
    kept = []
    for lo, hi in intervals:
        if hi < addr or lo > end or (not mapped and (hi == addr or lo == end)):
            kept.append([lo, hi])
        elif mapped:
            addr, end = min(addr, lo), max(end, hi)
        else:
            if lo < addr:
                kept.append([lo, addr])
            if hi > end:
                kept.append([end, hi])
    if mapped:
        kept.append([addr, end])
    intervals[:] = sorted(kept)


def trace(data: dict, device: int = 0) -> Trace:
    """Device `device`'s trace from a snapshot dict."""
    traces = data["device_traces"]
    if not 0 <= device < len(traces):
        raise SnapshotError(f"device {device} not in the snapshot: it has {len(traces)} device trace(s)")
    entries = traces[device]
    if not isinstance(entries, list):
        raise SnapshotError(f"device_traces[{device}] is not a list of trace entries")
    free_action = "free_completed" if any(e.get("action") == "free_completed" for e in entries) else "free_requested"
    events: list[Event] = []
    live: dict[int, int] = {}
    addresses: list[tuple[int, int]] = []
    reserved = reserved_peak = segments = segments_peak = ooms = 0
    expandable: list[list[int]] = []  # mapped ranges: one segment each, as a snapshot counts them
    for i, e in enumerate(entries):
        try:
            action = e["action"]
            if action == "oom":
                ooms += 1
                continue
            addr, size, stream = int(e["addr"]), int(e["size"]), int(e.get("stream", 0))
        except (KeyError, TypeError, ValueError):
            raise SnapshotError(f"device_traces[{device}][{i}] is not a trace entry (action, addr, size): {e!r:.200}") from None
        if action == "alloc":
            if addr in live:
                raise SnapshotError(f"trace entry {i}: address {addr:#x} allocated again before it was freed")
            live[addr] = len(events)
            events.append(Event("alloc", len(events), size, stream))
        elif action == free_action:
            if addr not in live:
                raise SnapshotError(f"trace entry {i}: frees {addr:#x}, never allocated in the trace: record the "
                                    "history from the start, before the first CUDA allocation")
            events.append(Event("free", live.pop(addr), 0, stream))
        elif action in ("segment_alloc", "segment_free"):
            sign = 1 if action == "segment_alloc" else -1
            if sign > 0:
                addresses.append((addr, size))
            reserved += sign * size
            segments += sign
        elif action in ("segment_map", "segment_unmap"):
            reserved += size if action == "segment_map" else -size
            before = len(expandable)
            _mapped_ranges(expandable, addr, size, action == "segment_map")
            segments += len(expandable) - before
        reserved_peak, segments_peak = max(reserved_peak, reserved), max(segments_peak, segments)
    settings = data.get("allocator_settings") or {}
    conf = settings.get("PYTORCH_CUDA_ALLOC_CONF") if isinstance(settings, dict) else None
    return Trace(events, addresses, reserved_peak, segments_peak, ooms, conf if isinstance(conf, str) else None)
