"""This machine's measured profile, as the dict `make calibrate` writes to
results/calibration/<hostname>.yaml (loaded by experiments/analysis/calibrated.py).

It is a measurement of one machine at one time, at the sweep's thread count: never a constant
that holds elsewhere. The file says so, and where and when it was measured.
"""
from __future__ import annotations

import datetime
import os
import platform
import socket
import statistics

import torch

from experiments.calibration import collectives, compute, framework

SWEEP_MODELS = ("tiny_s", "tiny_m", "tiny_l")  # the cpu_default grid's models (conf/experiment/cpu_default.yaml)
SWEEP_MICRO_BATCH = 4
STREAM_BYTES = 256 * 2 ** 20  # per array: far beyond the 2 MiB L2 per core this VM's ranks get
RANK_THREADS = 1  # the sweep's ranks are forked with torch.set_num_threads(1) (experiments/launch.py)
# the compute measurements are taken this many times, interleaved, and their medians kept: one
# burst of other work on a shared machine then moves one round, not the profile, and the rounds'
# spread says how steady the machine was
ROUNDS = 3


def spread(values: list[float]) -> float:
    """(max - min) / median of repeated measurements of one quantity."""
    return (max(values) - min(values)) / statistics.median(values)


def median_of_rounds(rounds: list[dict]) -> tuple[dict, dict]:
    """The profile's compute entries as the medians of `rounds` (each {"op_floor", "stream", "gemm"}),
    and their spread: per op-floor field, the stream rate, and the median and largest over GEMM shapes."""
    floor = {k: statistics.median(r["op_floor"][k] for r in rounds) for k in rounds[0]["op_floor"]}
    stream = statistics.median(r["stream"] for r in rounds)
    gemm = []
    for i, entry in enumerate(rounds[0]["gemm"]):
        rates = [r["gemm"][i]["flops_per_s"] for r in rounds]
        gemm.append({**entry, "seconds": statistics.median(r["gemm"][i]["seconds"] for r in rounds),
                     "flops_per_s": statistics.median(rates), "spread": round(spread(rates), 4)})
    gemm_spreads = [g["spread"] for g in gemm]
    return ({"op_floor": floor, "stream": stream, "gemm": gemm},
            {"rounds": len(rounds), "op_floor_forward": round(spread([r["op_floor"]["forward_s"] for r in rounds]), 4),
             "stream": round(spread([r["stream"] for r in rounds]), 4),
             "gemm_median": round(statistics.median(gemm_spreads), 4), "gemm_max": round(max(gemm_spreads), 4)})


def runnable_worlds() -> list[int]:
    """World sizes whose collectives are measured: 2, and 4 only with 4 cores or more. More
    ranks than cores time-share the cores (each rank half a core at world 4 on 2 cores, a
    collective waiting on a descheduled peer): that is the scheduler's cost, not the machine's,
    and the step-time model, one device per rank, has no term for it."""
    return [w for w in (2, 4) if w <= (os.cpu_count() or 1)]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def measure_profile(worlds: list[int] | None = None, rounds: int = ROUNDS) -> dict:
    """Every measurement of the profile (about two minutes on 2 shared cores): the compute ones
    `rounds` times, interleaved, their medians kept and their spread recorded (`spread`)."""
    torch.set_num_threads(RANK_THREADS)
    shapes = compute.sweep_gemm_shapes(list(SWEEP_MODELS), SWEEP_MICRO_BATCH)
    shapes += [(1, s, s, s) for s in compute.SQUARE_SIZES if (1, s, s, s) not in shapes]
    measured, spreads = median_of_rounds([
        {"op_floor": compute.measure_op_floor(), "stream": compute.measure_stream_bytes_per_s(STREAM_BYTES),
         "gemm": compute.measure_gemms(shapes)} for _ in range(rounds)])
    work = framework.measure()
    spreads["framework_step"] = work.pop("spread")
    worlds = runnable_worlds() if worlds is None else worlds
    overlap = {w: collectives.measure_overlap(w) for w in worlds}
    if overlap:  # how far apart the repeats' hidden fractions were (a fraction: absolute, not relative)
        spreads["collective_overlap"] = round(max(v["range"][1] - v["range"][0]
                                                  for kinds in overlap.values() for v in kinds.values()), 4)
    return {
        "host": socket.gethostname(), "cpu": cpu_model(), "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch": str(torch.__version__), "threads": RANK_THREADS, "dtype": "float32",
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "note": "measured by `make calibrate` on this host at this date; valid for this machine only",
        "op_floor": measured["op_floor"],
        "framework": work,
        "stream": {"array_bytes": STREAM_BYTES, "bytes_per_s": measured["stream"]},
        "gemm": measured["gemm"],
        "spread": spreads,
        "collectives": {w: collectives.measure(w) for w in worlds},
        "collective_overlap": overlap,
    }
