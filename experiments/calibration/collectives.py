"""gloo's loopback collectives on this machine: latency and bandwidth per kind and world size,
measured on ranks started the way the sweep starts them (experiments.launch.spawn: forked, one
thread each, gloo), through the engine's own communicator (zero_impl/comm.py) with the exchange
on (EXCHANGE), so a reduce-scatter and an all-gather are the point-to-point exchanges the
cpu_default records ran (zero.gloo_point_to_point=true in conf/experiment/cpu_default.yaml),
the records the prediction check compares with. The engine's default is gloo's own calls.

Sizes follow the suite's counting convention (experiments/analysis/hardware.py): all_reduce,
reduce and broadcast the tensor, reduce_scatter its full input, all_gather its full output.
Each size is timed `repeats` times on the wall clock (a collective waits for its peers: no CPU
clock sees that), each call after a barrier and issued as the step issues it beside compute
(BUSY_S), the time it adds to that compute, the slowest rank's per repeat, then the mean: beside
compute a call waits 0 to one scheduler tick, and a step of several collectives pays the mean.

measure_overlap: how much of a collective hides under the rank's own compute. On a GPU NCCL
moves bytes on its own stream while the SMs compute; on a CPU rank gloo's threads copy, reduce
and push bytes through loopback TCP on the same cores the ranks compute on (one rank per core
here), so a collective issued async during compute may hide little or nothing. Measured per
kind as the step issues it (async, then the rank computes, then waits).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from experiments.launch import spawn
from zero_impl.comm import CommLedger, Communicator

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "reduce", "broadcast")
OVERLAP_KINDS = ("all_reduce", "reduce_scatter", "all_gather")  # the kinds the engine issues (async)
SIZES = tuple(2 ** p for p in (3, 7, 11, 15, 19, 21, 23, 24))  # bytes: 8 B (latency) to 16 MiB (bandwidth)
LATENCY_UP_TO = 2 ** 11  # sizes at or below this one measure the latency (2 KiB at 1 GB/s: 2 us of bytes)
BANDWIDTH_FROM = 2 ** 19  # sizes at or above this one measure the bandwidth
EXCHANGE = True  # cpu_default's zero.gloo_point_to_point: what the records the check reads ran
# Each call is timed as the step issues it, beside the rank's compute (issued_as_the_step_does).
# On this 2-core VM (Linux 6.18, CONFIG_HZ=250, PREEMPT_NONE) a 2 KiB gloo call issued from an idle
# barrier took 0.1-0.5 ms; issued after 1-6 ms of compute, most ended on a 4 ms scheduler tick
# counted from the barrier (after 6 ms: 1.8 ms, after 3 ms: 1.0 or 4.9 ms), as if gloo's woken
# thread ran only at a tick [assumption: the cause; the times are measured]; issued async under
# compute, each added 1.5-2.7 ms to it. Timed from the barrier alone, the calibration priced the
# stage-3 points' gathers at 0.15-0.35 ms a call; in their steps each added about 2 ms. A step's
# compute ends at any phase of the tick, so the repeats' compute spans BUSY_S evenly (from a
# layer's forward of the smallest sweep model, 1.5 ms here, over one 4 ms tick), and the mean
# over the repeats is kept.
BUSY_S = (0.0015, 0.0055)
BUSY_GEMM = 128


def _communicator() -> Communicator:
    if dist.get_world_size() < 2:  # a world of one issues no collective: nothing to time
        raise ValueError("collectives are calibrated at world sizes of 2 and more")
    return Communicator(None, CommLedger(), "calibration", point_to_point=EXCHANGE)


def _issue(comm: Communicator, kind: str, full: torch.Tensor, part: torch.Tensor, async_op: bool = False):
    """One collective of a kind the engine issues, as it issues it."""
    if kind == "all_reduce":
        return comm.all_reduce(full, "calibration", async_op=async_op)
    if kind == "reduce_scatter":
        return comm.reduce_scatter(part, full, "calibration", async_op=async_op)
    return comm.all_gather(full, part, "calibration", async_op=async_op)


def _call(comm: Communicator, kind: str, full: torch.Tensor, part: torch.Tensor) -> None:
    if kind in OVERLAP_KINDS:
        _issue(comm, kind, full, part)
    elif kind == "reduce":
        dist.reduce(full, dst=0)
    else:
        dist.broadcast(full, src=0)


def busy_seconds(repeat: int, repeats: int, span: tuple[float, float] = BUSY_S) -> float:
    """The compute before repeat `repeat` of `repeats`: the span's midpoints, evenly spaced."""
    low, high = span
    return low + (high - low) * (repeat + 0.5) / repeats


def busy(seconds: float, size: int = BUSY_GEMM) -> float:
    """Compute for `seconds` of wall clock (size x size fp32 GEMMs), as a rank does between the
    step's collectives; returns the seconds it took (the last GEMM ends past `seconds`). A clock,
    not a count: the ranks' compute ends together, so what is timed is the call, not one rank
    waiting for a slower one."""
    a, b, c = (torch.randn(size, size) for _ in range(3))
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        torch.mm(a, b, out=c)
    return time.perf_counter() - began


def issued_as_the_step_does(comm: Communicator, kind: str, full: torch.Tensor, part: torch.Tensor,
                            compute_s: float) -> float:
    """The seconds one call adds to `compute_s` of the rank's compute: a kind the engine issues
    async (OVERLAP_KINDS: stage 3's prefetched gathers, the overlapped reductions) issued, the
    compute run, then waited on; reduce and broadcast issued after the compute. Compute that the
    call's own copies slow is not seen (the compute is clock-bounded)."""
    if kind in OVERLAP_KINDS:
        began = time.perf_counter()
        work = _issue(comm, kind, full, part, async_op=True)
        computed = busy(compute_s)
        work.wait()
        return time.perf_counter() - began - computed
    busy(compute_s)
    began = time.perf_counter()
    _call(comm, kind, full, part)
    return time.perf_counter() - began


def _rank_times(kinds: tuple[str, ...], sizes: tuple[int, ...], repeats: int,
                busy_span: tuple[float, float] = BUSY_S) -> dict:
    """On every rank: {kind: {nbytes: [seconds per repeat]}}, each call issued after a barrier as
    the step issues it, under or after compute (issued_as_the_step_does, busy_seconds over
    `busy_span`)."""
    world, out = dist.get_world_size(), {}
    comm = _communicator()
    for kind in kinds:
        out[kind] = {}
        for nbytes in sizes:
            full = torch.ones(max(world, nbytes // 4))
            part = torch.empty(full.numel() // world)
            full = full[: part.numel() * world]
            _call(comm, kind, full, part)  # warm: gloo's pairs connect and buffers register on first use
            samples = []
            for i in range(repeats):
                dist.barrier()
                samples.append(issued_as_the_step_does(comm, kind, full, part, busy_seconds(i, repeats, busy_span)))
            out[kind][full.numel() * 4] = samples
    return out


def fit(times: dict[int, float]) -> dict[str, float]:
    """latency + bytes / bandwidth from {nbytes: mean seconds}: the latency is the median time
    of the sizes <= LATENCY_UP_TO, the bandwidth the median of nbytes / (t - latency) over the
    sizes >= BANDWIDTH_FROM whose bytes take longer than the latency (t >= 2 x latency; else the
    largest size alone): a size whose time is mostly the latency's tick wait says nothing of the
    bandwidth (t - latency near 0 or below it: a rate of any size)."""
    latency = statistics.median(t for n, t in times.items() if n <= LATENCY_UP_TO)
    large = {n: t for n, t in times.items() if n >= BANDWIDTH_FROM}
    bytes_bound = {n: t for n, t in large.items() if t >= 2 * latency} or {max(large): large[max(large)]}
    rates = [n / max(t - latency, 1e-12) for n, t in bytes_bound.items()]
    return {"latency_s": latency, "bytes_per_s": statistics.median(rates)}


# bandwidth-bound, as the stage-3 gathers and reduce-scatters of the sweep's tiny_* models (0.2-2 MB),
# and long (6-10 ms here) against the timings' noise, which the fraction is a difference of
OVERLAP_BYTES = 2 ** 23
OVERLAP_GEMM = 256       # the compute: OVERLAP_GEMM_CALLS square fp32 GEMMs of this size (~15 ms here, longer
OVERLAP_GEMM_CALLS = 40  # than any of the collectives at OVERLAP_BYTES: the whole collective could hide under it)


def hidden_fraction(compute_s: float, collective_s: float, together_s: float) -> float:
    """The fraction of a collective that concurrent compute hides: (compute alone + collective
    alone - both together) / collective alone, within [0, 1] (1: the collective costs nothing
    beside the compute; 0: it adds its whole time)."""
    return min(1.0, max(0.0, (compute_s + collective_s - together_s) / collective_s))


def _rank_overlap(kinds: tuple[str, ...], nbytes: int, repeats: int) -> dict:
    """On every rank: {kind: {"compute", "collective", "together": [seconds per repeat]}}."""
    world, out = dist.get_world_size(), {}
    comm = _communicator()
    a, b, c = (torch.randn(OVERLAP_GEMM, OVERLAP_GEMM) for _ in range(3))

    def compute() -> None:
        for _ in range(OVERLAP_GEMM_CALLS):
            torch.mm(a, b, out=c)

    def timed(fn) -> float:
        dist.barrier()
        began = time.perf_counter()
        fn()
        return time.perf_counter() - began
    for kind in kinds:
        part = torch.empty(nbytes // 4 // world)
        full = torch.ones(part.numel() * world)

        def issue(async_op: bool):
            return _issue(comm, kind, full, part, async_op)

        def together() -> None:
            work = issue(True)
            compute()
            work.wait()
        compute()  # warm: gloo's pairs connect and buffers register on first use
        issue(False)
        together()
        samples = {"compute": [], "collective": [], "together": []}
        for _ in range(repeats):  # interleaved: a burst of other work lands on all three
            samples["compute"].append(timed(compute))
            samples["collective"].append(timed(lambda: issue(False)))
            samples["together"].append(timed(together))
        out[kind] = samples
    return out


def measure_overlap(world: int, repeats: int = 15, kinds: tuple[str, ...] = OVERLAP_KINDS,
                    nbytes: int = OVERLAP_BYTES) -> dict:
    """{kind: {"hidden_fraction", "range", "nbytes", "compute_s", "collective_s", "together_s"}}:
    per repeat the slowest rank's three times and the fraction they give; kept, the median of
    those fractions (a burst of other work lands on one repeat's three timings together, so the
    fraction of each repeat is steadier than one of three medians taken apart), `range` their
    quartiles (the spread), and the three times' medians."""
    ranks = spawn(_rank_overlap, world, kinds, nbytes, repeats, backend="gloo", timeout=300)
    result = {}
    for kind in kinds:
        slowest = {part: [max(r[kind][part][i] for r in ranks) for i in range(repeats)]
                   for part in ("compute", "collective", "together")}
        fractions = [hidden_fraction(*(slowest[p][i] for p in ("compute", "collective", "together")))
                     for i in range(repeats)]
        medians = {part: statistics.median(v) for part, v in slowest.items()}
        q1, _, q3 = statistics.quantiles(fractions, n=4)
        result[kind] = {"hidden_fraction": statistics.median(fractions), "range": [q1, q3], "nbytes": nbytes,
                        **{f"{p}_s": v for p, v in medians.items()}}
    return result


def measure(world: int, repeats: int = 15, kinds: tuple[str, ...] = KINDS, sizes: tuple[int, ...] = SIZES) -> dict:
    """{kind: {"latency_s", "bytes_per_s", "times_s": {nbytes: mean seconds}}} at this world size."""
    ranks = spawn(_rank_times, world, kinds, sizes, repeats, backend="gloo", timeout=300)
    result = {}
    for kind in kinds:
        times = {n: statistics.mean(max(r[kind][n][i] for r in ranks) for i in range(repeats))
                 for n in ranks[0][kind]}
        result[kind] = {**fit(times), "times_s": times}
    return result
