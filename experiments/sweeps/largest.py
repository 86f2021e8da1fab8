"""The largest model that fits, by search: analytic bracket, simulated confirmation.

    python experiments/sweep.py experiment=table2 simulate=true simulate_largest=true
    python experiments/sweep.py experiment=fig4 simulate=true simulate_largest=true
    python experiments/sweep.py experiment=fig6 simulate=true simulate_largest=true

For each row of an experiment (for each (stage, TP, GPUs, ZeRO-R configuration) the point with
the most parameters: Table 2's ten rows; Figure 4's largest ZeRO and baseline points; Figure 6's
C1-C5), the model family of that row
(its hidden size, heads, sequence and vocabulary fixed, the number of layers varied, as the
paper's Table 4 and appendix grow a model) is searched for the most layers whose simulated
reserved peak (the caching allocator's replay; the tensor peak where none) plus the cluster's
CUDA reserve fits the device:

1. the analytic model (points.predicted_memory_bytes) gives the largest fitting depth L_a;
2. rank `simulate_rank` of the full world is simulated (experiments/run/fake.py) at L_a, then at
   the depth where the line through the two simulated peaks nearest the limit (one peak and the
   analytic per-layer slope at first) crosses it, until a fitting depth L and a failing L + 1
   are both simulated: tensor memory grows almost linearly with depth, so that takes 2-4
   simulations. Where the records replayed the caching allocator, the reserved peak is not
   linear (it flattens just under the limit while retries free the cache): until a depth fails
   the search goes as far as the tensors' own line allows, then halves the bracket, which
   takes more (the committed searches: 4.5 a row for Table 2, 7.8 for Figure 6). At most
   `MAX_SIMULATIONS` per row.

Each simulation's record is written to <experiment>/simulated/search/ as it ends; Ctrl-C kills
the running ones and records them as interrupted. A row's search starts from the records of its
family already there (or under simulated/, a finished search's), so the same command again goes
on where it stopped. When the search ends, the largest fitting candidate's record moves to
<experiment>/simulated/ with a `largest_search` entry (every simulated depth, the analytic
bracket, the paper's number); the other candidates' stay in search/. reports: the `largest`
table, Table 2's simulated columns.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path

import pandas as pd

from experiments import records
from experiments.launch import ChildPool
from experiments.models.gpt_shape import parameter_count
from experiments.points import Point, check_simulate_rank, predicted_memory_bytes, simulated_precision
from experiments.reports.tables import optimizer_step_of
from experiments.run.record import simulated_path, verdict
from experiments.sweeps.progress import Progress
from experiments.sweeps.simulated import (INTERRUPTED, finished_record, stands_for, stop_running,
                                          submit_simulation)
from experiments.sweeps.summary import largest_markdown
from zero_impl import zero_r_config

MAX_SIMULATIONS = 10
MAX_LAYERS = 4096
PAPER_DIR = records.REPO / "results" / "paper"


def family_point(point: Point, layers: int) -> Point:
    """`point` with its model grown or shrunk to `layers` layers (hidden, heads, seq, vocab kept)."""
    model = dict(point.model, layers=layers, name=f"{point.model['name']}@L{layers}", label="")
    return dataclasses.replace(point, model=model, note=f"largest {point.model['name']} family")


def _row_key(p: Point) -> tuple:
    """A row: stage, TP, GPUs, ZeRO-R configuration (Figure 6 has one row per C1-C5) and the
    optimizer's update size (Table 2 searches each baseline with a whole and a chunked step)."""
    return p.stage, p.tp, p.gpus, _zero_r_name(p), p.zero.get("optimizer_bucket_size")


def _zero_r_name(p: Point) -> str | None:
    z = p.zero
    return zero_r_config(p.stage, z.get("partition_activations", False), z.get("cpu_checkpointing", False),
                         z.get("contiguous_memory_optimization", False))


def rows_to_search(points: list[Point]) -> list[Point]:
    """For each row (_row_key), the point with the most parameters."""
    best: dict[tuple, Point] = {}
    for p in points:
        key = _row_key(p)
        if key not in best or parameter_count(p.shape, p.tp) > parameter_count(best[key].shape, best[key].tp):
            best[key] = p
    return [p for p in points if best.get(_row_key(p)) is p]


def limit_bytes(point: Point) -> float:
    """Device bytes left for tensors: device memory less the CUDA reserve."""
    v = verdict(point, 0)
    if v["device_bytes"] is None:
        raise ValueError(f"point ({point.describe()}): its cluster has no device_memory_gb; nothing to fit")
    return v["device_bytes"] - v["cuda_reserve_bytes"]


def analytic_max_layers(point: Point, precision: str) -> int:
    """The most layers whose analytic peak fits (0: not even one)."""
    limit = limit_bytes(point)

    def fits(layers: int) -> bool:
        return predicted_memory_bytes(family_point(point, layers), precision)["total"] <= limit

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= MAX_LAYERS and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, MAX_LAYERS + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def paper_largest(point: Point) -> str:
    """The paper's largest trained model for the row: Table 2's measured columns, or Figure 4's
    text (13B with ZeRO-100B without MP; 1.4B with DP alone)."""
    if point.experiment == "table2":
        table = pd.read_csv(PAPER_DIR / "table2_max_model_size.csv", dtype=str)
        row = table[table["mp"] == str(point.tp)]
        column = {0: "measured_baseline", 1: "measured_ZeRO-DP_Pos"}.get(point.stage)
        return row.iloc[0][column] if column and len(row) else "-"
    if point.experiment == "fig4":
        return {2: "13B (Sec 10.4)", 0: "1.4B (Sec 1, 10.4)"}.get(point.stage, "-")
    if point.experiment == "fig6":  # Sec 10.5; C3's size is inferred from appendix Table 7
        return {"C1": "40B", "C2": "60B", "C3": "50B (inferred)", "C4": "140B", "C5": "150B"}.get(
            _zero_r_name(point) or "", "-")
    return "-"


def held_bytes(record: dict, limit: float) -> tuple[int, bool]:
    """What a simulated depth must fit within `limit` (the device less the CUDA reserve), and
    whether it does, as the record decided it (run/record.verdict): the caching allocator's
    reserved peak where the record replayed it (a replay that ran out of memory holds its
    unbounded peak, which no device caps, so the line through the depths keeps rising), else the
    tensor peak."""
    memory = record["memory"]
    allocator = memory.get("allocator")
    if not allocator:
        return memory["peak_bytes"], memory["peak_bytes"] <= limit
    fits = bool(memory.get("fits"))  # the verdict counts a replay that ran out of memory as not fitting
    held = allocator["reserved_peak_bytes"] if fits else \
        max(allocator.get("unbounded", allocator)["reserved_peak_bytes"], int(limit) + 1)
    return held, fits


class Search:
    """The search state of one row."""

    def __init__(self, row: Point, max_simulations: int = MAX_SIMULATIONS) -> None:
        self.row, self.max_simulations = row, max_simulations
        self.precision = simulated_precision(row)
        self.limit = limit_bytes(row)
        self.analytic_layers = analytic_max_layers(row, self.precision)
        self.peaks: dict[int, int] = {}           # layers -> the simulated bytes that must fit (held_bytes)
        self.fits: dict[int, bool] = {}           # layers -> the record's verdict
        self.records: dict[int, dict] = {}
        self.failed: str | None = None
        self.stalled = False   # the next depth was simulated already (a peak not monotonic in depth)
        self.pending: int | None = None

    def resume(self, found: dict[int, dict]) -> None:
        """Start from the records of this row's family simulated before (depth -> record)."""
        for layers, record in found.items():
            self.peaks[layers], self.fits[layers] = held_bytes(record, self.limit)
            self.records[layers] = record

    def _analytic(self, layers: int) -> float:
        return predicted_memory_bytes(family_point(self.row, layers), self.precision)["total"]

    @property
    def bracket(self) -> tuple[int, int | None]:
        fit = [n for n in self.peaks if self.fits[n]]
        fail = [n for n in self.peaks if not self.fits[n]]
        return max(fit, default=0), min(fail, default=None)

    @property
    def done(self) -> bool:
        lo, hi = self.bracket
        return (bool(self.failed) or self.stalled or (hi is not None and hi <= lo + 1)
                or len(self.peaks) >= self.max_simulations)

    def next_layers(self) -> int | None:
        if self.done or self.pending is not None:
            return None
        if not self.peaks:
            return max(1, self.analytic_layers)
        lo, hi = self.bracket
        nearest = sorted(self.peaks.items(), key=lambda kv: abs(kv[1] - self.limit))[:2]
        guess = self._line_to_limit(*nearest)
        if guess in self.peaks:  # the line says this one; test its neighbour across the limit
            guess = guess + 1 if self.fits[guess] else guess - 1
        if hi is None and self._replayed():
            # nothing failed yet: a replayed reserved peak flattens just under the limit (the
            # allocator frees its cache and retries) while the tensors keep rising and never
            # exceed it, so the tensors' line to the limit is the farthest depth that may fit
            guess = max(guess, self._tensor_line())
        guess = max(guess, lo + 1)
        if hi is not None:
            guess = min(guess, hi - 1)
            if lo and self._replayed():  # reserved peaks are not linear in depth (flat under the limit
                guess = (lo + hi) // 2   # where retries free the cache): halve the bracket
        guess = max(1, min(guess, MAX_LAYERS))
        if guess in self.peaks:
            self.stalled = True
            return None
        return guess

    def _replayed(self) -> bool:
        return any(r["memory"].get("allocator") for r in self.records.values())

    def _tensor_line(self) -> int:
        """The depth where the line through the two deepest simulated tensor peaks (one and the
        analytic slope at first) reaches the limit."""
        tensors = sorted((n, r["memory"]["peak_bytes"]) for n, r in self.records.items())[-2:]
        return self._line_to_limit(*reversed(tensors))

    def _line_to_limit(self, anchor: tuple[int, float], other: tuple[int, float] | None = None) -> int:
        """The depth where the line through (layers, peak) `anchor` and `other` (without another
        point: the analytic per-layer slope at the anchor) reaches the limit; one past the anchor
        when the line does not rise."""
        n0, p0 = anchor
        if other is not None and other[0] != n0:
            slope = (other[1] - p0) / (other[0] - n0)
        else:
            slope = self._analytic(n0 + 1) - self._analytic(n0)
        return n0 + int((self.limit - p0) // slope) if slope > 0 else n0 + 1

    def result(self) -> dict:
        lo, hi = self.bracket
        row = self.row
        params = parameter_count(family_point(row, lo).shape, row.tp) if lo else 0
        return {
            "row_point_id": row.point_id, "experiment": row.experiment, "row_model": row.model["name"],
            "stage": row.stage, "tp": row.tp, "gpus": row.gpus, "dp": row.dp, "micro_batch": row.micro_batch,
            "optimizer_step": optimizer_step_of(row.zero),   # whole or chunked: Table 2 searches its baselines both ways
            "hidden": row.shape.hidden, "heads": row.shape.heads, "precision": self.precision,
            "limit_bytes": self.limit,
            "analytic_max_layers": self.analytic_layers,
            "analytic_max_params": parameter_count(family_point(row, self.analytic_layers).shape, row.tp)
            if self.analytic_layers else 0,
            "simulated_max_layers": lo, "simulated_max_params": params,
            "confirmed": hi == lo + 1 if hi is not None else False,
            "simulations": [{"layers": n, "params": parameter_count(family_point(row, n).shape, row.tp),
                             "peak_bytes": self.records[n]["memory"]["peak_bytes"] if n in self.records else p,
                             "held_bytes": p, "fits": self.fits[n]} for n, p in sorted(self.peaks.items())],
            "paper": paper_largest(row), "error": self.failed,
        }


def remaining_simulations(search: Search) -> tuple[int, bool]:
    """The simulations an open row's search still runs (the one running included), and whether
    that is only a lower bound. With a fitting depth lo and a failing one hi the search narrows
    (lo, hi) to one layer, about halving it each time (the line to the limit, or the halving
    where the allocator was replayed): ceil(log2(hi - lo)) more. With no failing depth yet the
    range is open: at least one more (a failing depth), two where nothing was simulated. With a
    failing depth and none fitting, the range below hi is bisected: ceil(log2(hi)). At most the
    row's max_simulations."""
    if search.done:
        return 0, False
    lo, hi = search.bracket
    cap = search.max_simulations - len(search.peaks)
    if hi is None:
        return min(1 if search.peaks else 2, cap), True
    return min(max(1, math.ceil(math.log2(hi - lo))), cap), False


def expected_simulations(searches: list[Search]) -> tuple[int, bool]:
    """The simulations the open rows still run (remaining_simulations summed), and whether that
    is a lower bound (one row's is)."""
    left = [remaining_simulations(s) for s in searches]
    return sum(n for n, _ in left), any(bound for _, bound in left)


def search_path(results_dir: Path, point: Point, rank: int) -> Path:
    """Where a candidate's record is written as its simulation ends."""
    path = simulated_path(results_dir, point, rank)
    return path.parent / "search" / path.name


def found_records(results_dir: Path, searches: list[Search], rank: int) -> dict[Search, dict[int, dict]]:
    """For each search, the records of its row's family that stand for a simulation now (under
    simulated/search/, or simulated/ where a search ended), by depth; interrupted and failed ones
    do not (simulated.stands_for), and are simulated again."""
    folder = results_dir / "simulated"
    saved = [(path.name, record) for path in sorted(folder.glob("search/*.json")) + sorted(folder.glob("*.json"))
             for record in [records.read_record(path)] if record]
    found: dict[Search, dict[int, dict]] = {s: {} for s in searches}
    for s in searches:
        for name, record in saved:
            layers = record.get("config", {}).get("model", {}).get("layers")
            point = family_point(s.row, layers) if isinstance(layers, int) else None
            if point is not None and simulated_path(results_dir, point, rank).name == name \
                    and stands_for(record, point, rank):
                found[s][layers] = record
    return found


def run_largest(points: list[Point], results_dir: Path, *, rank: int = 0, workers: int | None = None,
                max_simulations: int = MAX_SIMULATIONS) -> list[dict]:
    """Search every row (rows_to_search), up to `workers` simulations at once, each row from the
    records already there (found_records); write each record as its simulation ends (Ctrl-C:
    the running ones as interrupted), then move each row's largest fitting one to simulated/ and
    return each row's result."""
    pool = ChildPool(workers, what="simulation")
    searches = [Search(row, max_simulations) for row in rows_to_search(points)]
    for s, found in found_records(results_dir, searches, rank).items():
        s.resume(found)
    reused = sum(len(s.peaks) for s in searches)
    if reused:
        print(f"reusing {reused} simulated depths of an earlier search ({results_dir / 'simulated' / 'search'})",
              file=sys.stderr)
    started: dict[str, tuple[Search, Point, str]] = {}
    progress = Progress(0, "simulations")

    def revise() -> None:
        """The total from each open row's range; a row simulates one depth at a time, so no more
        run at once than there are open rows."""
        left, lower_bound = expected_simulations(searches)
        progress.total, progress.qualifier = progress.finished + left, "at least" if lower_bound else "about"
        progress.workers = min(pool.workers, sum(not s.done for s in searches))

    revise()

    def finish(point_id: str, result: dict | None, error: str | None) -> dict:
        s, point, began = started[point_id]
        record = finished_record(point, s.precision, result, error, began, rank)
        records.write_record(search_path(results_dir, point, rank), record)
        return record

    try:
        while any(not s.done for s in searches) or pool.running:
            for s in searches:
                if not pool.free:
                    break
                layers = s.next_layers()
                if layers is None:
                    continue
                point = family_point(s.row, layers)
                s.pending = layers
                started[point.point_id] = (s, point, records.now())
                submit_simulation(pool, point, s.precision, rank)
                progress.start(point.point_id)
            for point_id, ok, payload in pool.finished():
                s, point, _ = started[point_id]
                s.pending = None
                record = finish(point_id, payload if ok else None, None if ok else payload)
                if ok:
                    s.peaks[point.shape.layers], s.fits[point.shape.layers] = held_bytes(record, s.limit)
                    s.records[point.shape.layers] = record
                else:
                    s.failed = payload
                progress.done(point_id)
                revise()
                line = (f"{record['status']:7s} {point.point_id}: {point.shape.layers} layers, "
                        f"{record['params'] / 1e9:.2f}B, peak {record['memory']['peak_bytes'] / 1e9:.2f} GB "
                        f"({payload.get('wall_s', 0):.0f} s)") if ok else \
                    f"fail    {point.point_id}: {payload.splitlines()[-1] if payload else ''}"
                print(f"{line} {progress.status()}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:  # the finished simulations' records are written; the running ones say so
        stop_running(pool, lambda point_id: finish(point_id, None, INTERRUPTED))
        raise
    results = []
    for s in searches:
        result = s.result()
        for layers, record in s.records.items():
            point = family_point(s.row, layers)
            top, searched = simulated_path(results_dir, point, rank), search_path(results_dir, point, rank)
            kept, other = (top, searched) if layers == result["simulated_max_layers"] else (searched, top)
            record.pop("largest_search", None)  # an earlier search's largest, no longer
            if kept is top:
                record["largest_search"] = result
            records.write_record(kept, record)
            other.unlink(missing_ok=True)
        results.append(result)
    return results


def run_sweep_largest(points: list[Point], results_dir: Path, *, rank: int = 0, workers: int = 0) -> int:
    """sweep.py simulate=true simulate_largest=true."""
    check_simulate_rank(points, rank)
    started = time.perf_counter()
    results = run_largest(points, results_dir, rank=rank, workers=workers or None)
    print(largest_markdown(results))
    print(f"searched {len(results)} rows in {time.perf_counter() - started:.0f} s; records in {results_dir / 'simulated'}")
    return 0
