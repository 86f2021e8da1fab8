"""What the CUDA caching allocator would reserve for a simulated rank: its event log
(run/storage_tracker.py StorageTracker.events) replayed by experiments/allocator, on a device
of the point's cluster.

- capacity: what cudaMalloc can hand out, the device's memory less cluster.cuda_reserve_gb (the
  CUDA context and what holds device memory outside the allocator, as NCCL's buffers); past it
  the allocator frees its cache and retries (counted), and then runs out of memory;
- the options: PYTORCH_CUDA_ALLOC_CONF, read from this process's environment as a GPU run of the
  same command reads it (torch 2.13's defaults when unset); the same log is replayed once more
  with expandable_segments:True added, so a plan can say when that is what makes a point fit,
  and once on an unbounded device (`unbounded`): the cache's high-water mark with no memory
  pressure, which no retry caps, so two configurations near the device's size still compare;
- cuBLAS's workspace, one per stream through the allocator (CublasHandlePool.cpp
  parseChosenWorkspaceSize): ':4096:2:16:8', 2 x 4096 + 8 x 16 KiB, before Hopper; 4096 x 8 KiB
  (32 MiB) on Hopper and Blackwell.
"""
from __future__ import annotations

import dataclasses
import os

from experiments.allocator import AllocatorConfig, Event, parse_conf, replay
from experiments.allocator.config import AllocatorConfigError
from experiments.points import ConfigError, Point

CUBLAS_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8", torch's default before sm90
CUBLAS_WORKSPACE_BYTES_SM90 = 4096 * 8 * 1024              # ":4096:8", Hopper (sm90) and Blackwell (sm100/sm120)
_SM90_AND_LATER = ("h100", "h200", "h800", "h20", "gh200", "b100", "b200", "gb200", "blackwell", "hopper")


def cublas_workspace_bytes(point: Point) -> int:
    """cuBLAS's workspace on the point's cluster's GPUs (0 for the local CPU cluster)."""
    cluster = point.cluster
    if cluster.get("device_memory_gb") is None:
        return 0
    words = f"{cluster.get('name', '')} {cluster.get('description', '')}".lower().replace("_", " ").split()
    return CUBLAS_WORKSPACE_BYTES_SM90 if any(w.strip(",:") in _SM90_AND_LATER for w in words) else CUBLAS_WORKSPACE_BYTES


def alloc_conf_from_env() -> AllocatorConfig:
    """PYTORCH_CUDA_ALLOC_CONF of this process (PYTORCH_ALLOC_CONF first, as torch 2.13 reads them)."""
    name = "PYTORCH_ALLOC_CONF" if "PYTORCH_ALLOC_CONF" in os.environ else "PYTORCH_CUDA_ALLOC_CONF"
    try:
        return parse_conf(os.environ.get(name, ""))
    except AllocatorConfigError as e:
        raise ConfigError(f"{name}: {e}") from None


def capacity_bytes(point: Point) -> int | None:
    """Bytes cudaMalloc can hand out on one of the cluster's GPUs (None: unknown device)."""
    device_gb = point.cluster.get("device_memory_gb")
    if device_gb is None:
        return None
    return int(device_gb * 1e9 - float(point.cluster.get("cuda_reserve_gb") or 0.0) * 1e9)


def _summary(result) -> dict:
    return {"reserved_peak_bytes": result.reserved_peak_bytes, "allocated_peak_bytes": result.allocated_peak_bytes,
            "segments_peak": result.segments_peak, "alloc_retries": result.alloc_retries, "oom": result.oom,
            "fragmentation": round(result.fragmentation, 6), "conf": result.config["PYTORCH_CUDA_ALLOC_CONF"]}


def reserved_memory(point: Point, events: list[Event], config: AllocatorConfig | None = None) -> dict:
    """The replay of a rank's event log on the point's device: under `config` (default: the
    environment's), and with expandable segments (`expandable`; the same when already on)."""
    config = config if config is not None else alloc_conf_from_env()
    capacity = capacity_bytes(point)
    main = replay(events, config, capacity)
    out = {**_summary(main), "requested_peak_bytes": main.requested_peak_bytes,
           "rounded_peak_bytes": main.rounded_peak_bytes, "events": main.events,
           "capacity_bytes": capacity, "cublas_workspace_bytes": cublas_workspace_bytes(point),
           "allocator": main.config, "oom_request_bytes": main.oom_request_bytes}
    out["unbounded"] = _summary(replay(events, config, None)) if capacity is not None else _summary(main)
    if config.expandable_segments:
        out["expandable"] = _summary(main)
    else:
        out["expandable"] = _summary(replay(events, dataclasses.replace(config, expandable_segments=True), capacity))
    return out
