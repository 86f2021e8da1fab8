"""sweep.py simulate=true: every point of an experiment simulated at its true world size, each
in a child process of its own (experiments/run/fake.py plays one rank), a few at a time."""
from __future__ import annotations

import functools
import signal
import sys
import time
from pathlib import Path
from typing import Callable

from experiments import records
from experiments.launch import ChildPool, default_workers
from experiments.points import Point, check_simulate_rank, simulated_precision
from experiments.run.fake import is_gpu_cluster, simulate_point
from experiments.run.record import simulated_path, simulated_record
from experiments.run.reserved import alloc_conf_from_env
from experiments.sweeps.progress import Progress
from experiments.sweeps.summary import (simulated_folder_summary_rows, simulated_summary_markdown, simulated_summary_rows,
                                        write_summary_csv)


def run_simulated(points: list[Point], results_dir: Path, *, rank: int = 0, workers: int | None = None,
                  on_start: Callable[[Point], object] | None = None,
                  on_done: Callable[[Point, dict], object] | None = None) -> list[dict]:
    """Simulate `points`, each in a process of its own (forked), `workers` at a time (default:
    the CPU count); write each record to results_dir/simulated/<point_id>.json as it ends."""
    pool = ChildPool(workers, what="simulation")
    pending, started, out = list(points), {}, {}

    def write(point_id: str, result: dict | None, error: str | None) -> dict:
        point, precision, began = started[point_id]
        record = finished_record(point, precision, result, error, began, rank)
        records.write_record(simulated_path(results_dir, point, rank), record)
        return record

    try:
        while pending or pool.running:
            while pending and pool.free:
                point = pending.pop(0)
                started[point.point_id] = (point, simulated_precision(point), records.now())
                submit_simulation(pool, point, started[point.point_id][1], rank)
                if on_start:
                    on_start(point)
            for point_id, ok, payload in pool.finished():
                out[point_id] = write(point_id, payload if ok else None, None if ok else payload)
                if on_done:
                    on_done(started[point_id][0], out[point_id])
    except KeyboardInterrupt:  # Ctrl-C: the running points' records say so (a re-run simulates them), then stop
        stop_running(pool, lambda point_id: write(point_id, None, INTERRUPTED))
        raise
    return [out[p.point_id] for p in points]


INTERRUPTED = "interrupted by the user (Ctrl-C)"


def finished_record(point: Point, precision: str, result: dict | None, error: str | None, began: str,
                    rank: int) -> dict:
    """A simulation's record as it ends: simulated_record, status `timeout` where the child ran
    past the point's train.timeout_s."""
    record = simulated_record(point, precision, result, error, began, rank)
    if error and "timed out" in error:
        record["status"] = "timeout"
    return record


def submit_simulation(pool: ChildPool, point: Point, precision: str, rank: int) -> None:
    """Start `point`'s simulation in a child of `pool` (keyed by its point id), deaf to Ctrl-C."""
    simulate = functools.partial(simulate_point, foreach=True if is_gpu_cluster(point) else None)
    pool.submit(point.point_id, point.train["timeout_s"], _deaf_to_ctrl_c, simulate, point.as_dict(), precision, rank)


def stop_running(pool: ChildPool, record_interrupted: Callable[[str], object]) -> None:
    """Ctrl-C: kill the running simulations at once (they ignore the signal) and record each one
    (by its key) as interrupted."""
    for job in pool.running:
        job.proc.kill()
        record_interrupted(job.key)


def _deaf_to_ctrl_c(fn: Callable[..., dict], *args) -> dict:
    """fn(*args) in a simulation's child, which ignores Ctrl-C: the terminal sends it to the whole
    process group, and the sweep answers it (it records the running points, then kills them);
    a child interrupted midway would print its own traceback, and keep the sweep waiting."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return fn(*args)


def done_record(results_dir: Path, point: Point, rank: int) -> dict | None:
    """The point's simulated record if it stands for this simulation (status ok or oom, the same
    rank), else None. A point's id leaves its cluster out, while its verdict (device memory,
    reserve) and "auto" precision depend on it: only a record of the same cluster and precision counts,
    and one with the caching allocator's replay (memory.reserved_peak_bytes) under this process's
    PYTORCH_CUDA_ALLOC_CONF."""
    existing = records.read_record(simulated_path(results_dir, point, rank))
    return existing if existing and stands_for(existing, point, rank) else None


def stands_for(record: dict, point: Point, rank: int) -> bool:
    """Whether a simulated record of `point`'s id stands for its simulation now (done_record)."""
    replayed = record.get("memory", {}).get("allocator") or {}
    return (record.get("config", {}).get("cluster") == point.cluster
            and record.get("precision") == simulated_precision(point)
            and replayed.get("conf") == alloc_conf_from_env().as_conf()
            and record.get("status") in ("ok", "oom") and record.get("simulated_rank") == rank)


def run_sweep_simulated(points: list[Point], results_dir: Path, *, rank: int = 0, workers: int = 0,
                        force: bool = False) -> int:
    """sweep.py simulate=true: every point simulated (those with an ok simulated record skipped
    unless force), records under results_dir/simulated/, a summary printed and written there."""
    check_simulate_rank(points, rank)
    todo = []
    for point in points:
        if not force and done_record(results_dir, point, rank):
            print(f"skip    {point.point_id}: simulated record exists (force=true re-runs it)", file=sys.stderr)
        else:
            todo.append(point)
    workers = workers or default_workers()
    started, progress = time.perf_counter(), Progress(len(todo), workers=workers)

    def done(point: Point, record: dict) -> None:
        wall = (record.get("simulation") or {}).get("wall_s")
        print(f"{record['status']:7s} {point.point_id}" + (f" ({wall:.0f} s)" if wall else "")
              + f" {progress.done(point.point_id)}", file=sys.stderr, flush=True)

    run_simulated(todo, results_dir, rank=rank, workers=workers, on_start=lambda point: progress.start(point.point_id),
                  on_done=done)
    print(simulated_summary_markdown(simulated_summary_rows(points, results_dir, rank)))
    every = simulated_folder_summary_rows(points, results_dir, rank)
    if every:
        write_summary_csv(every, results_dir / "simulated" / "summary.csv")
    print(f"simulated {len(todo)} points in {time.perf_counter() - started:.0f} s (rank {rank}); records and "
          f"summary.csv ({len(every)} points: every record in the folder) in {results_dir / 'simulated'}")
    return 0
