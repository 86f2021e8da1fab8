"""A local sweep: the grid's points one after another on this machine's ranks (forked processes,
or torchrun), each under its timeout; a failed, hung or out-of-memory point is recorded with its
status and the sweep goes on; points with an `ok` record are skipped unless force=true."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch
from tqdm import tqdm

import zero_impl
from experiments import records
from experiments.launch import spawn
from experiments.points import (ConfigError, Point, available_models, check_host_memory, check_runnable_here,
                                resolve_precision)
from experiments.run.real import checkpoint_root, train_rank, with_checkpoint_dir
from experiments.run.record import build_record, classify_failure, resume_line
from experiments.sweeps.summary import folder_summary_rows, print_summary, summary_rows, write_summary_csv

REPO = records.REPO


def run_local_sweep(points: list[Point], results_dir: Path, launcher: str, force: bool, name: str,
                    ignore_host_memory: bool = False) -> int:
    """Run every point not done yet, record each, then print and write the summary. A point
    predicted to need more memory than this host has available (points.check_host_memory) is
    recorded `invalid`, saying so, unless ignore_host_memory."""
    check_runnable_here(points)
    for point in tqdm(points, desc=name, unit="point", file=sys.stderr):
        if already_done(point, results_dir, force):
            tqdm.write(f"skip {point.point_id}: ok record exists (force=true re-runs it)", file=sys.stderr)
            continue
        try:
            if not ignore_host_memory:
                check_host_memory(point, point.gpus)  # every rank of a local point runs on this host
        except ConfigError as e:
            record_invalid(point, launcher, results_dir, e)
            continue
        record = run_point(point, launcher, results_dir)
        resumed = (record.get("resume") or {}).get("resumed_from")
        tqdm.write(f"{record['status']:7s} {point.point_id}" + (f" ({resume_line(record)})" if resumed else ""),
                   file=sys.stderr)
    print_summary(summary_rows(points, results_dir))
    every = folder_summary_rows(points, results_dir)
    write_summary_csv(every, results_dir / "summary.csv")
    print(f"records and summary.csv ({len(every)} points: every record in the folder) in {results_dir}")
    return 0


def record_invalid(point: Point, launcher: str, results_dir: Path, error: ConfigError) -> None:
    """Record a point refused before it started (`invalid`, with the refusal's line) and say so."""
    record = build_record(point, resolve_precision(point.train["precision"]), launcher, "invalid", None, str(error),
                          records.now())
    records.write_record(results_dir / f"{point.point_id}.json", record)
    tqdm.write(f"invalid {point.point_id}: {error}", file=sys.stderr)


def run_point(point: Point, launcher: str, results_dir: Path) -> dict:
    """Run one point on this machine and return its record (also written to results_dir)."""
    precision = resolve_precision(point.train["precision"])
    path = results_dir / f"{point.point_id}.json"
    started = records.now()
    if launcher == "auto":
        launcher = "spawn" if torch.cuda.is_available() else "fork"
    if launcher == "torchrun":
        return _run_with_torchrun(point, precision, path, started)
    root = checkpoint_root(point, results_dir)
    try:
        results = spawn(train_rank, point.gpus, with_checkpoint_dir(point, results_dir), precision, start_method=launcher,
                        timeout=point.train["timeout_s"])
        record = build_record(point, precision, launcher, "ok", results, None, started)
    except KeyboardInterrupt:
        _record_interrupted(point, precision, launcher, path, started)
        raise
    except Exception as e:  # a rank failed, died or hung: record it and go on
        status, text = classify_failure(e)
        latest = zero_impl.checkpoint.latest(root) if root.exists() else None
        record = build_record(point, precision, launcher, status, None, text, started,
                              resume={"checkpoint": str(latest) if latest else None})
    records.write_record(path, record)
    return record


def _run_with_torchrun(point: Point, precision: str, path: Path, started: str) -> dict:
    overrides = [f"{axis}={getattr(point, axis)}" for axis in ("stage", "gpus", "tp", "micro_batch")]
    # the base config matters not (every model.* key follows), only that it exists: a shaped
    # model (points.shaped_model) or the user's own name has none of its name
    base = point.model["name"].split("@")[0]
    overrides += [f"model={base if base in available_models() else available_models()[0]}",
                  f"experiment_name={point.experiment}", f"results_dir={path.parent.parent}",
                  "ignore_host_memory=true"]  # the sweep has checked the point's memory
    overrides += [f"model.{k}={_override_value(v)}" for k, v in point.model.items()]
    overrides += [f"cluster.{k}={_override_value(v)}" for k, v in point.cluster.items()]
    overrides += [f"train.{k}={_override_value(v)}" for k, v in point.train.items()]
    overrides += [f"zero.{k}={_override_value(v)}" for k, v in point.zero.items()]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={point.gpus}",
               str(REPO / "experiments" / "train.py"), *overrides]
    path.unlink(missing_ok=True)  # whatever record is there afterwards is this run's
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=point.train["timeout_s"])
        failure = None if proc.returncode == 0 else f"torchrun exited with {proc.returncode}:\n{stderr[-4000:]}"
        status = "fail"
    except KeyboardInterrupt:  # torchrun and its ranks have the terminal's Ctrl-C too, and write no record
        _record_interrupted(point, precision, "torchrun", path, started)
        raise
    except subprocess.TimeoutExpired:
        proc.terminate()  # torchrun passes TERM on to its workers (they run in sessions of their own)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        failure, status = f"timed out after {point.train['timeout_s']:.0f} s", "timeout"
    record = records.read_record(path)
    if record is None or (failure and record.get("status") == "ok"):  # the ranks could not say why
        record = build_record(point, precision, "torchrun", status, None, failure or "no record written", started)
        records.write_record(path, record)
    return record


def _record_interrupted(point: Point, precision: str, launcher: str, path: Path, started: str) -> None:
    """Ctrl-C: the running point's record says so (a re-run runs it again); the sweep then stops."""
    records.write_record(path, build_record(point, precision, launcher, "fail", None, "interrupted by the user (Ctrl-C)",
                                            started))


def _override_value(value) -> str:
    """A value as Hydra's override grammar reads it back unchanged."""
    if value is None:
        return "null"
    if isinstance(value, str):
        # Inside quotes Hydra unescapes only backslashes that precede a quote (or the end).
        quoted = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
        return "'" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, quoted) + "'"
    return str(value).lower() if isinstance(value, bool) else str(value)


def already_done(point: Point, results_dir: Path, force: bool) -> bool:
    """Whether the point has an ok record (force=true: never)."""
    existing = records.read_record(results_dir / f"{point.point_id}.json")
    return bool(existing) and existing.get("status") == "ok" and not force


