"""The records of simulated points (experiments/simulate.py): the verdict against the device,
the cause of an `oom`, memory and traffic beside their predictions, and the sweep's summary."""
from __future__ import annotations

from pathlib import Path

from experiments import records
from experiments.collective_counter import tp_allreduce_theory
from experiments.points import Point, predicted_memory_bytes
from experiments.reports.tables import peak_breakdown_gb
from experiments.storage_tracker import KINDS

MEASURED_BY = "simulated"


def verdict(point: Point, peak_bytes: int) -> dict:
    """fits: peak + the cluster's CUDA reserve within its device memory (None: unknown device)."""
    device_gb = point.cluster.get("device_memory_gb")
    reserve = float(point.cluster.get("cuda_reserve_gb") or 0.0) * 1e9
    if device_gb is None:
        return {"fits": None, "device_bytes": None, "cuda_reserve_bytes": reserve, "needed_bytes": peak_bytes + reserve}
    return {"fits": peak_bytes + reserve <= device_gb * 1e9, "device_bytes": device_gb * 1e9,
            "cuda_reserve_bytes": reserve, "needed_bytes": peak_bytes + reserve}


def simulated_record(point: Point, precision: str, result: dict | None, error: str | None, started: str,
                     rank: int = 0) -> dict:
    """The record of a simulated point: status ok (fits) or oom (does not), `measured_by`
    "simulated", memory.peak_bytes with the breakdown by kind and the timeline by phase,
    the engine's traffic beside 2Ψ/3Ψ and megatron's TP all-reduces beside their count."""
    from experiments.analysis.memory import predicted_for_engine
    from experiments.train import build_record, classify_failure

    analytic = predicted_memory_bytes(point, precision)
    if result is None:
        status = "fail" if error and "out of memory" not in error.lower() else "oom"
        record = build_record(point, precision, "simulate", status, None, error, started)
        record.update(measured_by=MEASURED_BY, simulated_rank=rank)
        record["memory"]["predicted_peak"] = _analytic(analytic)
        return record
    mem, stats = result["memory"], result["stats"]
    v = verdict(point, mem["peak_bytes"])
    status = "ok" if v["fits"] is not False else "oom"
    cause, error = oom_cause(mem, v), None
    if status == "oom":
        breakdown = ", ".join(f"{k} {mem['peak_by_kind'][k] / 1e9:.2f}" for k in KINDS if mem["peak_by_kind"][k])
        why = ("without them the peak would fit: activations are the cause (ZeRO-R's partitioned activations "
               "and CPU checkpointing address them)" if cause == "activations" else "even without activations it "
               f"does not fit: the largest kind is {cause}")
        error = (f"simulated out of memory: peak {mem['peak_bytes'] / 1e9:.2f} GB (in {mem['peak_phase']}) + "
                 f"{v['cuda_reserve_bytes'] / 1e9:.2f} GB CUDA reserve > {v['device_bytes'] / 1e9:.0f} GB; "
                 f"at the peak ({breakdown} GB) {why}")
    record = build_record(point, precision, "simulate", status, None, error, started)
    theory = (3 if point.stage == 3 else 2) * stats["psi"] if point.dp > 1 else 0
    last = stats["comm"]["last_step"]
    megatron_tp = result["tp_traffic"].get("tp", {})
    record.update(
        measured_by=MEASURED_BY, simulated_rank=rank,
        params_per_gpu=stats["psi"], padded_params_per_gpu=stats["padded_psi"],
        memory={"predicted": predicted_for_engine(stats), "predicted_peak": _analytic(analytic),
                "measured": {**stats["memory"], "peak_bytes": mem["peak_bytes"]},  # this rank only: no max over ranks
                "measured_max_over_ranks": {**stats["memory"], "peak_bytes": mem["peak_bytes"]},
                "peak_bytes": mem["peak_bytes"], "peak_by_kind": mem["peak_by_kind"], "peak_phase": mem["peak_phase"],
                "host_peak_bytes": mem["host_peak_bytes"], "rounding": mem["rounding"], "timeline": mem["timeline"],
                **v, "cause": cause},
        comm={"elements_per_step": last["elements"], "bytes_per_step": last["bytes"],
              "theory_elements_per_step": theory, "by_kind": last["by_kind"], "by_purpose": last["by_purpose"],
              # ZeroDP's own traffic (what 2Ψ/3Ψ counts), without ZeRO-R's Pa all-gathers over the TP group
              "dp_elements_per_step": sum(v["elements"] for k, v in last["by_purpose"].items() if k != "activations"),
              "loss_scale": stats["loss_scale"], "skipped_steps": stats["skipped_steps"],
              "tp_megatron": {"counted": megatron_tp,
                              "elements_per_step": sum(r["elements"] for r in megatron_tp.values()) // result["steps"],
                              "theory_elements_per_step": tp_allreduce_theory(point),
                              "how": "torch.distributed calls outside zero_impl on megatron's TP group, counted by "
                                     "a wrapper (experiments/collective_counter.py CollectiveCounter), per optimizer step"},
              "other_groups": {g: v for g, v in result["tp_traffic"].items() if g != "tp"}},
        simulation={"steps": result["steps"], "wall_s": result.get("wall_s"), "phase_seconds": result["phase_seconds"],
                    "optimizer_foreach": result["foreach"], "rank": rank},
    )
    return record


def oom_cause(mem: dict, v: dict) -> str | None:
    """What a point that does not fit runs out on: "activations" when the peak without them
    would fit (the Figure 2 points the paper trains with ZeRO-R's Pa), else the largest kind at
    the peak. None when it fits or the device is unknown."""
    if v["fits"] is not False:
        return None
    kinds = mem["peak_by_kind"]
    if mem["peak_bytes"] - kinds.get("activations", 0) + v["cuda_reserve_bytes"] <= v["device_bytes"]:
        return "activations"
    return max((k for k in KINDS if k != "activations"), key=lambda k: kinds.get(k, 0))


def _analytic(predicted: dict) -> dict:
    return {k: predicted[k] for k in ("model_states", "activations", "buffers", "step_temporaries", "total",
                                      "peak_phase")}


def simulated_path(results_dir: Path, point: Point) -> Path:
    """Simulated records live apart from hardware ones (a simulated `ok` must never make a
    real sweep skip a point): <results_dir>/simulated/<point_id>.json."""
    return results_dir / "simulated" / f"{point.point_id}.json"


def simulated_summary_rows(points: list[Point], results_dir: Path) -> list[dict]:
    rows = []
    for point in points:
        r = records.read_record(simulated_path(results_dir, point)) or {}
        mem, comm = r.get("memory", {}), r.get("comm", {})
        gb = 1e9
        breakdown = peak_breakdown_gb(mem)
        rows.append({
            "model": point.model["name"], "params_B": round(r.get("params", 0) / gb, 3), "gpus": point.gpus,
            "tp": point.tp, "dp": point.dp, "stage": point.stage, "micro_batch": point.micro_batch,
            "note": point.note, "precision": r.get("precision"),
            "peak_GB": mem["peak_bytes"] / gb if "peak_bytes" in mem else None,
            "states_GB": breakdown.pop("model_states_GB"), **breakdown,
            "peak_phase": mem.get("peak_phase"),
            "analytic_GB": mem.get("predicted_peak", {}).get("total", 0) / gb if mem.get("predicted_peak") else None,
            "reserve_GB": mem.get("cuda_reserve_bytes", 0) / gb if "peak_bytes" in mem else None,
            "device_GB": mem["device_bytes"] / gb if mem.get("device_bytes") else None,
            "cause": mem.get("cause") if r.get("status") == "oom" else None,
            "zero_r": "/".join(n for k, n in (("partition_activations", "Pa"), ("cpu_checkpointing", "cpu"),
                                              ("contiguous_memory_optimization", "MD")) if point.zero.get(k)) or "-",
            "comm_elements": comm.get("dp_elements_per_step", comm.get("elements_per_step")),
            "comm_theory": comm.get("theory_elements_per_step"),
            "tp_elements": (comm.get("tp_megatron") or {}).get("elements_per_step"),
            "tp_theory": (comm.get("tp_megatron") or {}).get("theory_elements_per_step"),
            "status": r.get("status", "missing"), "measured_by": r.get("measured_by", MEASURED_BY),
            "sim_wall_s": (r.get("simulation") or {}).get("wall_s"), "point_id": point.point_id})
    return rows


def simulated_summary_markdown(rows: list[dict]) -> str:
    def num(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)
    lines = ["| model | params (B) | GPUs | TP | DP | stage | ZeRO-R | micro-batch | peak (GB, simulated) | states "
             "| activations | buffers | temporaries | analytic (GB) | + reserve | device | status | cause | DP comm/step "
             "| theory | TP comm/step | TP theory |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['params_B']:.3f} | {r['gpus']} | {r['tp']} | {r['dp']} | {r['stage']} | {r['zero_r']} "
            f"| {r['micro_batch']} | {num(r['peak_GB'])} | {num(r['states_GB'])} | {num(r['activations_GB'])} "
            f"| {num(r['buffers_GB'])} | {num(r['temporaries_GB'])} | {num(r['analytic_GB'])} | {num(r['reserve_GB'])} "
            f"| {num(r['device_GB'], '{:.0f}')} | {r['status']} | {r['cause'] or '-'} "
            f"| {num(r['comm_elements'], '{:,}')} | {num(r['comm_theory'], '{:,}')} "
            f"| {num(r['tp_elements'], '{:,}')} | {num(r['tp_theory'], '{:,}')} |")
    return "\n".join(lines)
