"""The step-time model (experiments/analysis/step_time.py) on the paper's own points, beside the
paper's numbers: the throughput table, the claims table, and the data of the Figure 2/3/4/8
comparisons (drawn in figures.py).

The paper's points are built from conf/experiment/fig{2,3,4,8}.yaml through points.expand, run
nothing, and need no records. Each point is predicted for the system the paper ran it with:

| series | system (analysis/systems.py) | DP gradient reduction | ZeRO-R |
|---|---|---|---|
| Figure 2 Baseline | megatron2019 | one blocking all-reduce after backward | none |
| Figure 4 Baseline (DDP) | pytorch_ddp | 25 MB buckets overlapped with backward | none |
| ZeRO (Figures 2-4), C1-C5 (Figure 8) | deepspeed2020 | a reduce per partition per 5e8 bucket, overlap_comm off | per point, below |

ZeRO-R per point: Figure 8's C1-C5 from Table 3 (results/paper/table3_zero_r_configs.csv);
Figure 2's ZeRO points at MP > 1 run Pa (C4: the paper's ZeRO-100B is Pos+g + ZeRO-R, and the
authors' sweep files set PA on), the 170B one Pa+cpu (C5: "Pa+cpu is needed for 170B", Sec
10.5); Figure 3's 60B runs Pa+cpu (C5: the authors' hyperscale config7_* files set PA and
PA-CPU on); MP 1 points have nothing for Pa to partition.

The paper's numbers: the text's (results/paper/text_claims.csv) where it states one, and the
readings of DeepSpeed's ZeRO-2 figure (digitized_deepspeed_zero2_figure_APPROX.csv), which are
that figure's numbers read from pixels (about +-0.5 TFLOPs), not the paper's.
"""
from __future__ import annotations

import csv
from dataclasses import replace
from functools import cache
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from experiments.analysis import step_time as st
from experiments.analysis.flops import recompute_factor
from experiments.analysis.hardware import load_cluster, profile
from experiments.analysis.memory import max_params, model_state_bytes
from experiments.analysis.systems import (PAPER_STACK_HOST_SYNCS, PAPER_STACKS_HOST_S_PER_KERNEL, SYSTEMS,
                                         TORCH_1_4_SCALAR_HALF_LOADS)
from experiments.commands import script_command
from experiments.records import REPO
from experiments.reports.comm_claims import comm_claim

PAPER_DIR = REPO / "results" / "paper"
CONF_DIR = REPO / "conf"
FIGURES = ("fig2", "fig3", "fig4", "fig8")
PAPER_CLUSTER, TODAY_CLUSTER = "dgx2_v100", "dgx_h100"


# -- the paper's points ------------------------------------------------------------------------
@cache
def paper_points(experiment: str, cluster: str = PAPER_CLUSTER) -> tuple:
    """The points of conf/experiment/<experiment>.yaml on conf/cluster/<cluster>.yaml, built with
    points.expand (no Hydra app needed, nothing run)."""
    from experiments.points import expand
    from experiments.schema import SweepConfig
    exp = OmegaConf.load(CONF_DIR / "experiment" / f"{experiment}.yaml")
    cfg = OmegaConf.merge(OmegaConf.structured(SweepConfig),
                          {"experiment": exp.experiment, "train": exp.get("train", {}),
                           "cluster": OmegaConf.load(CONF_DIR / "cluster" / f"{cluster}.yaml")})
    return tuple(expand(cfg))


@cache
def zero_r_flags() -> dict[str, dict[str, bool]]:
    with open(PAPER_DIR / "table3_zero_r_configs.csv") as f:
        return {r["config"]: {"pa": r["Pa"] == "on", "pa_cpu": r["Pa+cpu"] == "on"} for r in csv.DictReader(f)}


def paper_system(point) -> dict:
    """The system and ZeRO-R configuration the paper ran this point with (module docstring)."""
    note, label = point.note, point.model.get("label", "")
    if note == "Baseline":
        return {"system": "megatron2019", "zero_r": "-", "basis": "Table 5 baseline: Megatron-LM MP"}
    if note == "Baseline (DDP)":
        return {"system": "pytorch_ddp", "zero_r": "-", "basis": "Table 10 baseline: PyTorch DDP"}
    if note in zero_r_flags():
        return {"system": "deepspeed2020", "zero_r": note, "basis": "Table 9 row, C-config inferred (results/paper)"}
    if point.tp == 1:
        return {"system": "deepspeed2020", "zero_r": "C3", "basis": "MP 1: Pa has nothing to partition"}
    if point.experiment == "fig3":
        return {"system": "deepspeed2020", "zero_r": "C5", "basis": "DeepSpeedExamples hyperscale config7_*: PA, PA-CPU on"}
    if label == "170B":
        return {"system": "deepspeed2020", "zero_r": "C5", "basis": "Sec 10.5: Pa+cpu needed for 170B"}
    return {"system": "deepspeed2020", "zero_r": "C4", "basis": "ZeRO-100B = Pos+g + ZeRO-R; sweep files: PA on"}


def paper_inputs(point) -> st.StepInputs:
    """The point with its ZeRO-R flags; the system's own overlap and buckets."""
    flags = zero_r_flags().get(paper_system(point)["zero_r"], {"pa": False, "pa_cpu": False})
    return st.inputs_from_point(point, **flags)


def paper_prediction(point, hardware=None, systems: dict | None = None) -> st.StepTime:
    """The point predicted for the system the paper ran it with, on dgx2_v100 by default;
    `systems` replaces a system by a variant of it (name -> System)."""
    name = paper_system(point)["system"]
    return st.predict(paper_inputs(point), hardware or profile(PAPER_CLUSTER), (systems or {}).get(name, name))


# -- the paper's numbers -----------------------------------------------------------------------
def _series(point) -> str:
    return point.note if point.experiment != "fig3" else "ZeRO"


def _x(point) -> str:
    return f"{point.gpus} GPUs" if point.experiment == "fig3" else point.model.get("label", "")


@cache
def figure_readings() -> dict[tuple[str, str, str], float]:
    """DeepSpeed's ZeRO-2 figure, read from pixels (APPROX): (experiment, series, x) -> value."""
    names = {"DeepSpeed (ZeRO-2)": ("fig2", "ZeRO"), "Baseline w. internode MP": ("fig2", "Baseline"),
             "Performance/GPU (bar; right axis)": ("fig3", "ZeRO"), "ZeRO-2 DP": ("fig4", "ZeRO"),
             "Baseline DP": ("fig4", "Baseline (DDP)"), "ZeRO Speed-up (bar; right axis)": ("fig2", "speedup"),
             "Observed Performance (total; log2 left axis)": ("fig3", "total"),
             "DeepSpeed (ZeRO-1)": ("fig2", "ZeRO-1")}
    df = pd.read_csv(PAPER_DIR / "digitized_deepspeed_zero2_figure_APPROX.csv")
    return {(*names[s], x): float(v) for s, x, v in zip(df.series_as_labelled, df.x, df.value) if s in names}


# Numbers the paper's text states for one point: (experiment, series, x) -> (printed, value, claim id).
TEXT_NUMBERS = {
    ("fig2", "ZeRO", "100B"): (">38", 38.0, "S1-8"),
    ("fig2", "Baseline", "40B"): ("~5", 5.0, "S1-2"),
    ("fig4", "Baseline (DDP)", "1.38B"): ("<20", 20.0, "S10-10"),
}


# -- predictions -------------------------------------------------------------------------------
def _records_by_point(records: list[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in records:
        c = r.get("config", {})
        key = (r.get("experiment"), c.get("model", {}).get("name"), r.get("stage"), r.get("world_size"),
               r.get("tp"), r.get("micro_batch"), c.get("note", ""))
        out.setdefault(key, []).append(r)
    return out


def _point_key(p) -> tuple:
    return (p.experiment, p.model["name"], p.stage, p.gpus, p.tp, p.micro_batch, p.note)


def predicted_rows(records: list[dict] | None = None) -> list[dict]:
    """One row per paper point of Figures 2, 3, 4 and 8: the paper's numbers, the prediction on
    the paper's cluster with its breakdown, the same recipe on DGX H100 nodes (a hypothetical:
    the system's 2019-2020 software on today's hardware), and what records
    of the point say (measured TFLOPs; the prediction redone with a simulated record's engine
    counts)."""
    v100, h100 = profile(PAPER_CLUSTER), profile(TODAY_CLUSTER)
    by_point = _records_by_point(records or [])
    readings = figure_readings()
    rows = []
    for experiment in FIGURES:
        for point in paper_points(experiment):
            x, sys = paper_inputs(point), paper_system(point)
            pred, today = st.predict(x, v100, sys["system"]), st.predict(x, h100, sys["system"])
            series, label = _series(point), _x(point)
            printed, text_value, claim = TEXT_NUMBERS.get((experiment, series, label), ("-", None, ""))
            reading = readings.get((experiment, series, label))
            found = by_point.get(_point_key(point), [])
            measured = [r["tflops_per_gpu"] for r in found if r.get("status") == "ok"
                        and r.get("measured_by") != "simulated" and isinstance(r.get("tflops_per_gpu"), float)]
            simulated = [r for r in found if r.get("measured_by") == "simulated"
                         and r.get("comm", {}).get("by_purpose") is not None]
            engine = None
            if simulated:
                counted = replace(x, engine_counts=simulated[0]["comm"]["by_purpose"])
                engine = st.predict(counted, v100, "zero_repro").tflops_per_gpu
            rows.append({
                "figure": experiment, "series": series, "model": label, "params_B": point_params(point) / 1e9,
                "gpus": point.gpus, "mp": point.tp, "dp": point.dp, "micro_batch": point.micro_batch,
                "stage": point.stage, "zero_r": sys["zero_r"], "system": sys["system"],
                "paper_text": printed, "paper_text_claim": claim, "paper_text_value": text_value,
                "ds_figure_APPROX": reading,
                "predicted": pred.tflops_per_gpu,
                "pred_over_text": pred.tflops_per_gpu / text_value if text_value else None,
                "pred_over_ds_figure": pred.tflops_per_gpu / reading if reading else None,
                "step_s": pred.step_s, **{f"{term}_s": pred.terms[term] for term in st.TERMS},
                "dominant": pred.dominant(), "predicted_h100": today.tflops_per_gpu,
                "measured": max(measured) if measured else None,
                "predicted_engine_counts": engine,
            })
    _add_speedups(rows)
    return rows


def point_params(point) -> float:
    from experiments.models.gpt_shape import parameter_count
    return parameter_count(point.shape, point.tp)


def _add_speedups(rows: list[dict]) -> None:
    """Figure 2's ZeRO rows get ZeRO / Baseline at the same size (the '10x' claim)."""
    readings = figure_readings()
    base = {r["model"]: r["predicted"] for r in rows if r["figure"] == "fig2" and r["series"] == "Baseline"}
    for r in rows:
        zero2 = r["figure"] == "fig2" and r["series"] == "ZeRO"
        r["speedup_predicted"] = r["predicted"] / base[r["model"]] if zero2 and r["model"] in base else None
        r["speedup_ds_figure_APPROX"] = readings.get(("fig2", "speedup", r["model"])) if zero2 else None


THROUGHPUT_COLUMNS = {
    "figure": "figure", "series": "series", "model": "model", "gpus": "GPUs", "mp": "MP", "dp": "DP",
    "micro_batch": "batch/replica", "zero_r": "ZeRO-R", "paper_text": "paper text (TFLOPs/GPU)",
    "ds_figure_APPROX": "DeepSpeed figure, APPROX", "predicted": "predicted", "pred_over_text": "pred/text",
    "pred_over_ds_figure": "pred/figure", "speedup_predicted": "ZeRO/baseline pred",
    "speedup_ds_figure_APPROX": "ZeRO/baseline figure APPROX", "system": "system", "step_s": "step s",
    "compute_gemm_s": "GEMM s", "compute_memory_bound_s": "memory-bound s", "kernel_floors_s": "kernel floors s",
    "tp_comm_s": "TP comm s", "dp_comm_exposed_s": "DP comm s (exposed)", "pa_s": "Pa s", "offload_s": "Pa+cpu s",
    "optimizer_s": "optimizer s", "dominant": "dominant term",
    "predicted_h100": "same recipe on DGX H100", "measured": "measured", "predicted_engine_counts": "pred. w/ engine counts",
}


def throughput_predicted(records: list[dict] | None = None) -> pd.DataFrame:
    """The throughput table: every paper point, paper (text; DeepSpeed figure APPROX), predicted
    (TFLOPs/GPU on the paper's DGX-2 cluster), their ratios, the time breakdown (seconds per step),
    what the same recipe would give on DGX H100 nodes (the same software, hypothetically), and
    measured where a record exists."""
    df = pd.DataFrame(predicted_rows(records))[list(THROUGHPUT_COLUMNS)]
    # a model's output: TFLOPs and ratios to 2 decimals, seconds to 3 (the readings are +-0.5 anyway)
    numeric = {c: (3 if c.endswith("_s") else 2) for c in THROUGHPUT_COLUMNS
               if c not in ("gpus", "mp", "dp", "micro_batch") and pd.api.types.is_numeric_dtype(df[c])}
    for column, digits in numeric.items():
        df[column] = df[column].round(digits)
    return df.rename(columns=THROUGHPUT_COLUMNS)


# -- the paper's claims, one by one ------------------------------------------------------------
def _rows_by(rows: list[dict], figure: str, series: str | None = None) -> list[dict]:
    return [r for r in rows if r["figure"] == figure and (series is None or r["series"] == series)]


def _one(rows, figure, series, model) -> dict:
    return next(r for r in rows if r["figure"] == figure and r["series"] == series and r["model"] == model)


def _ckpt_gb(b: int, s: int, h: int, layers: int, e: int = 2) -> float:
    """One fp16 checkpoint per layer: s·b·h·e bytes x layers."""
    return s * b * h * layers * e / 1e9


def _simulated_status(records: list[dict], experiment: str, model: str, stage: int) -> str | None:
    found = [r for r in records if r.get("measured_by") == "simulated" and r.get("experiment") == experiment
             and r.get("config", {}).get("model", {}).get("name") == model and r.get("stage") == stage]
    if not found:
        return None
    r = found[0]
    peak = r.get("memory", {}).get("peak_bytes")
    return f"{'fits' if r['status'] == 'ok' else r['status']}" + (f" (peak {peak / 1e9:.1f} GB)" if peak else "")


def _fig6_searched(records: list[dict]) -> tuple[str, str, str]:
    """Figure 6's largest model per configuration, from the simulated searches of experiment=fig6."""
    found = {rec.get("zero_r_config"): rec["largest_search"] for rec in records
             if rec.get("measured_by") == "simulated" and (rec.get("largest_search") or {}).get("experiment") == "fig6"}
    if not all(c in found for c in ("C1", "C2", "C4", "C5")):
        return ("-", "not checked", "simulate it: " + script_command(
            "experiments/sweep.py", "experiment=fig6 simulate=true simulate_largest=true"))
    sizes = " / ".join(f"{found[c]['simulated_max_params'] / 1e9:.1f}B" for c in ("C1", "C2", "C4", "C5"))
    return (sizes, "simulated", "largest model of each row's family whose simulated peak fits 32 GB less the CUDA "
            "reserve, MP 16 on 400 GPUs (largest.md, experiment fig6)")


def _fig7_simulated(records: list[dict]) -> tuple[str, str, str]:
    """Figure 7's models: which of them were simulated per configuration (experiment=fig7)."""
    models = sorted({r["model"]["name"] for r in records if r.get("experiment") == "fig7"
                     and r.get("measured_by") == "simulated" and r.get("status") == "ok"})
    if not models:
        return ("-", "not checked", "simulate it: " + script_command("experiments/sweep.py", "experiment=fig7 simulate=true"))
    return (f"simulated peaks of {', '.join(models)} per configuration", "simulated",
            "allocated bytes, not PyTorch's cached memory (fig7_memory.md; the stated relations: fig7_statements.md)")


def paper_claims(records: list[dict] | None = None) -> pd.DataFrame:
    """Every claim of results/paper/text_claims.csv with ours beside it, and how ours was obtained:
    formula (the suite's analytic models), measured (CPU) (records of this suite's runs),
    simulated (records of simulate=true runs), predicted (the step-time model), config
    (the cluster config), or not checked (and why)."""
    records = records or []
    rows = predicted_rows(records)
    with open(PAPER_DIR / "text_claims.csv") as f:
        claims = list(csv.DictReader(f))
    ours = _ours(rows, records)
    out = []
    for c in claims:
        value, kind, how = ours.get(c["id"], ("-", "not checked", "no quantity the suite computes"))
        out.append({"id": c["id"], "section": c["section"], "claim": c["quantity"],
                    "paper": f"{c['value']} {c['unit']}".strip(), "ours": value, "kind": kind, "how": how})
    return pd.DataFrame(out)


def _ours(rows: list[dict], records: list[dict]) -> dict[str, tuple[str, str, str]]:  # noqa: C901 (one entry per claim)
    z100, b100 = _one(rows, "fig2", "ZeRO", "100B"), _one(rows, "fig2", "Baseline", "100B")
    b40 = _one(rows, "fig2", "Baseline", "40B")
    zero2 = _rows_by(rows, "fig2", "ZeRO")
    speedups = {r["model"]: r["speedup_predicted"] for r in zero2 if r["speedup_predicted"]}
    best = max(speedups, key=speedups.get)
    mid = [r for r in zero2 if r["model"] in ("8B", "40B", "60B", "80B", "100B")]
    avg_pf = sum(r["predicted"] * r["gpus"] for r in mid) / len(mid) / 1000
    v100 = load_cluster(PAPER_CLUSTER)
    peak_pf = v100["peak_tflops"] * 400 / 1000
    fig3 = sorted(_rows_by(rows, "fig3"), key=lambda r: r["gpus"])
    agg = [(r["gpus"], r["predicted"] * r["gpus"]) for r in fig3]
    doubling = ", ".join(f"{g1}->{g2}: x{a2 / a1:.2f} (GPUs x{g2 / g1:.2f})" for (g1, a1), (g2, a2) in zip(agg, agg[1:]))
    per_gpu = ", ".join(f"{r['gpus']}: {r['predicted']:.1f}" for r in fig3)
    fig4z = _rows_by(rows, "fig4", "ZeRO")
    avg4 = sum(r["predicted"] for r in fig4z) / len(fig4z)
    ddp138 = _one(rows, "fig4", "Baseline (DDP)", "1.38B")
    z13 = _one(rows, "fig4", "ZeRO", "13B")
    c4 = next(r for r in _rows_by(rows, "fig8") if r["zero_r"] == "C4")
    c5 = next(r for r in _rows_by(rows, "fig8") if r["zero_r"] == "C5" and r["gpus"] == 128)
    z170 = _one(rows, "fig2", "ZeRO", "170B")

    gb = 1e9
    psi15 = 1.5e9
    s = 1024
    # memory formulas (K = 12, fp16 params and grads)
    pos = lambda psi, nd: model_state_bytes(psi, 1, nd)["total"]  # noqa: E731
    posg = lambda psi, nd: model_state_bytes(psi, 2, nd)["total"]  # noqa: E731
    posgp = lambda psi, nd: model_state_bytes(psi, 3, nd)["total"]  # noqa: E731
    dp_only_max = max_params(32e9, 0, 64) / 1e9

    sim13 = _simulated_status(records, "fig4", "fig4_13b", 2)
    sim138 = _simulated_status(records, "fig4", "fig4_1.38b", 0)
    sim170 = _simulated_status(records, "fig8", "fig2_170b", 2) or _simulated_status(records, "fig2", "fig2_170b", 2)
    fig6, fig7 = _fig6_searched(records), _fig7_simulated(records)
    ckpt100 = _ckpt_gb(32, s, 8192, 125)
    ckpt170 = _ckpt_gb(12, s, 8192, 212) / 16
    states170 = posg(171.168e9 / 16, 25) / gb

    return {
        "A1": (f"170B at {z170['predicted']:.1f} TFLOPs/GPU (C5)", "predicted",
               "largest Figure 2 point, ZeRO-100B with Pa+cpu on 400 V100s"),
        "A2": (f"{z100['predicted'] * 400 / 1000:.1f} PFLOPs at 100B", "predicted", "100B point x 400 GPUs"),
        "A3": (f"{170 / 20:.1f}x (170B vs Megatron's 16-20B)", "formula",
               "ratio of the paper's own sizes (S9-1, S10-4); not an independent check"),
        "A4": (f"{speedups['100B']:.1f}x at 100B", "predicted", "ZeRO-100B / Megatron baseline, Figure 2 points"),
        "A5": (f"13B at MP 1: {z13['predicted']:.1f} TFLOPs/GPU" + (f"; simulated: {sim13}" if sim13 else ""),
               "simulated" if sim13 else "predicted",
               f"Table 1 states 2Ψ + 14Ψ/128 = {posg(12.696e9, 128) / gb:.1f} GB of 32"),
        "S1-1": (f"{dp_only_max:.1f}B (model states alone: 16Ψ <= 32 GB)" + (f"; 1.38B DDP simulated: {sim138}" if sim138 else ""),
                 "simulated" if sim138 else "formula",
                 "16Ψ bytes; activations and buffers bring it lower (dry runs: experiments/sweep.py dry_run=true)"),
        "S1-2": (f"{b40['predicted']:.1f} TFLOPs/GPU ({100 * b40['predicted'] / v100['peak_tflops']:.1f}% of peak)", "predicted",
                 "Figure 2's 40B baseline: MP 32 over two DGX-2 nodes"),
        "S1-3": (f"{16 / (4 + 12 / 64):.2f}x at Nd = 64 (-> 4x)", "formula", "16Ψ / (4Ψ + 12Ψ/Nd)"),
        "S1-4": (f"{16 / (2 + 14 / 64):.2f}x at Nd = 64 (-> 8x)", "formula", "16Ψ / (2Ψ + 14Ψ/Nd)"),
        "S1-5": ("64x at Nd = 64; 3Ψ vs 2Ψ = +50%", "formula", "16Ψ / (16Ψ/Nd); Sec 7 volumes (see S7-1..3)"),
        "S1-6": (f"{16 * 1e12 / 1e12:.0f} TB", "formula", "16Ψ bytes, Ψ = 1e12"),
        "S1-7": (f"{posgp(1e12, 1024) / gb:.3g} GB per GPU (16 x 64 = 1024)", "formula",
                 "16Ψ / (Nm·Nd) with MP 16 inside a DGX-2 node (cluster gpus_per_node 16)"),
        "S1-8": (f"{z100['predicted']:.1f} TFLOPs/GPU, {z100['predicted'] * 400 / 1000:.1f} PFLOPs", "predicted",
                 "Figure 2's 100B ZeRO-100B point (C4), 400 V100s"),
        "S1-9": (f"per GPU {per_gpu}; aggregate {doubling}", "predicted",
                 "Figure 3's points (fig3_configs.csv batch sizes), C5"),
        "A6": ("-", "not checked", "a model trained by others; its parallel configuration is not in the paper"),
        "S1-10": ("-", "not checked", "a release date"),
        "S3-1": (f"{2 * psi15 / gb:.0f} GB", "formula", "2Ψ bytes"),
        "S3-2": ("K = 12: 4 + 4 + 4 bytes (master, momentum, variance)", "formula", "experiments/analysis/memory.py"),
        "S3-3": (f"{16 * psi15 / gb:.0f} GB", "formula", "16Ψ bytes"),
        "S3-4": (f"{12 * 1600 * 32 * s * 48 * 2 / gb:.1f} GB", "formula",
                 "the footnote's 12·h·b·s·l elements x 2 bytes (Korthikanti's count, experiments/analysis/activations.py, is larger)"),
        "S3-5": (f"{100 * (recompute_factor(True) / recompute_factor(False) - 1):.0f}%", "formula",
                 "Eq. 3's c = 4 vs 3: one extra forward"),
        "S3-6": (f"{_ckpt_gb(32, s, 1600, 48):.1f} GB", "formula", "one fp16 checkpoint per layer, s·b·h·l·2 bytes"),
        "S3-7": (f"{ckpt100:.1f} GB", "formula", "s·b·h·l·2 bytes for the 100B shape (125 x 8192), b = 32"),
        "S3-8": (f"{4 * psi15 / gb:.0f} GB", "formula", "4Ψ bytes"),
        "S3-9": ("-", "not checked", "fragmentation needs a GPU's allocator"),
        "S3-10": ("12·h·b·s·l", "formula", "used as printed in S3-4"),
        "S4-1": (f"{recompute_factor(True) * 12 * 1600 * (1 + s / (6 * 1600)) / 2 / 1000:.0f}K FLOPs per byte (h = 1600), "
                 f"{recompute_factor(True) * 12 * 8192 * (1 + s / (6 * 8192)) / 2 / 1000:.0f}K (h = 8192)", "formula",
                 "a layer's FLOPs per iteration (Eq. 3) over its checkpoint's bytes: 24·c·h·(1 + s/6h)/2, linear in h"),
        "S5-1": (f"{pos(7.5e9, 64) / gb:.1f} GB", "formula", "Table 1"),
        "S5-2": (f"{posg(7.5e9, 64) / gb:.1f} GB", "formula", "Table 1"),
        "S5-3": (f"{posgp(7.5e9, 64) / gb:.2f} GB", "formula", "Table 1"),
        "S5-4": (", ".join(f"{max_params(32e9, k, 64) / 1e9:.1f}B" for k in (1, 2, 3)), "formula", "Table 2's analysis, 32 GB"),
        "S5-5": (f"{dp_only_max:.1f}B", "formula", "16Ψ <= 32 GB (model states only)"),
        "S6-1": (f"{ckpt100:.1f} GB", "formula",
                 "s·b·h·l·2 bytes, b = 32: every MP rank holds every layer's whole checkpoint (twice the paper's 33)"),
        "S6-2": (f"{ckpt100 / 16:.1f} GB", "formula", "the same / 16 MP ranks"),
        "S6-3": (f"{4 * 3e9 / gb:.0f} GB", "formula", "4Ψ bytes"),
        "S7-1": comm_claim(records, 0, 2),
        "S7-2": comm_claim(records, 2, 2),
        "S7-3": comm_claim(records, 3, 3),
        "S8-1": (f"{st.TP_ALLREDUCES_PER_LAYER[True]} all-reduces x 2 x s·h·b = 12·s·h·b", "formula",
                 "step_time.tp_comm_s: 2 forward + 2 recomputed forward + 2 backward"),
        "S8-2": (f"s·h·b per block: {100 / 12:.1f}% of 12·s·h·b", "formula", "step_time.pa_s"),
        "S8-3": (f"{v100['gpus_per_node']}", "config", "conf/cluster/dgx2_v100.yaml gpus_per_node"),
        "S8-4": ("2 PCIe copies per checkpoint (out in forward, back in backward)", "formula", "step_time.offload_s"),
        "S9-1": (f"{max_params(32e9, 0, 1, 16) / 1e9:.0f}B by model states alone (16Ψ <= 16 x 32 GB)", "formula",
                 "an upper bound; the paper's 16-20B includes activations"),
        "S9-2": ("-", "not checked", "another paper's BERT result"),
        "S9-3": (f"{1e12 / 330e6:.0f}x", "formula", "1e12 / 330e6"),
        "S9-4": ("-", "not checked", "the paper does not give the estimate's inputs"),
        "S10-1": (f"{v100['gpus_per_node']} GPUs/node, {v100['inter_node_gbps']:g} Gbps/node", "config",
                  "conf/cluster/dgx2_v100.yaml"),
        "S10-2": ("-", "not checked", "software versions"),
        "S10-3": ("-", "not checked", "Megatron-LM's own result"),
        "S10-4": (f"170B: model states {states170:.1f} GB + Pa checkpoints {ckpt170:.1f} GB per GPU"
                  + (f"; simulated: {sim170}" if sim170 else ""), "simulated" if sim170 else "formula",
                  "2Ψ/16 + 14Ψ/(16·25) and s·b·h·l·2/16 at b = 12: near 32 GB before buffers, hence Pa+cpu"),
        "S10-5": (f"{avg_pf:.1f} PFLOPs average ({100 * avg_pf / peak_pf:.0f}% of {peak_pf:g} PF peak)", "predicted",
                  "mean over Figure 2's ZeRO 8B, 40B, 60B, 80B, 100B points x 400 GPUs"),
        "S10-6": (f"{v100['nvlink_links']} NVLinks x {v100['nvlink_link_gb_per_s']:g} GB/s per direction into NVSwitch "
                  f"(NCCL's width; 25 on the datasheet), {v100['inter_node_gbps'] / 8 / v100['nics_per_node']:g} GB/s per IB link",
                  "config", "conf/cluster/dgx2_v100.yaml"),
        "S10-7": (f"up to {speedups[best]:.1f}x ({best})", "predicted", "max over Figure 2 sizes 1.5B-170B"),
        "S10-8": (f"per GPU {per_gpu}", "predicted", "see S1-9"),
        "S10-9": (f"{avg4:.1f} TFLOPs/GPU average (1.5B-13B)", "predicted", "mean over Figure 4's ZeRO points"),
        "S10-10": (f"{ddp138['predicted']:.1f} TFLOPs/GPU (1.38B DDP, batch 1)", "predicted",
                   f"Figure 4's DDP baseline: its largest term is {ddp138['dominant']}, its exposed all-reduce "
                   f"{ddp138['dp_comm_exposed_s']:.3f} s of a {ddp138['step_s']:.3f} s step"),
        "S10-11": fig6,
        "S10-12": ("16x", "formula", "Pa divides each checkpoint over the 16 MP ranks"),
        "S10-13": fig7,
        "S10-14": ("see S10-4", "formula" if not sim170 else "simulated", "model states + Pa checkpoints at 170B"),
        "S10-15": (f"C5 / C4 = {c5['predicted'] / c4['predicted']:.3f}", "predicted",
                   "60B, 128 GPUs, batch 32: Pa+cpu's PCIe copies"),
        "S10-16": ("-", "not checked", "a trained model's perplexity"),
        "S10-17": ("-", "not checked", "Turing-NLG's parallel configuration is not in the paper"),
        "S10-18": ("-", "not checked", "a training curve"),
    }


# -- the targets and their sensitivity to the uncertain constants -----------------------
MEGATRON_1_2B = {"name": "megatron_1.2b", "layers": 40, "hidden": 1536, "heads": 16, "seq_len": 1024, "vocab_size": 51200}
MEGATRON_CLUSTER = "dgx2h_v100"
# (target, low, high, the paper's or the source's value): predicted on dgx2_v100 with each paper
# system as it ran; Megatron-LM's point on dgx2h_v100. Bands from the Targets section.
TARGETS = {
    "ZeRO-100B, Figure 2 (TFLOPs/GPU)": ("38 +-15%", 38 * 0.85, 38 * 1.15, ">38 (Sec 1)"),
    "ZeRO / Megatron baseline at 100B": ("6x-15x", 6.0, 15.0, "up to 10x (Sec 10.2)"),
    "Megatron 40B, MP 32 over two nodes (TFLOPs/GPU)": ("5 +-40%", 3.0, 7.0, "about 5 (Sec 1)"),
    "Figure 4: 13B at batch 2 / best ZeRO point": ("<= 0.75", 0.0, 0.75, "~21 / ~47 (DeepSpeed figure)"),
    "Figure 4: PyTorch DDP 1.38B at batch 1 (TFLOPs/GPU)": ("< 20", 0.0, 20.0, "less than 20 (Sec 10.4)"),
    "Figure 4: ZeRO points' average (TFLOPs/GPU)": (">= 34", 34.0, float("inf"), "over 40 (Sec 10.4)"),
    "Figure 3: per-GPU throughput 128 / 64 GPUs": ("> 1 (superlinear)", 1.0 + 1e-9, float("inf"), "superlinear (Sec 10.3)"),
    "Megatron-LM 1.2B on one DGX-2H GPU (TFLOPs/GPU)": ("39 +-15%", 39 * 0.85, 39 * 1.15, "39 (Shoeybi et al. 2019)"),
}


def megatron_check(hardware=None, systems: dict | None = None) -> st.StepTime:
    """Megatron-LM 2019's single-GPU baseline: 1.2B GPT, batch 8, fp16, recompute, unfused layer."""
    x = st.StepInputs(**st.shape_inputs(MEGATRON_1_2B, 1), micro_batch=8, tp=1, dp=1, stage=0)
    return st.predict(x, hardware or profile(MEGATRON_CLUSTER), (systems or {}).get("megatron2019", "megatron2019"))


MEASURED_STEPS_CSV = REPO / "results" / "external" / "megatron_lm_steps.csv"


def measured_steps_table() -> pd.DataFrame:
    """Megatron-LM's own step times for its 1.2B point (results/external/megatron_lm_steps.csv)
    beside the model's: a check of the step time itself, whatever either side counts as a FLOP.
    Only the 2019 unfused layer is modelled (system megatron2019); v1.0's fused layer is not. The
    last columns bound what the GEMMs could add: the same prediction with the ceiling of the
    slowest large GEMM DeepBench measured (gemm_check.py)."""
    from experiments.analysis.hardware import from_cluster
    from experiments.reports.gemm_check import reached_ceilings
    predicted = megatron_check()
    slowest = round(min(reached_ceilings()), 3)
    at_slowest = megatron_check(from_cluster({**load_cluster(MEGATRON_CLUSTER), "gemm_ceiling": slowest}))
    rows = []
    with open(MEASURED_STEPS_CSV) as f:
        for r in csv.DictReader(f):
            measured_s = float(r["iteration_ms"]) / 1e3
            modelled = r["system"] == "megatron2019"
            rows.append({"step": r["label"], "GPUs": int(r["gpus"]), "batch": int(r["batch"]),
                         "measured s": measured_s, "provenance": r["provenance"],
                         "stated TFLOPs": float(r["tflops_stated"]),
                         "stated TFLOP per step": round(float(r["tflops_stated"]) * measured_s, 2),
                         "Eq. 3 TFLOP per step": round(predicted.flops_per_gpu / 1e12, 2),
                         "Eq. 3 TFLOPs at the measured step": round(predicted.flops_per_gpu / measured_s / 1e12, 2),
                         "predicted s": round(predicted.step_s, 3) if modelled else "-",
                         "predicted / measured": round(predicted.step_s / measured_s, 3) if modelled else "-",
                         f"predicted s, ceiling {slowest}": round(at_slowest.step_s, 3) if modelled else "-",
                         f"/ measured, ceiling {slowest}": round(at_slowest.step_s / measured_s, 3) if modelled else "-"})
    return pd.DataFrame(rows)


def headlines(paper_hw=None, megatron_hw=None, systems: dict | None = None) -> dict[str, st.StepTime | float]:
    """Each target's predicted value (and the step behind it, where one step gives it)."""
    pred = {(p.experiment, _series(p), _x(p)): paper_prediction(p, paper_hw, systems) for e in ("fig2", "fig3", "fig4")
            for p in paper_points(e)}
    z100, b100 = pred[("fig2", "ZeRO", "100B")], pred[("fig2", "Baseline", "100B")]
    zero4 = [v.tflops_per_gpu for (e, s, _), v in pred.items() if e == "fig4" and s == "ZeRO"]
    return {
        "ZeRO-100B, Figure 2 (TFLOPs/GPU)": z100,
        "ZeRO / Megatron baseline at 100B": z100.tflops_per_gpu / b100.tflops_per_gpu,
        "Megatron 40B, MP 32 over two nodes (TFLOPs/GPU)": pred[("fig2", "Baseline", "40B")],
        "Figure 4: 13B at batch 2 / best ZeRO point": pred[("fig4", "ZeRO", "13B")].tflops_per_gpu / max(zero4),
        "Figure 4: PyTorch DDP 1.38B at batch 1 (TFLOPs/GPU)": pred[("fig4", "Baseline (DDP)", "1.38B")],
        "Figure 4: ZeRO points' average (TFLOPs/GPU)": sum(zero4) / len(zero4),
        "Figure 3: per-GPU throughput 128 / 64 GPUs": (pred[("fig3", "ZeRO", "128 GPUs")].tflops_per_gpu
                                                       / pred[("fig3", "ZeRO", "64 GPUs")].tflops_per_gpu),
        "Megatron-LM 1.2B on one DGX-2H GPU (TFLOPs/GPU)": megatron_check(megatron_hw, systems),
    }


def _value(v) -> float:
    return v.tflops_per_gpu if isinstance(v, st.StepTime) else v


def targets_table() -> pd.DataFrame:
    """The issue's Targets: each predicted value beside its band and the paper's number. The
    verdict is on the suite's FLOP count (Eq. 3, which counts the recomputed forward: c = 4).
    Neither Megatron-LM 2019 nor the ZeRO paper states its count; `if 3 passes` is the same
    prediction counted without the recomputed forward (c = 3: 3/4 of it), a reading of the
    papers' numbers, not a second verdict."""
    rows = []
    for name, value in headlines().items():
        band, low, high, paper = TARGETS[name]
        v = _value(value)
        recomputes = isinstance(value, st.StepTime) and value.details.get("recompute")
        rows.append({"target": name, "band": band, "paper": paper, "predicted": round(v, 2),
                     # whose step the model predicts: the system the paper ran (a ratio's: both, in its name)
                     "system": SYSTEMS[value.system].label if isinstance(value, st.StepTime) else "-",
                     "met": "yes" if low <= v <= high else "no",
                     "if 3 passes": round(v * recompute_factor(False) / recompute_factor(True), 2) if recomputes else "-",
                     "dominant term": value.dominant() if isinstance(value, st.StepTime) else "-"})
    return pd.DataFrame(rows)


# The constants whose values are least certain, each moved +-20% in the sensitivity table: the
# hardware profiles' (both clusters moved together) and the paper's systems' torch <= 1.4 rate and
# host cost per kernel.
UNCERTAIN = {"gemm_ceiling": "GEMM ceiling", "hbm_fraction": "HBM fraction", "kernel_floor_us": "kernel floor",
             "nvlink_link_gb_per_s": "NVLink width", "inter_node_gbps": "InfiniBand", "nccl_latency": "NCCL latencies",
             "pcie_gb_per_s": "PCIe",
             "scalar_half_load_fraction": f"torch <= 1.4 fp16 rate ({TORCH_1_4_SCALAR_HALF_LOADS:g})",
             "host_s_per_kernel": f"paper stacks' host cost per kernel ({PAPER_STACKS_HOST_S_PER_KERNEL * 1e6:g} us)"}


def _moved(cluster: str, key: str, factor: float):
    from experiments.analysis.hardware import from_cluster
    conf = load_cluster(cluster)
    if key == "nccl_latency":
        hw = from_cluster(conf)
        return replace(hw, collectives=replace(hw.collectives, latency_scale=factor))
    return from_cluster({**conf, key: conf[key] * factor})


def _moved_headlines(key: str, factor: float) -> dict:
    from experiments.analysis.systems import SYSTEMS
    if key == "scalar_half_load_fraction":
        return headlines(systems={name: replace(sys, scalar_half_load_fraction=sys.scalar_half_load_fraction * factor)
                                  for name, sys in SYSTEMS.items()})
    if key == "host_s_per_kernel":
        return headlines(systems={name: replace(sys, host_s_per_kernel=sys.host_s_per_kernel * factor)
                                  if name in PAPER_STACK_HOST_SYNCS else sys for name, sys in SYSTEMS.items()})
    return headlines(_moved(PAPER_CLUSTER, key, factor), _moved(MEGATRON_CLUSTER, key, factor))


def sensitivity_table() -> pd.DataFrame:
    """For each target: its prediction, its dominant term, and the prediction with each uncertain
    constant at 0.8x and 1.2x (UNCERTAIN)."""
    base = headlines()
    moved = {(key, f): _moved_headlines(key, f) for key in UNCERTAIN for f in (0.8, 1.2)}
    rows = []
    for name, value in base.items():
        row = {"target": name, "predicted": round(_value(value), 2),
               "dominant term": value.dominant() if isinstance(value, st.StepTime) else "-"}
        for key, label in UNCERTAIN.items():
            row[f"{label} -20% / +20%"] = f"{_value(moved[(key, 0.8)][name]):.2f} / {_value(moved[(key, 1.2)][name]):.2f}"
        rows.append(row)
    return pd.DataFrame(rows)
