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

import torch

from experiments.calibration import collectives, compute, framework

SWEEP_MODELS = ("tiny_s", "tiny_m", "tiny_l")  # the cpu_default grid's models (conf/experiment/cpu_default.yaml)
SWEEP_MICRO_BATCH = 4
STREAM_BYTES = 256 * 2 ** 20  # per array: far beyond the 2 MiB L2 per core this VM's ranks get
RANK_THREADS = 1  # the sweep's ranks are forked with torch.set_num_threads(1) (experiments/launch.py)


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


def measure_profile(worlds: list[int] | None = None) -> dict:
    """Every measurement of the profile (about a minute on 2 shared cores)."""
    torch.set_num_threads(RANK_THREADS)
    shapes = compute.sweep_gemm_shapes(list(SWEEP_MODELS), SWEEP_MICRO_BATCH)
    shapes += [(1, s, s, s) for s in compute.SQUARE_SIZES if (1, s, s, s) not in shapes]
    floor = compute.measure_op_floor()
    worlds = runnable_worlds() if worlds is None else worlds
    return {
        "host": socket.gethostname(), "cpu": cpu_model(), "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch": str(torch.__version__), "threads": RANK_THREADS, "dtype": "float32",
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "note": "measured by `make calibrate` on this host at this date; valid for this machine only",
        "op_floor": floor,
        "framework": framework.measure(),
        "stream": {"array_bytes": STREAM_BYTES, "bytes_per_s": compute.measure_stream_bytes_per_s(STREAM_BYTES)},
        "gemm": compute.measure_gemms(shapes),
        "collectives": {w: collectives.measure(w) for w in worlds},
    }
