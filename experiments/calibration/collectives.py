"""gloo's loopback collectives on this machine: latency and bandwidth per kind and world size,
measured on ranks started the way the sweep starts them (experiments.launch.spawn: forked, one
thread each, gloo), through the calls the engine makes (zero_impl/comm.py).

Sizes follow the suite's counting convention (experiments/analysis/hardware.py): all_reduce,
reduce and broadcast the tensor, reduce_scatter its full input, all_gather its full output.
Each size is timed `repeats` times between barriers on the wall clock (a collective waits for
its peers: no CPU clock sees that), the slowest rank's time per repeat, then the median.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from experiments.launch import spawn

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "reduce", "broadcast")
SIZES = tuple(2 ** p for p in (3, 7, 11, 15, 19, 21, 23, 24))  # bytes: 8 B (latency) to 16 MiB (bandwidth)
LATENCY_UP_TO = 2 ** 11  # sizes at or below this one measure the latency (2 KiB at 1 GB/s: 2 us of bytes)
BANDWIDTH_FROM = 2 ** 19  # sizes at or above this one measure the bandwidth


def _call(kind: str, full: torch.Tensor, part: torch.Tensor) -> None:
    if kind == "all_reduce":
        dist.all_reduce(full)
    elif kind == "reduce_scatter":
        dist.reduce_scatter_single(part, full)
    elif kind == "all_gather":
        dist.all_gather_single(full, part)
    elif kind == "reduce":
        dist.reduce(full, dst=0)
    else:
        dist.broadcast(full, src=0)


def _rank_times(kinds: tuple[str, ...], sizes: tuple[int, ...], repeats: int) -> dict:
    """On every rank: {kind: {nbytes: [seconds per repeat]}}."""
    world, out = dist.get_world_size(), {}
    for kind in kinds:
        out[kind] = {}
        for nbytes in sizes:
            full = torch.ones(max(world, nbytes // 4))
            part = torch.empty(full.numel() // world)
            full = full[: part.numel() * world]
            _call(kind, full, part)  # warm: gloo's pairs connect and buffers register on first use
            samples = []
            for _ in range(repeats):
                dist.barrier()
                began = time.perf_counter()
                _call(kind, full, part)
                samples.append(time.perf_counter() - began)
            out[kind][full.numel() * 4] = samples
    return out


def fit(times: dict[int, float]) -> dict[str, float]:
    """latency + bytes / bandwidth from {nbytes: median seconds}: the latency is the median time
    of the sizes <= LATENCY_UP_TO, the bandwidth the median of nbytes / (t - latency) over the
    sizes >= BANDWIDTH_FROM."""
    latency = statistics.median(t for n, t in times.items() if n <= LATENCY_UP_TO)
    rates = [n / max(t - latency, 1e-12) for n, t in times.items() if n >= BANDWIDTH_FROM]
    return {"latency_s": latency, "bytes_per_s": statistics.median(rates)}


def measure(world: int, repeats: int = 15, kinds: tuple[str, ...] = KINDS, sizes: tuple[int, ...] = SIZES) -> dict:
    """{kind: {"latency_s", "bytes_per_s", "times_s": {nbytes: median seconds}}} at this world size."""
    ranks = spawn(_rank_times, world, kinds, sizes, repeats, backend="gloo", timeout=300)
    result = {}
    for kind in kinds:
        times = {n: statistics.median(max(r[kind][n][i] for r in ranks) for i in range(repeats))
                 for n in ranks[0][kind]}
        result[kind] = {**fit(times), "times_s": times}
    return result
