"""The scorecard: the paper's headline claims and artefacts, one row each, with the paper's number,
ours, and how ours was obtained; last, the step-time model's checks against measurements that
are not the paper's (their `paper` cell says whose). report.py writes it (scorecard.md) beside the tables it is read
from; the README pastes the reference set's copy between markers, and a test keeps them equal.

Every cell comes from a table report.py also writes (named in `details`, a file of the same
reports folder): Table 1 and 2's formulas, the claims table (predictions.paper_claims), the
searched largest models (tables.largest_table), the simulated points (tables.simulation_table),
Figure 7's statements (zero_r.fig7_statements), the step-time model's targets
(predictions.targets_table) and its checks against measurements (measured_steps_table,
gemm_check, and one line per development-set file: dev_set.scorecard_rows). A row whose records are not in the set says so instead of a number.
"""
from __future__ import annotations

import re

import pandas as pd

from experiments.analysis.systems import SYSTEMS
from experiments.commands import script_command
from experiments.reports import dev_set, gemm_check, predictions, tables, validation, zero_r

# How ours was obtained, by the claims table's kind.
HOW = {"formula": "formula", "measured (CPU)": "measured on CPU", "simulated": "simulated at full world size",
       "predicted": "predicted (step-time model)", "config": "config", "not checked": "not checked"}
NOT_SIMULATED = "-"


def not_simulated(experiment: str, searched: bool = False) -> str:
    """The `how` of a simulated row this record set lacks: the command that adds it to *this* set
    (make reference would rewrite the committed one instead)."""
    sweep = script_command("experiments/sweep.py", f"experiment={experiment} simulate=true"
                           + (" simulate_largest=true" if searched else ""))
    return f"not in this set: {sweep}, then {script_command('experiments/report.py')}"
COLUMNS = ("artefact", "paper", "ours", "how", "details")


def predicted_by(system: str) -> str:
    """The `how` of a prediction of one system's step (analysis/systems.py): throughput.md's
    predictions of the records are this engine's schedule, these the paper's systems'."""
    return f"{HOW['predicted']}: {SYSTEMS[system].label}"


def _paper_billions(printed: str) -> str:
    """The paper's size in a largest-table cell ("13B (Sec 10.4)", "50B (inferred)") as printed."""
    return re.match(r"[\d.]+B", printed).group(0)


def _largest(largest: pd.DataFrame, experiment: str, stage: str, step: str | None = None) -> pd.DataFrame:
    rows = largest[(largest.experiment == experiment) & (largest.stage == stage)]
    return rows[rows.optimizer_step == step] if step else rows


def scorecard(records: list[dict]) -> pd.DataFrame:
    """One row per headline claim or artefact of the paper: artefact, paper, ours, how, details."""
    claims = predictions.paper_claims(records).set_index("id")
    largest = tables.largest_table(records)
    simulated = tables.simulation_table(records)
    rows: list[tuple[str, str, str, str, str]] = []

    def claim(artefact: str, cid: str, ours: str | None = None, paper: str = "{}", system: str | None = None) -> None:
        c = claims.loc[cid]
        rows.append((artefact, paper.format(c.paper), ours or c.ours, predicted_by(system) if system else HOW[c.kind],
                     f"paper_claims.md {cid}"))

    t1 = tables.table1()
    rows.append(("Table 1: model states per GPU, 7.5B/128B/1T at Nd 1-1024", f"{len(t1)} cells (GB)",
                 f"{int(t1.matches.sum())} of {len(t1)} equal as printed", "formula", "table1.md"))
    memory = tables.memory_table(records)
    held = memory[(memory.measured_by == "hardware") & (memory.status == "ok")].meas_over_pred.dropna()
    rows.append(("Table 1: the model states the engine holds", "16Ψ, 4Ψ+12Ψ/Nd, 2Ψ+14Ψ/Nd, 16Ψ/Nd",
                 f"{held.min():.4f}-{held.max():.4f}x the formula (padding), {len(held)} runs" if len(held)
                 else "-", "measured on CPU" if len(held) else "not run", "memory.md"))
    t2 = tables.table2(records)
    cells = t2[[c for c in t2.columns if c.endswith("_matches")]]
    rows.append(("Table 2: largest model by analysis, 32 GB, Nd 64, MP 1-16", f"{cells.size} cells",
                 f"{int(cells.values.sum())} of {cells.size} equal as printed", "formula", "table2.md"))
    for stage, step, column, name in (("baseline DP", "whole", "measured_baseline_paper", "baseline"),
                                      ("Pos", None, "measured_Pos_paper", "Pos")):
        found = _largest(largest, "table2", stage, step).sort_values("mp")
        ours = (" / ".join(f"{b:.2f}" for b in found.simulated_max_B) + "B") if len(found) else NOT_SIMULATED
        rows.append((f"Table 2: largest {name} measured, MP 1 / 2 / 4 / 8 / 16", " / ".join(t2[column]), ours,
                     HOW["simulated"] if len(found) else not_simulated("table2", searched=True), "table2/largest.md"))

    fig2 = simulated[simulated.experiment == "fig2"]
    rows.append(("Figure 2: every point of ZeRO-100B and the baseline trains, 1.5B-170B", f"{len(predictions.paper_points('fig2'))} points ran",
                 f"{int(fig2.agrees_with_paper.eq(True).sum())} of {len(fig2)} fit in 32 GB" if len(fig2)
                 else NOT_SIMULATED, HOW["simulated"] if len(fig2) else not_simulated("fig2"), "fig2/simulation.md"))
    claim("Figure 2: 100B at 38 TFLOPs/GPU, 15 PFLOPs", "S1-8", system="deepspeed2020")
    at170 = [r for r in records if r.get("measured_by") == "simulated" and r.get("experiment") == "fig2"
             and r["model"]["name"] == "fig2_170b" and r["stage"] == 2]
    rows.append(("Figure 2: 170B on 400 GPUs", claims.loc["S10-4"].paper,
                 (f"{'fits' if at170[0]['status'] == 'ok' else at170[0]['status']}: tensors "
                  f"{at170[0]['memory']['peak_bytes'] / 1e9:.2f} GB"
                  + (f", reserved {at170[0]['memory']['reserved_peak_bytes'] / 1e9:.2f} GB"
                     if at170[0]["memory"].get("reserved_peak_bytes") else "")
                  + f" of 32 with {at170[0].get('zero_r_config')}")
                 if at170 else NOT_SIMULATED, HOW["simulated"] if at170 else not_simulated("fig2"), "fig2/simulation.md"))
    claim("Figure 2: 10x the Megatron-LM baseline", "S10-7")
    claim("Figure 3: superlinear scaling, 60B at MP 16", "S1-9", claims.loc["S1-9"].ours.split("; ")[-1], "superlinear, {}")
    for stage, artefact, paper in (("Pos+g", "Figure 4: 13B without model parallelism", "A5"),
                                   ("baseline DP", "Figure 4: data parallelism alone", "S1-1")):
        found = _largest(largest, "fig4", stage)
        ours = (f"{found.simulated_max_B.iloc[0]:.2f}B largest that fits ({found.simulated_max_layers.iloc[0]} layers)"
                if len(found) else NOT_SIMULATED)
        rows.append((artefact, claims.loc[paper].paper, ours,
                     HOW["simulated"] if len(found) else not_simulated("fig4", searched=True), "fig4/largest.md"))
    claim("Figure 4: throughput without model parallelism", "S10-9")
    fig6 = largest[largest.experiment == "fig6"].set_index("zero_r")
    order = [c for c in ("C1", "C2", "C3", "C4", "C5") if c in fig6.index]
    rows.append(("Figure 6: largest model per ZeRO-R configuration, " + " / ".join(order or ["C1-C5"]),
                 " / ".join(_paper_billions(fig6.paper[c]) + (" (inferred)" if "inferred" in fig6.paper[c] else "")
                            for c in order) or claims.loc["S10-11"].paper,
                 " / ".join(f"{fig6.simulated_max_B[c]:.1f}" for c in order) + "B" if order else NOT_SIMULATED,
                 HOW["simulated"] if order else not_simulated("fig6", searched=True), "fig6/largest.md"))
    statements = zero_r.fig7_statements(records)
    stated = statements[statements.agrees.notna()]
    rows.append(("Figure 7: peak memory per configuration, 40B and 100B", f"{sum(r is not None for *_, r in zero_r.STATEMENTS)} relations stated",
                 f"{int(stated.agrees.astype(bool).sum())} of {len(stated)} hold"
                 + "".join(f"; not: {words}" for words in stated.paper[~stated.agrees.astype(bool)])
                 if zero_r.fig7_records(records)
                 else NOT_SIMULATED, HOW["simulated"] if zero_r.fig7_records(records) else not_simulated("fig7"),
                 "fig7/fig7_statements.md"))
    claim("Figure 8: Pa+cpu (C5) against C4 at 60B", "S10-15")
    claim("Communication: data parallelism", "S7-1")
    claim("Communication: Pos+g", "S7-2")
    claim("Communication: Pos+g+p", "S7-3")
    claim("Memory: Pos at Nd 64", "S1-3")
    claim("Memory: Pos+g at Nd 64", "S1-4")
    for target in predictions.targets_table().itertuples(index=False):   # the step-time model's targets (issue 21)
        rows.append((f"Throughput target: {target.target}", target.paper,
                     f"{target.predicted:g} ({'meets' if target.met == 'yes' else 'misses'} {target.band})",
                     HOW["predicted"] + (f": {target.system}" if target.system != "-" else ""), "targets.md, sensitivity.md"))
    # the model against measurements that are not the paper's (results/external)
    step = predictions.measured_steps_table().set_index("step").loc["Megatron-LM 2019"]
    rows.append(("Step time check: Megatron-LM 2019's 1.2B on one DGX-2H V100",
                 f"not the paper's: {step['measured s']:g} s, derived from Megatron-LM v1.0's measured step",
                 f"{step['predicted s']:g} s ({step['predicted / measured']:g} of it)", HOW["predicted"], "measured_steps.md"))
    gemms = gemm_check.gemm_check_summary().set_index("GEMMs")
    large, small = gemms.loc["large (the ceiling's sample)"], gemms.loc["small or skinny"]
    rows.append(("GEMM check: V100 fp16 GEMMs measured by DeepBench (CUDA 10.1)",
                 f"not the paper's: {int(gemms.loc['all', 'count'])} GEMMs",
                 f"within 25%: {int(large['within 25%'])} of {int(large['count'])} large (in-sample: the ceiling's), "
                 f"{int(small['within 25%'])} of {int(small['count'])} small or skinny", HOW["predicted"],
                 "gemm_check_summary.md, gemm_ceiling.md"))
    summary = validation.validation_summary().set_index("group")
    overall, by_tp = summary.loc[["all"]].iloc[0], summary.loc["TP"]
    rule, model = summary.loc[["fastest TP right"]].iloc[0], summary.loc[["fastest TP right"]].iloc[1]   # no model, ours
    pairs = summary.loc[["TP pair ratio"]].iloc[0]          # the development set's stack's (validation.RANKED_SYSTEMS)
    host, timed = validation.host_constants(), validation.host_time_check()
    rows.append(("Step time check: 720 Megatron-DeepSpeed steps on one A100 node (vTrain's, PP 1)",
                 "not the paper's: measured iteration times",
                 f"error (predicted / measured - 1, absolute) median {overall.median_error:.3f}, p90 "
                 f"{overall.p90_error:.3f}, worst factor "
                 f"{overall.worst_factor:.2f}; median ratio by TP " + " / ".join(f"{r:.2f}" for r in by_tp.median_ratio)
                 + f"; step-time ratio between TP degrees of a run, error median {pairs.median_error:.3f}, p90 "
                   f"{pairs.p90_error:.3f}; fastest TP right in {round(model.fraction * model.rows)} of {model.rows} "
                   f"families, as 'the smallest TP' is in {round(rule.fraction * rule.rows)}; its host cost per "
                   f"kernel is megatron-core's layer timed on a CPU ({timed['layer_ms']:.3f} ms) over the kernels "
                   f"counted, none derived from these rows, whose small ones give a layer {host['layer_slope_ms_tp1']:.3f} "
                   f"ms ({host['host_us_per_kernel']:.1f} us a kernel), {timed['ratio']:.2f}x it: "
                   f"{'within' if timed['passes'] else 'outside'} {validation.HOST_TIME_PLAUSIBLE_FACTOR}x", HOW["predicted"],
                 "validation_summary.md, validation.md, validation_host_constants.md"))
    rows += dev_set.scorecard_rows()   # each development-set file, its host constants left one source out
    return pd.DataFrame(rows, columns=list(COLUMNS))
