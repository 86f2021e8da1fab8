"""The summaries a sweep prints and writes beside its records: the measured grid's Table-5-style
table, the simulated points' table, and the largest-model search's table."""
from __future__ import annotations

import csv
import os
from collections.abc import Callable
from pathlib import Path

from experiments import records
from experiments.points import Point
from experiments.reports.tables import optimizer_step_of, peak_breakdown_gb, theory_elements_per_step
from experiments.run.record import MEASURED_BY, simulated_path


def summary_row(record: dict, point: Point | None = None) -> dict:
    """One row of the Table-5-style summary, from a record (and the point that has none yet)."""
    memory, comm, ok = record.get("memory", {}), record.get("comm", {}), record.get("status") == "ok"
    measured, gb = memory.get("measured_max_over_ranks", {}), 1e9
    if point is not None:
        shape = {"model": point.model["name"], "gpus": point.gpus, "tp": point.tp, "dp": point.dp,
                 "stage": point.stage, "batch": point.global_batch, "point_id": point.point_id}
    else:
        shape = {"model": record["model"]["name"], "gpus": record["world_size"], "tp": record["tp"],
                 "dp": record["dp"], "stage": record["stage"], "batch": record["global_batch"],
                 "point_id": record["point_id"]}
    return {
        "model": shape["model"], "params_B": round(record.get("params", 0) / 1e9, 4),
        "gpus": shape["gpus"], "tp": shape["tp"], "dp": shape["dp"], "stage": shape["stage"],
        "batch": shape["batch"], "tflops_per_gpu": record.get("tflops_per_gpu"),
        "mem_pred_GB": memory.get("predicted", {}).get("total", 0) / gb,
        "mem_meas_GB": measured.get("total", 0) / gb if ok else None,
        "peak_GB": measured.get("peak_bytes", 0) / gb if ok else None,
        "comm_elements": comm.get("elements_per_step"), "comm_theory": theory_elements_per_step(record),
        "status": record.get("status", "missing"), "point_id": shape["point_id"]}


def summary_rows(points: list[Point], results_dir: Path) -> list[dict]:
    """The sweep's points, in order: each one's record, or `missing`."""
    return [summary_row(records.read_record(results_dir / f"{p.point_id}.json") or {}, p) for p in points]


def _folder_rows(folder: Path, row: Callable[[dict], dict], sweep: dict[tuple[str, int], dict]) -> list[dict]:
    """Every record in `folder` (earlier sweeps' too) as `row` makes it, then the sweep's rows (by
    point id and simulated rank) that have no record yet: what summary.csv beside the records holds.
    Keyed by rank too, as a simulated folder holds a point's record of each rank simulated."""
    rows = {}
    for path in sorted(folder.glob("*.json")):
        record = records.read_record(path)
        if record is not None and "point_id" in record:
            rows[record["point_id"], record.get("simulated_rank", 0)] = row(record)
    for key, sweep_row in sweep.items():
        rows.setdefault(key, sweep_row)
    return list(rows.values())


def folder_summary_rows(points: list[Point], results_dir: Path) -> list[dict]:
    """summary.csv of a measured sweep's folder: every record in it, then this sweep's points that have none."""
    sweep = {(p.point_id, 0): row for p, row in zip(points, summary_rows(points, results_dir))}
    return _folder_rows(results_dir, summary_row, sweep)


def print_summary(rows: list[dict]) -> None:
    print("| model | params (B) | GPUs | TP | DP | stage | batch | TFLOPs/GPU | model states/GPU pred | meas "
          "| peak/GPU | comm/step | theory | status |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        tflops = f"{r['tflops_per_gpu']:.4f}" if r["tflops_per_gpu"] is not None else "-"
        meas = format_bytes(r["mem_meas_GB"] * 1e9) if r["mem_meas_GB"] is not None else "-"
        peak = format_bytes(r["peak_GB"] * 1e9) if r["peak_GB"] else "-"
        comm = f"{r['comm_elements']:,}" if r["comm_elements"] is not None else "-"
        theory = f"{r['comm_theory']:,}" if r["comm_theory"] is not None else "-"
        print(f"| {r['model']} | {r['params_B']:.4f} | {r['gpus']} | {r['tp']} | {r['dp']} | {r['stage']} | {r['batch']} "
              f"| {tflops} | {format_bytes(r['mem_pred_GB'] * 1e9)} | {meas} | {peak} | {comm} | {theory} | {r['status']} |")


def point_summary_line(path: Path) -> str:
    """One trained point in a line, as train.py prints it on success: status, speed, memory, traffic, the record."""
    record = records.read_record(path) or {}
    row = summary_row(record)
    tflops = f"{row['tflops_per_gpu']:.4f} TFLOPs/GPU" if row["tflops_per_gpu"] is not None else "no TFLOPs"
    step = f"{record['step_time_s']:.3f} s/step" if record.get("step_time_s") is not None else "no step time"
    peak = format_bytes(row["peak_GB"] * 1e9) if row["peak_GB"] else "-"
    comm = f"{row['comm_elements']:,}" if row["comm_elements"] is not None else "-"
    return (f"{row['status']}: {row['model']} stage {row['stage']} on {row['gpus']} rank{'s' if row['gpus'] != 1 else ''} (TP {row['tp']}): {step}, "
            f"{tflops}, peak {peak}/rank, {comm} elements/step; record {path}")


def format_bytes(n: float) -> str:
    """Bytes as the summaries print them: 2.00 GB, 3.10 MB, 512 B."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def write_summary_csv(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def simulated_summary_row(r: dict, point: Point | None = None, rank: int = 0) -> dict:
    """One row of the simulated points' summary, from a record (and the point and rank that have none yet)."""
    config = point.as_dict() if point is not None else r["config"]
    mem, comm = r.get("memory", {}), r.get("comm", {})
    gb = 1e9
    breakdown = peak_breakdown_gb(mem)
    return {
        "model": config["model"]["name"], "params_B": round(r.get("params", 0) / gb, 3), "gpus": config["gpus"],
        "tp": config["tp"], "dp": config["gpus"] // config["tp"], "stage": config["stage"],
        "micro_batch": config["micro_batch"], "optimizer_step": optimizer_step_of(config["zero"]),
        "note": config["note"], "precision": r.get("precision"),
        "peak_GB": mem["peak_bytes"] / gb if "peak_bytes" in mem else None,
        # what the CUDA caching allocator would reserve for it (experiments/allocator's replay)
        "reserved_GB": mem["reserved_peak_bytes"] / gb if "reserved_peak_bytes" in mem else None,
        "fragmentation": mem.get("fragmentation"), "alloc_retries": mem.get("alloc_retries"),
        "states_GB": breakdown.pop("model_states_GB"), **breakdown,
        "peak_phase": mem.get("peak_phase"),
        "analytic_GB": mem.get("predicted_peak", {}).get("total", 0) / gb if mem.get("predicted_peak") else None,
        "reserve_GB": mem.get("cuda_reserve_bytes", 0) / gb if "peak_bytes" in mem else None,
        "device_GB": mem["device_bytes"] / gb if mem.get("device_bytes") else None,
        "cause": mem.get("cause") if r.get("status") == "oom" else None,
        "zero_r": "/".join(n for k, n in (("partition_activations", "Pa"), ("cpu_checkpointing", "cpu"),
                                          ("contiguous_memory_optimization", "MD")) if config["zero"].get(k)) or "-",
        "comm_elements": comm.get("dp_elements_per_step", comm.get("elements_per_step")),
        "comm_theory": theory_elements_per_step(r),
        "tp_elements": (comm.get("tp_megatron") or {}).get("elements_per_step"),
        "tp_theory": (comm.get("tp_megatron") or {}).get("theory_elements_per_step"),
        "status": r.get("status", "missing"), "measured_by": r.get("measured_by", MEASURED_BY),
        "sim_wall_s": (r.get("simulation") or {}).get("wall_s"), "simulated_rank": r.get("simulated_rank", rank),
        "point_id": point.point_id if point is not None else r["point_id"]}


def simulated_summary_rows(points: list[Point], results_dir: Path, rank: int = 0) -> list[dict]:
    """The sweep's simulated points at `rank`, in order: each one's record, or `missing`."""
    return [simulated_summary_row(records.read_record(simulated_path(results_dir, p, rank)) or {}, p, rank)
            for p in points]


def simulated_folder_summary_rows(points: list[Point], results_dir: Path, rank: int = 0) -> list[dict]:
    """summary.csv of results_dir/simulated/: every record in it (earlier sweeps' and other ranks'
    too), then this sweep's points that have none at `rank`."""
    sweep = {(p.point_id, rank): row for p, row in zip(points, simulated_summary_rows(points, results_dir, rank))}
    return _folder_rows(results_dir / "simulated", simulated_summary_row, sweep)


def simulated_summary_markdown(rows: list[dict]) -> str:
    def num(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)
    lines = ["| model | params (B) | GPUs | TP | DP | stage | ZeRO-R | micro-batch | optimizer step | peak (GB, simulated) "
             "| reserved (GB) | fragmentation | states "
             "| activations | buffers | temporaries | analytic (GB) | + reserve | device | status | cause | DP comm/step "
             "| theory | TP comm/step | TP theory |",
             "|---|---:|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['params_B']:.3f} | {r['gpus']} | {r['tp']} | {r['dp']} | {r['stage']} | {r['zero_r']} "
            f"| {r['micro_batch']} | {r['optimizer_step']} | {num(r['peak_GB'])} | {num(r['reserved_GB'])} | {num(r['fragmentation'], '{:.3f}')} "
            f"| {num(r['states_GB'])} | {num(r['activations_GB'])} "
            f"| {num(r['buffers_GB'])} | {num(r['temporaries_GB'])} | {num(r['analytic_GB'])} | {num(r['reserve_GB'])} "
            f"| {num(r['device_GB'], '{:.0f}')} | {r['status']} | {r['cause'] or '-'} "
            f"| {num(r['comm_elements'], '{:,}')} | {num(r['comm_theory'], '{:,}')} "
            f"| {num(r['tp_elements'], '{:,}')} | {num(r['tp_theory'], '{:,}')} |")
    return "\n".join(lines)


def largest_markdown(results: list[dict]) -> str:
    """The largest-model search's rows; `optimizer step` (whole or chunked) tells apart the rows
    of one baseline searched both ways (Table 2)."""
    lines = ["| experiment | stage | MP | GPUs | micro-batch | optimizer step | family (h, heads) | analytic max "
             "| simulated max | simulations | paper |", "|---|---:|---:|---:|---:|---|---|---:|---:|---:|---|"]
    for r in results:
        sims = ", ".join(f"{s['layers']}{'✓' if s['fits'] else '✗'}" for s in r["simulations"])
        lines.append(f"| {r['experiment']} | {r['stage']} | {r['tp']} | {r['gpus']} | {r['micro_batch']} "
                     f"| {r['optimizer_step']} "
                     f"| {r['hidden']}, {r['heads']} | {r['analytic_max_params'] / 1e9:.2f}B ({r['analytic_max_layers']} L) "
                     f"| {r['simulated_max_params'] / 1e9:.2f}B ({r['simulated_max_layers']} L) | {sims} | {r['paper']} |")
    return "\n".join(lines)
