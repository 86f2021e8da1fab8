"""Measured all-reduce times on one node, in front of NCCL's tuning model.

NCCL's tuner (nccl.py) is NCCL's own estimate, and on an A100 node it is short of what
nccl-tests measures there by 25-40 us at the messages a Megatron layer all-reduces (1-16 MiB;
`nccl_check.md` sets the two side by side). Where a cluster profile names a measured table
(`all_reduce_table` in conf/cluster/<name>.yaml: nccl-tests' `all_reduce_perf` on that node, one
row per GPU count and size), an all-reduce whose group lies inside one node is read from it:

- between two measured sizes, linear in bytes (a collective's time is latency plus bytes over
  bandwidth, affine between neighbouring points);
- beyond the largest, that point's bus bandwidth carries it (the time scales with the bytes);
- below the smallest, at another GPU count, across nodes, and for every other collective: the
  tuner, unchanged.

The table's in-place times are read: torch.distributed.all_reduce reduces in place. A measured
point is one communicator alone on the node; the NVSwitch gives each GPU its own links, so
groups side by side on one node do not slow each other [assumption: the table has no
concurrent runs]. The table was measured under one NCCL release; a system of another release
reads it as it is (the release only moves the tuner's part).
"""
from __future__ import annotations

import csv
from bisect import bisect_left
from dataclasses import dataclass, replace
from pathlib import Path

from experiments.analysis.nccl import Nccl

REPO = Path(__file__).resolve().parents[2]
TABLE_COLUMNS = ("gpus", "size_bytes", "inplace_time_ns")


def read_table(path: str | Path) -> dict[int, tuple[tuple[float, float], ...]]:
    """An nccl-tests all-reduce table (results/external/vtrain_a100_allreduce.csv's columns; a
    path relative to the repository root) as {GPUs: ((bytes, seconds), ...)} in size order."""
    path = Path(path) if Path(path).is_absolute() else REPO / path
    points: dict[int, list[tuple[float, float]]] = {}
    with open(path, newline="") as f:
        rows = csv.DictReader(f)
        missing = [c for c in TABLE_COLUMNS if c not in (rows.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}: an all-reduce table needs the columns {', '.join(TABLE_COLUMNS)}; "
                             f"missing {', '.join(missing)}")
        for row in rows:
            points.setdefault(int(row["gpus"]), []).append((float(row["size_bytes"]), float(row["inplace_time_ns"]) * 1e-9))
    return {gpus: tuple(sorted(p)) for gpus, p in points.items()}


@dataclass(frozen=True)
class MeasuredAllReduce:
    """CollectiveModel: one node's measured all-reduce times (`table`: GPUs -> (bytes, seconds)
    in size order), NCCL's tuner (`tuner`) for everything the table does not hold (module
    docstring)."""

    table: dict[int, tuple[tuple[float, float], ...]]
    tuner: Nccl
    source: str

    def measured_s(self, nbytes: float, ranks: int) -> float | None:
        """The table's seconds for an all-reduce of nbytes over `ranks` GPUs of one node; None
        where it does not reach (another GPU count, below its smallest size)."""
        points = self.table.get(ranks)
        if not points or nbytes < points[0][0]:
            return None
        sizes = [size for size, _ in points]
        i = bisect_left(sizes, nbytes)
        if i == len(points):                      # beyond the largest: its bandwidth
            size, seconds = points[-1]
            return seconds * nbytes / size
        if sizes[i] == nbytes:
            return points[i][1]
        (s0, t0), (s1, t1) = points[i - 1], points[i]
        return t0 + (t1 - t0) * (nbytes - s0) / (s1 - s0)

    def time_s(self, kind: str, nbytes: float, ranks: int, ranks_per_node: int, concurrent: int = 1) -> float:
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        if kind == "all_reduce" and ranks <= ranks_per_node:
            measured = self.measured_s(nbytes, ranks)
            if measured is not None:
                return measured
        return self.tuner.time_s(kind, nbytes, ranks, ranks_per_node, concurrent)


def tuner_of(collectives: object) -> Nccl | None:
    """The NCCL tuning model behind a CollectiveModel (itself, or a measured table's fallback);
    None for a calibrated CPU profile."""
    if isinstance(collectives, MeasuredAllReduce):
        return collectives.tuner
    return collectives if isinstance(collectives, Nccl) else None


def with_tuner(collectives: object, tuner: Nccl) -> object:
    """`collectives` with `tuner` in place of its NCCL tuning model (another release, another
    latency scale): a measured table keeps its table."""
    return replace(collectives, tuner=tuner) if isinstance(collectives, MeasuredAllReduce) else tuner
