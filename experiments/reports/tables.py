"""The report's tables as pandas DataFrames: the paper's numbers beside the suite's.

Used by report.py (which writes them as Markdown, CSV and LaTeX) and by notebooks/figures.ipynb.
Records that are not `ok` keep their status in every table and never enter a number.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.analysis.memory import max_params, model_state_bytes
from experiments.analysis.systems import SYSTEMS

from experiments.records import REPO
from experiments.reports.comm_claims import micro_batches_per_step
PAPER_DIR = REPO / "results" / "paper"
STAGE_NAMES = {0: "baseline DP", 1: "Pos", 2: "Pos+g", 3: "Pos+g+p"}
PAPER_STAGES = {"Pos": 1, "Pos+g": 2, "Pos+g+p": 3}


SIGNIFICANT = 6  # digits of a table cell (.md, .tex); the .csv keeps every digit


def format_number(value, significant: int | None = SIGNIFICANT) -> str:
    """A cell as the paper prints numbers: positional, never scientific (16000, not 1.6e+04),
    integers whole, other floats to `significant` digits with trailing zeros dropped (None:
    every digit of the float's shortest repr). None and NaN are "-"."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if not isinstance(value, (float, np.floating)):
        return str(value)
    v = float(value)
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v.is_integer() and abs(v) < 2 ** 53:
        return str(int(v))
    if significant is None:
        return np.format_float_positional(v, trim="-")
    decimals = max(0, significant - 1 - math.floor(math.log10(abs(v))))
    text = f"{v:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def printed_decimals(printed: str) -> int:
    return len(printed.split(".")[1]) if "." in printed else 0


def matches_printed(value: float, printed: str) -> bool:
    """True when the paper's `printed` number is `value` rounded or truncated to the decimals
    it shows (the paper does both: 31.406 -> 31.4, 4187.5 -> 4187)."""
    target, scale = float(printed), 10 ** printed_decimals(printed)
    wanted = round(target * scale)
    half_up = math.floor(value * scale + 0.5 + 1e-9)  # 41.25 -> 41.3, as printed (not banker's 41.2)
    return half_up == wanted or math.floor(value * scale + 1e-9) == wanted


# -- Table 1 ---------------------------------------------------------------------------------
def table1(paper_dir: Path = PAPER_DIR) -> pd.DataFrame:
    """Per-device model-state memory (GB) of the paper's Table 1 from the memory model, with the
    paper's cells: one row per (model, stage, Nd)."""
    paper = pd.read_csv(paper_dir / "table1_memory.csv", dtype={"paper_value_gb": str})
    rows = []
    for _, r in paper.iterrows():
        ours = model_state_bytes(float(r["psi_params"]), PAPER_STAGES[r["stage"]], int(r["nd"]))["total"] / 1e9
        rows.append({"model": r["model"], "stage": r["stage"], "nd": int(r["nd"]), "ours_gb": ours,
                     "paper_gb": r["paper_value_gb"], "matches": matches_printed(ours, r["paper_value_gb"]),
                     "bold_in_paper": r["bold_in_paper"] == "yes"})
    return pd.DataFrame(rows)


def table1_wide(df: pd.DataFrame) -> pd.DataFrame:
    """The paper's layout: one row per Nd, a column per (model, stage), 'ours (paper)'."""
    df = df.assign(cell=[f"{format_number(o)} ({p})" for o, p in zip(df["ours_gb"], df["paper_gb"])])
    wide = df.pivot(index="nd", columns=["model", "stage"], values="cell")
    wide.columns = [f"{m} {s}" for m, s in wide.columns]
    return wide.reset_index()


# -- Table 2 ---------------------------------------------------------------------------------
def _printed_billions(printed: str) -> float:
    return float(printed[:-1]) * (1000 if printed.endswith("T") else 1)


def table2(records: list[dict], paper_dir: Path = PAPER_DIR, device_gb: float = 32.0, nd: int = 64) -> pd.DataFrame:
    """Largest model by memory analysis (32 GB devices, Nd = 64) beside the paper's theoretical
    and measured columns; our measured column from records of the table2 experiment."""
    paper = pd.read_csv(paper_dir / "table2_max_model_size.csv", dtype=str)
    measured = _table2_measured(records)
    largest = {_table2_key(rec): f"{r['simulated_max_params'] / 1e9:.1f}B (simulated)"
               for rec in records for r in [rec.get("largest_search")]
               if r and rec.get("measured_by") == "simulated" and r["experiment"] == "table2"}
    rows = []
    for _, r in paper.iterrows():
        mp = int(r["mp"])
        row = {"mp": mp, "gpus": int(r["gpus"])}
        for stage, column in ((0, "theoretical_baseline"), (1, "theoretical_Pos"), (2, "theoretical_Pos+g"),
                              (3, "theoretical_Pos+g+p")):
            ours = max_params(device_gb * 1e9, stage, nd, mp) / 1e9
            printed = r[column]
            row[f"{column}_ours_B"] = ours
            row[f"{column}_paper"] = printed
            # The paper prints MP x (the MP=1 value rounded to 0.1B) for MP > 1.
            per_mp = round(ours / mp, 1) * mp
            row[f"{column}_matches"] = (matches_printed(ours if printed.endswith("B") else ours / 1000, printed[:-1])
                                        or abs(per_mp - _printed_billions(printed)) < 1e-6)
        row["measured_baseline_paper"] = r["measured_baseline"]
        row["measured_Pos_paper"] = r["measured_ZeRO-DP_Pos"]
        row["measured_baseline_ours"] = measured.get((mp, 0, "whole"), "not run")
        row["measured_baseline_chunked_step_ours"] = measured.get((mp, 0, "chunked"), "not run")
        row["measured_Pos_ours"] = measured.get((mp, 1, None), "not run")
        row["largest_baseline_simulated"] = largest.get((mp, 0, "whole"), "not searched")
        row["largest_baseline_chunked_step_simulated"] = largest.get((mp, 0, "chunked"), "not searched")
        row["largest_Pos_simulated"] = largest.get((mp, 1, None), "not searched")
        rows.append(row)
    return pd.DataFrame(rows)


def optimizer_step_of(zero: dict) -> str:
    """"whole" when these engine settings update the whole shard at once (zero.optimizer_bucket_size
    null, as Table 2's and Figures 2 and 4's baselines; and records from before the knob, which
    all did), else "chunked"."""
    return "whole" if zero.get("optimizer_bucket_size") is None else "chunked"


def optimizer_step(record: dict) -> str:
    """The record's optimizer step, "whole" or "chunked" (optimizer_step_of its engine settings)."""
    return optimizer_step_of(record.get("config", {}).get("zero", {}))


def _table2_key(record: dict) -> tuple:
    """(MP, stage, the optimizer step of a baseline; None for Pos, which runs one way)."""
    return record["tp"], record["stage"], optimizer_step(record) if record["stage"] == 0 else None


def _table2_measured(records: list[dict]) -> dict[tuple[int, int], str]:
    out = {}
    for r in records:
        if r.get("experiment") != "table2" or r.get("measured_by") == "simulated":
            continue
        key = _table2_key(r)
        label = f"{r['params'] / 1e9:.1f}B"
        out[key] = f"{label} ran" if r["status"] == "ok" else f"{label} {r['status']}"
    return out


# -- throughput, memory and communication from records ----------------------------------------
def paper_throughput(paper_dir: Path = PAPER_DIR) -> pd.DataFrame:
    """TFLOPs/GPU the paper reports per (experiment, series, x): read from DeepSpeed's figure
    (APPROX, +-0.5) and, for 100B, the text's 'over 38' (a lower bound)."""
    fig = pd.read_csv(paper_dir / "digitized_deepspeed_zero2_figure_APPROX.csv")
    series = {"DeepSpeed (ZeRO-2)": ("fig2", "ZeRO"), "Baseline w. internode MP": ("fig2", "Baseline"),
              "Performance/GPU (bar; right axis)": ("fig3", "ZeRO"), "ZeRO-2 DP": ("fig4", "ZeRO"),
              "Baseline DP": ("fig4", "Baseline (DDP)")}
    rows = [{"experiment": series[s][0], "series": series[s][1], "x": x, "paper_tflops_per_gpu": v,
             "exactness": "APPROX (read from a figure)"}
            for s, x, v in zip(fig["series_as_labelled"], fig["x"], fig["value"]) if s in series]
    rows.append({"experiment": "fig2", "series": "ZeRO", "x": "100B", "paper_tflops_per_gpu": 38.0,
                 "exactness": "VERBATIM lower bound ('over 38 TFlops per GPU')"})
    return pd.DataFrame(rows)


def _paper_key(r: dict) -> tuple[str, str, str]:
    x = f"{r['world_size']} GPUs" if r["experiment"] == "fig3" else r["model"].get("label", "")
    return r["experiment"], r["config"].get("note", ""), x


def throughput_table(records: list[dict], paper: pd.DataFrame | None = None) -> pd.DataFrame:
    """Table 5 style: one row per record, the paper's TFLOPs/GPU beside ours where it states one."""
    paper = paper_throughput() if paper is None else paper
    lookup: dict[tuple, list] = {}
    for _, p in paper.iterrows():
        lookup.setdefault((p["experiment"], p["series"], p["x"]), []).append(
            f"{p['paper_tflops_per_gpu']:g} ({'>=' if 'lower bound' in p['exactness'] else '~'})")
    rows = []
    for r in records:
        ok = r["status"] == "ok"
        timed = ok and measured_by(r) == "hardware"  # a simulation times nothing
        predicted = _predicted_tflops(r) if ok else None
        rows.append({
            "experiment": r["experiment"], "model": r["model"]["name"], "params_B": r["params"] / 1e9,
            "gpus": r["world_size"], "mp": r["tp"], "dp": r["dp"], "batch": r["global_batch"],
            "stage": STAGE_NAMES[r["stage"]], "precision": r["precision"], "c": r["recompute_factor"],
            "tflops_per_gpu": r["tflops_per_gpu"] if timed else None,
            "tflops_per_gpu_predicted": predicted,
            # the step-time model of this engine's schedule, not of the paper's systems (throughput_predicted)
            "predicted_system": RECORD_SYSTEM.label if predicted is not None else "-",
            "aggregate_pflops": r["tflops_per_gpu"] * r["world_size"] / 1000 if timed else None,
            "paper_tflops_per_gpu": ", ".join(lookup.get(_paper_key(r), [])) or "-",
            "status": r["status"], "measured_by": measured_by(r), "hardware": _hardware(r)})
    return pd.DataFrame(rows)


RECORD_SYSTEM = SYSTEMS["zero_repro"]   # what a record's prediction models: the engine that ran it (predict_record)


def _predicted_tflops(record: dict) -> float | None:
    """The step-time model's TFLOPs/GPU for the record's point on its cluster as this engine runs
    it (None on clusters without the model's constants, e.g. `local` CPU runs)."""
    from experiments.analysis.step_time import predict_record
    pred = predict_record(record)
    return pred.tflops_per_gpu if pred else None


def throughput_predicted(records: list[dict] | None = None) -> pd.DataFrame:
    """Every paper point of Figures 2, 3, 4 and 8: the paper's TFLOPs/GPU (text; DeepSpeed's
    figure, APPROX), the step-time model's prediction, their ratios, the time breakdown, the
    same recipe on DGX H100 nodes, and measured where records exist (reports/predictions.py)."""
    from experiments.reports.predictions import throughput_predicted as build
    return build(records)


def paper_claims(records: list[dict] | None = None) -> pd.DataFrame:
    """Every quantitative claim of results/paper/text_claims.csv with ours beside it, marked
    formula, measured (CPU), simulated, predicted, config or not checked."""
    from experiments.reports.predictions import paper_claims as build
    return build(records)


def memory_table(records: list[dict]) -> pd.DataFrame:
    """Memory per rank: model states predicted (Table 1 with the run's dtypes) and held (the
    engine's persistent storages, by kind), beside the measured peak of all live tensors
    (`meas_peak`: buffers, activations and temporaries included; what a device must fit)."""
    rows = []
    for r in records:
        row = {"experiment": r["experiment"], "model": r["model"]["name"], "stage": STAGE_NAMES[r["stage"]],
               "nd": r["dp"], "mp": r["tp"], "precision": r["precision"], "status": r["status"],
               "measured_by": measured_by(r)}
        pred = r["memory"].get("predicted", {})
        row.update({f"pred_{k}": pred.get(k) for k in ("params", "grads", "optimizer_states", "total")})
        meas = r["memory"].get("measured_max_over_ranks") if r["status"] == "ok" else None
        keys = ("params", "grads", "optimizer_states", "peak_buffers", "activations_saved", "total", "peak_bytes")
        row.update({f"meas_{k}": meas.get(k) if meas else None for k in keys})
        row["meas_peak"] = row.pop("meas_peak_bytes")
        row["meas_over_pred"] = meas["total"] / pred["total"] if meas and pred.get("total") else None
        rows.append(row)
    return pd.DataFrame(rows)


def theory_elements_per_step(record: dict) -> int | None:
    """The elements the engine moves per optimizer step by its schedule, from the record's formula
    for a step of one micro-batch (comm.theory_elements_per_step: 2Ψ; stage 3 3Ψ less the root
    kept gathered) and its m accumulated micro-batches (zero_impl/engine.py backward): stages 0-1
    reduce the gradients on the last micro-batch only, 2Ψ; stage 2 has no full-size gradient to
    accumulate into, so it reduce-scatters every micro-batch and gathers the parameters once,
    (m + 1)Ψ; stage 3 gathers and reduce-scatters every micro-batch, m times its one-micro-batch
    formula. None for a record without traffic (not run, or failed before its first step)."""
    one, m = record.get("comm", {}).get("theory_elements_per_step"), micro_batches_per_step(record)
    return None if one is None else {2: one // 2 * (m + 1), 3: one * m}.get(record["stage"], one)


def theory_per_psi(stage: int, micro_batches: int) -> int:
    """The paper's schedule per optimizer step in units of Ψ (theory_elements_per_step with
    every stage-3 unit gathered twice): 2, 2, m + 1, 3m; Sec 7's 2Ψ and 3Ψ at m = 1."""
    return {2: micro_batches + 1, 3: 3 * micro_batches}.get(stage, 2)


def comm_table(records: list[dict]) -> pd.DataFrame:
    """Elements moved per optimizer step against the engine's schedule for the record's stage and
    micro-batches (theory_elements_per_step; Sec 7's 2Ψ and 3Ψ at one micro-batch)."""
    rows = []
    for r in records:
        ok = r["status"] == "ok"
        psi = r.get("params_per_gpu") or None
        comm = r.get("comm", {})
        m = micro_batches_per_step(r)
        rows.append({"experiment": r["experiment"], "model": r["model"]["name"], "stage": STAGE_NAMES[r["stage"]],
                     "nd": r["dp"], "micro_batches": m,
                     "psi": psi, "elements_per_step": comm.get("elements_per_step") if ok else None,
                     "theory": theory_elements_per_step(r) if ok else None,
                     "per_psi": comm["elements_per_step"] / psi if ok and psi and r["dp"] > 1 else None,
                     "theory_per_psi": theory_per_psi(r["stage"], m) if r["dp"] > 1 else 0,
                     "status": r["status"], "measured_by": measured_by(r)})
    return pd.DataFrame(rows)


def measured_by(record: dict) -> str:
    """"simulated" for records of experiments/run/fake.py (one rank on fake tensors: memory and
    traffic, no time), "hardware" for runs on real ranks. Never averaged together."""
    return "simulated" if record.get("measured_by") == "simulated" else "hardware"


# -- simulated points (experiments/run/fake.py) -----------------------------------------------
ZERO_R_EXPERIMENTS = ("fig2", "fig3", "fig6", "fig7", "fig8")  # the paper ran these ZeRO points with ZeRO-R


def paper_verdict(record: dict) -> tuple[str, bool | None]:
    """(what the paper did with the point, whether the simulation's verdict agrees; None where
    the paper says nothing). Every point of Figures 2-4 and 6-8 ran in the paper; the ZeRO
    points of Figures 2, 3 and 6-8 ran as ZeRO-100B, Pos+g with ZeRO-R: simulated with their
    ZeRO-R switches they agree when they fit; without them (a user's override), also when only
    activations (what Pa and CB shrink) keep them from fitting."""
    experiment, status = record.get("experiment"), record.get("status")
    cause = record.get("memory", {}).get("cause")
    if experiment in ZERO_R_EXPERIMENTS and record.get("stage", 0) > 0:
        zero = record.get("config", {}).get("zero", {})
        switches = [name for key, name in (("partition_activations", "Pa"), ("cpu_checkpointing", "Pa+cpu"),
                                           ("contiguous_memory_optimization", "MD")) if zero.get(key)]
        if switches:  # simulated with its ZeRO-R configuration: it must fit, as it ran
            return f"ran, with ZeRO-R ({', '.join(switches)} here)", status == "ok"
        return "ran, with ZeRO-R (Pa, CB, MD)", status == "ok" or (status == "oom" and cause == "activations")
    if experiment in ZERO_R_EXPERIMENTS + ("fig4",):
        return "ran", status == "ok"
    return "-", None


def simulation_table(records: list[dict]) -> pd.DataFrame:
    """Simulated points (measured_by "simulated"): the peak device memory of the simulated rank
    by kind (GB, CUDA blocks), what the caching allocator's replay reserves for it (reserved_GB,
    its fragmentation and out-of-memory retries: the verdict's bytes where replayed), the analytic prediction (points.predicted_memory_bytes), the
    verdict against the device with the cluster's CUDA reserve, its cause, traffic per step
    against 2Ψ/3Ψ and megatron's TP all-reduces against their count, and the paper's verdict.
    Unlike hardware records, an `oom` here keeps its numbers: they are the finding."""
    rows = []
    for r in records:
        if measured_by(r) != "simulated":
            continue
        mem, comm = r.get("memory", {}), r.get("comm", {})
        gb = 1e9
        paper, agrees = paper_verdict(r)
        tp = comm.get("tp_megatron") or {}
        rows.append({
            "experiment": r["experiment"], "model": r["model"]["name"], "params_B": r["params"] / gb,
            "gpus": r["world_size"], "mp": r["tp"], "dp": r["dp"], "stage": STAGE_NAMES[r["stage"]],
            "micro_batch": r["micro_batch"], "precision": r["precision"], "rank": r.get("simulated_rank", 0),
            "peak_GB": mem["peak_bytes"] / gb if "peak_bytes" in mem else None,
            "reserved_GB": mem["reserved_peak_bytes"] / gb if mem.get("reserved_peak_bytes") else None,
            "fragmentation": (mem.get("allocator") or {}).get("fragmentation"),
            "alloc_retries": (mem.get("allocator") or {}).get("alloc_retries"),
            **peak_breakdown_gb(mem), "peak_phase": mem.get("peak_phase"),
            "analytic_GB": (mem.get("predicted_peak") or {}).get("total", 0) / gb if mem.get("predicted_peak") else None,
            "cuda_reserve_GB": mem["cuda_reserve_bytes"] / gb if "cuda_reserve_bytes" in mem else None,
            "device_GB": mem["device_bytes"] / gb if mem.get("device_bytes") else None,
            "status": r["status"], "cause": mem.get("cause") or "-",
            "zero_r": "/".join(n for k, n in (("partition_activations", "Pa"), ("cpu_checkpointing", "cpu"),
                                              ("contiguous_memory_optimization", "MD"))
                               if r.get("config", {}).get("zero", {}).get(k)) or "-",
            "comm_per_psi": comm.get("dp_elements_per_step", comm.get("elements_per_step")) / r["params_per_gpu"]
            if comm.get("elements_per_step") is not None and r.get("params_per_gpu") and r["dp"] > 1 else None,
            "tp_elements": tp.get("elements_per_step"), "tp_theory": tp.get("theory_elements_per_step"),
            "paper": paper, "agrees_with_paper": agrees, "measured_by": "simulated"})
    return pd.DataFrame(rows, columns=list(SIMULATION_COLUMNS))


SIMULATION_COLUMNS = ("experiment", "model", "params_B", "gpus", "mp", "dp", "stage", "zero_r", "micro_batch", "precision",
                      "rank", "peak_GB", "reserved_GB", "fragmentation", "alloc_retries", "model_states_GB", "activations_GB", "buffers_GB", "temporaries_GB", "peak_phase",
                      "analytic_GB", "cuda_reserve_GB", "device_GB", "status", "cause", "comm_per_psi", "tp_elements",
                      "tp_theory", "paper", "agrees_with_paper", "measured_by")


def peak_breakdown_gb(memory: dict) -> dict[str, float | None]:
    """A simulated record's peak by what it holds (GB): model states, activations, buffers
    (gathered parameters included) and temporaries; None each when the record has no breakdown."""
    kinds = memory.get("peak_by_kind") or {}
    parts = {"model_states_GB": ("params", "grads", "optimizer_states"), "activations_GB": ("activations",),
             "buffers_GB": ("buffers", "gathered_params"), "temporaries_GB": ("temporaries",)}
    return {name: sum(kinds.get(k, 0) for k in keys) / 1e9 if kinds else None for name, keys in parts.items()}


def largest_table(records: list[dict]) -> pd.DataFrame:
    """The largest model of each searched row's family that fits (experiments/sweeps/largest.py): the
    analytic bracket, the simulated maximum (confirmed when the next depth was simulated and did
    not fit), every simulated depth, and the paper's number (Table 2's measured columns; Figure
    4's 13B with ZeRO and 1.4B with DP alone)."""
    rows = []
    searched = [(rec, rec["largest_search"]) for rec in records
                if rec.get("measured_by") == "simulated" and rec.get("largest_search")]
    for record, r in searched:
        sims = r["simulations"]
        above = [s for s in sims if s["layers"] == r["simulated_max_layers"] + 1]
        at = [s for s in sims if s["layers"] == r["simulated_max_layers"]]
        rows.append({
            "experiment": r["experiment"], "stage": STAGE_NAMES[r["stage"]], "zero_r": record.get("zero_r_config"),
            "optimizer_step": optimizer_step(record),
            "mp": r["tp"], "gpus": r["gpus"],
            "dp": r["dp"], "micro_batch": r["micro_batch"], "family": f"h {r['hidden']}, {r['heads']} heads",
            "analytic_max_B": r["analytic_max_params"] / 1e9, "analytic_max_layers": r["analytic_max_layers"],
            "simulated_max_B": r["simulated_max_params"] / 1e9, "simulated_max_layers": r["simulated_max_layers"],
            "peak_GB_at_max": at[0]["peak_bytes"] / 1e9 if at else None,
            "peak_GB_one_layer_more": above[0]["peak_bytes"] / 1e9 if above else None,
            "limit_GB": r["limit_bytes"] / 1e9, "confirmed": r["confirmed"], "simulations": len(sims),
            "paper": r["paper"], "measured_by": "simulated"})
    return pd.DataFrame(rows, columns=list(LARGEST_COLUMNS))


LARGEST_COLUMNS = ("experiment", "stage", "zero_r", "optimizer_step", "mp", "gpus", "dp", "micro_batch", "family", "analytic_max_B",
                   "analytic_max_layers", "simulated_max_B", "simulated_max_layers", "peak_GB_at_max",
                   "peak_GB_one_layer_more", "limit_GB", "confirmed", "simulations", "paper", "measured_by")


def _hardware(record: dict) -> str:
    if measured_by(record) == "simulated":
        return f"simulated rank {record.get('simulated_rank', 0)} of {record['world_size']} (fake tensors)"
    hw = record.get("hardware", {})
    if hw.get("gpu"):
        return f"{hw.get('gpu_count')} x {hw['gpu']}"
    return f"CPU: {hw.get('cpu', '?')} ({hw.get('cpu_count', '?')} cores)"


def targets() -> pd.DataFrame:
    """The issue's throughput targets: predicted beside each band and the paper's number
    (reports/predictions.py)."""
    from experiments.reports.predictions import targets_table
    return targets_table()


def measured_steps() -> pd.DataFrame:
    """Megatron-LM's measured 1.2B step beside the model's (reports/predictions.py)."""
    from experiments.reports.predictions import measured_steps_table
    return measured_steps_table()


def sensitivity() -> pd.DataFrame:
    """Each target's prediction with every uncertain constant moved +-20% (reports/predictions.py)."""
    from experiments.reports.predictions import sensitivity_table
    return sensitivity_table()
