"""One record builder for a point, measured or simulated: `build_record` for a run on real
ranks (experiments/run/real.py), `simulated_record` for a rank played on fake tensors
(experiments/run/fake.py), with what they share: the point's configuration, FLOPs and versions,
the engine's traffic beside 2Ψ/3Ψ, and `classify_failure`. A simulated record adds the verdict
against the device (`verdict`), the cause of an `oom`, and the peak by phase and kind."""
from __future__ import annotations

import statistics
from pathlib import Path

from experiments import records
from experiments.analysis.flops import layer_weights, model_flops_per_iteration, recompute_factor
from experiments.analysis.memory import predicted_for_engine
from experiments.launch import RankFailed
from experiments.models.gpt_shape import padded_vocab_size, parameter_count
from experiments.points import Point, predicted_memory_bytes, predicted_model_state_bytes
from experiments.run.collective_counter import tp_allreduce_theory
from experiments.run.storage_tracker import KINDS
from zero_impl import ZERO_R_SWITCHES, zero_r_config

def build_record(point: Point, precision: str, launcher: str, status: str, results: list[dict] | None,
                 error: str | None, started: str, resume: dict | None = None) -> dict:
    """The result record of one point, from every rank's measurements (or the error). `resume`:
    {last_step, checkpoint, resumed_from} (ok records take it from rank 0's results)."""
    shape = point.shape
    recompute = point.train["recompute"]
    flops = model_flops_per_iteration(batch=point.global_batch, seq_len=shape.seq_len, layers=shape.layers,
                                      hidden=shape.hidden, vocab=padded_vocab_size(shape.vocab_size, point.tp),
                                      recompute=recompute,
                                      weights_per_layer=layer_weights(shape.hidden, shape.heads, shape.kv_heads,
                                                                      shape.ffn_hidden, shape.mlp == "swiglu"))
    record = {
        "status": status, "experiment": point.experiment, "point_id": point.point_id,
        "config": {**point.as_dict(), "precision_resolved": precision, "launcher": launcher},
        "model": {**point.model, "padded_vocab_size": padded_vocab_size(shape.vocab_size, point.tp)},
        "params": parameter_count(shape, point.tp), "params_per_gpu": 0, "padded_params_per_gpu": 0,
        "world_size": point.gpus, "tp": point.tp, "dp": point.dp, "stage": point.stage, "precision": precision,
        "zero_r_config": zero_r_config(point.stage, **{k: point.zero[k] for k in ZERO_R_SWITCHES if k in point.zero}),
        "micro_batch": point.micro_batch, "global_batch": point.global_batch,
        "recompute_factor": recompute_factor(recompute), "flops_per_iteration": float(flops),
        "flops_convention": "Narayanan et al. 2021 Eq. 3: 24*c*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)), padded V, no causal halving",
        "step_times_s": [], "step_time_s": None, "tflops_per_gpu": None, "tokens_per_s_per_gpu": None,
        "memory": {"predicted": predicted_model_state_bytes(point, precision)}, "comm": {}, "losses": [],
        "error": error, "versions": records.versions(),
        # cpu_freed_memory_kept: what the ranks report (a run that returned none: unknown)
        "hardware": {**records.hardware(), "cpu_freed_memory_kept": None},
        "started": started, "finished": records.now(),
        "resume": resume if resume is not None else (results[0].get("resume") if results else None),
    }
    if status == "ok" and results:
        rank0 = results[0]
        stats = rank0["stats"]
        step = statistics.median(rank0["step_times_s"])
        measured = [r["stats"]["memory"] for r in results]
        record.update(
            params_per_gpu=stats["psi"], padded_params_per_gpu=stats["padded_psi"], step_times_s=rank0["step_times_s"], step_time_s=step,
            tflops_per_gpu=flops / (step * point.gpus * 1e12),
            tokens_per_s_per_gpu=point.global_batch * shape.seq_len / (step * point.gpus), losses=rank0["losses"])
        record["memory"] = {
            "predicted": predicted_for_engine(stats),  # Table 1's formula with this run's dtypes
            "measured": measured[0],                    # rank 0, bytes by kind
            "measured_max_over_ranks": {k: max(m[k] for m in measured) for k in measured[0]},
        }
        record["comm"] = {**engine_traffic(point, stats), "loss_scale": stats["loss_scale"],
                          "skipped_steps": stats["skipped_steps"]}
        record["optimizer"] = stats["optimizer"]  # torch AdamW's implementation (run/build.py)
        # the ranks kept freed memory mapped (experiments/host_allocator.py: CPU runs)
        record["hardware"]["cpu_freed_memory_kept"] = bool(rank0.get("freed_memory_kept", False))
    return record


def resume_line(record: dict) -> str:
    """Whether a finished run resumed, and at which step: "resumed at step 4 from <checkpoint>",
    or "started at step 0", saying so when train.resume=true found no checkpoint."""
    resume = record.get("resume") or {}
    if resume.get("resumed_from"):
        return f"resumed at step {resume['resumed_step']} from {resume['resumed_from']}"
    asked = record["config"]["train"]["resume"]
    return "started at step 0" + (" (train.resume=true found no complete checkpoint)" if asked else "")


def classify_failure(error: BaseException) -> tuple[str, str]:
    """(status, error text) for a point that did not finish."""
    text = f"{type(error).__name__}: {error}" if not isinstance(error, RankFailed) else str(error)
    if isinstance(error, RankFailed) and error.reason == "timeout":
        return "timeout", text
    if isinstance(error, RankFailed) and error.reason == "died" and error.exitcode == -9:
        return "oom", text + " (killed by SIGKILL: most likely the kernel's out-of-memory killer)"
    lowered = text.lower()
    if "out of memory" in lowered or "outofmemoryerror" in lowered or "can't allocate memory" in lowered:
        return "oom", text
    return "fail", text


def engine_traffic(point: Point, stats: dict) -> dict:
    """The engine's traffic in its last step (zero_impl's ledger: what it handed to
    torch.distributed) beside the paper's 2Ψ (stages 0-2) or 3Ψ (stage 3) per step, the
    latter less the root unit's second gather that stage3_keep_root saves."""
    kept = stats.get("stage3", {}).get("root_kept_elements", 0)
    theory = ((3 * stats["psi"] - kept) if point.stage == 3 else 2 * stats["psi"]) if point.dp > 1 else 0
    last = stats["comm"]["last_step"]
    return {"elements_per_step": last["elements"], "bytes_per_step": last["bytes"],
            "theory_elements_per_step": theory, "by_kind": last["by_kind"], "by_purpose": last["by_purpose"]}


# -- simulated points ----------------------------------------------------------------------------
MEASURED_BY = "simulated"


def verdict(point: Point, peak_bytes: int, reserved: dict | None = None) -> dict:
    """fits: what the caching allocator reserves (`reserved`: run/reserved.py's replay, which
    ran out of memory or not on the device less the cluster's CUDA reserve), else the tensor
    peak, plus that reserve within the device's memory (None: unknown device)."""
    device_gb = point.cluster.get("device_memory_gb")
    reserve = float(point.cluster.get("cuda_reserve_gb") or 0.0) * 1e9
    held = reserved["reserved_peak_bytes"] if reserved else peak_bytes
    out = {"fits": None, "device_bytes": None, "cuda_reserve_bytes": reserve, "needed_bytes": held + reserve,
           "decided_on": "reserved" if reserved else "allocated"}
    if device_gb is None:
        return out
    fits = held + reserve <= device_gb * 1e9 and not (reserved and reserved["oom"])
    return {**out, "fits": fits, "device_bytes": device_gb * 1e9}


def simulated_record(point: Point, precision: str, result: dict | None, error: str | None, started: str,
                     rank: int = 0) -> dict:
    """The record of a simulated point: status ok (fits) or oom (does not), `measured_by`
    "simulated", memory.peak_bytes with the breakdown by kind and the timeline by phase,
    the engine's traffic beside 2Ψ/3Ψ and megatron's TP all-reduces beside their count."""
    analytic = predicted_memory_bytes(point, precision)
    if result is None:
        status = "fail" if error and "out of memory" not in error.lower() else "oom"
        record = build_record(point, precision, "simulate", status, None, error, started)
        record.update(measured_by=MEASURED_BY, simulated_rank=rank)
        record["memory"]["predicted_peak"] = _analytic(analytic)
        return record
    mem, stats, reserved = result["memory"], result["stats"], result.get("reserved")
    v = verdict(point, mem["peak_bytes"], reserved)
    status = "ok" if v["fits"] is not False else "oom"
    cause, error = oom_cause(mem, v), None
    if status == "oom":
        breakdown = ", ".join(f"{k} {mem['peak_by_kind'][k] / 1e9:.2f}" for k in KINDS if mem["peak_by_kind"][k])
        why = {"activations": "without them the peak would fit: activations are the cause (ZeRO-R's partitioned "
                              "activations and CPU checkpointing address them)",
               "fragmentation": "the tensors fit: the allocator's cached and split segments are the cause"
                                + (" (expandable_segments:True makes it fit)"
                                   if reserved and not reserved["expandable"]["oom"] else "")}.get(
            cause, f"even without activations it does not fit: the largest kind is {cause}")
        held = (f"reserved {reserved['reserved_peak_bytes'] / 1e9:.2f} GB with the allocator out of memory "
                f"({reserved['alloc_retries']} retries) for tensors peaking at " if reserved else "")
        error = (f"simulated out of memory: {held}{mem['peak_bytes'] / 1e9:.2f} GB (in {mem['peak_phase']}) + "
                 f"{v['cuda_reserve_bytes'] / 1e9:.2f} GB CUDA reserve > {v['device_bytes'] / 1e9:.0f} GB; "
                 f"at the peak ({breakdown} GB) {why}")
    record = build_record(point, precision, "simulate", status, None, error, started)
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
                **_reserved_fields(reserved), **v, "cause": cause},
        comm={**engine_traffic(point, stats),
              # ZeroDP's own traffic (what 2Ψ/3Ψ counts), without ZeRO-R's Pa all-gathers over the TP group
              "dp_elements_per_step": sum(v["elements"] for k, v in last["by_purpose"].items() if k != "activations"),
              "loss_scale": stats["loss_scale"], "skipped_steps": stats["skipped_steps"],
              "tp_megatron": {"counted": megatron_tp,
                              "elements_per_step": sum(r["elements"] for r in megatron_tp.values()) // result["steps"],
                              "theory_elements_per_step": tp_allreduce_theory(point),
                              "how": "torch.distributed calls outside zero_impl on megatron's TP group, counted by "
                                     "a wrapper (experiments/run/collective_counter.py CollectiveCounter), per optimizer step"},
              "other_groups": {g: v for g, v in result["tp_traffic"].items() if g != "tp"}},
        simulation={"steps": result["steps"], "wall_s": result.get("wall_s"), "phase_seconds": result["phase_seconds"],
                    "optimizer_foreach": result["foreach"], "rank": rank},
        optimizer=stats["optimizer"],
    )
    return record


def _reserved_fields(reserved: dict | None) -> dict:
    """The allocator's replay beside the tensor peak: reserved_peak_bytes, its fragmentation and
    retries, and the whole replay (options recorded) under `allocator`."""
    if not reserved:
        return {}
    return {"reserved_peak_bytes": reserved["reserved_peak_bytes"],
            "allocated_peak_bytes": reserved["allocated_peak_bytes"], "fragmentation": reserved["fragmentation"],
            "alloc_retries": reserved["alloc_retries"], "segments_peak": reserved["segments_peak"],
            "allocator": reserved}


def oom_cause(mem: dict, v: dict) -> str | None:
    """What a point that does not fit runs out on: "fragmentation" when its tensors would fit
    but the allocator's reserved segments do not, "activations" when the peak without them
    would fit (the Figure 2 points the paper trains with ZeRO-R's Pa), else the largest kind at
    the peak. None when it fits or the device is unknown."""
    if v["fits"] is not False:
        return None
    if v.get("decided_on") == "reserved" and mem["peak_bytes"] + v["cuda_reserve_bytes"] <= v["device_bytes"]:
        return "fragmentation"
    kinds = mem["peak_by_kind"]
    if mem["peak_bytes"] - kinds.get("activations", 0) + v["cuda_reserve_bytes"] <= v["device_bytes"]:
        return "activations"
    return max((k for k in KINDS if k != "activations"), key=lambda k: kinds.get(k, 0))


def _analytic(predicted: dict) -> dict:
    return {k: predicted[k] for k in ("model_states", "activations", "buffers", "step_temporaries", "total",
                                      "peak_phase")}


def simulated_path(results_dir: Path, point: Point, rank: int = 0) -> Path:
    """Simulated records live apart from hardware ones (a simulated `ok` must never make a
    real sweep skip a point): <results_dir>/simulated/<point_id>.json for rank 0, the rank the
    reports read, and <point_id>.rank<N>.json for another rank (simulate_rank=N), which so
    never replaces rank 0's."""
    name = point.point_id if rank == 0 else f"{point.point_id}.rank{rank}"
    return results_dir / "simulated" / f"{name}.json"
