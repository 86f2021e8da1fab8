"""Figure 7: peak memory per ZeRO-R configuration (Table 3's C1-C5), from simulated records,
beside what the paper says of it.

The paper prints no GB values for Figure 7 (results/paper/README.md); Section 10.5 states three
relations between its bars, which `fig7_statements` checks against our simulated peaks. Its bars
are "maximum memory cached by PyTorch", ours the simulated rank's peak of allocated bytes (no
allocator: see docs/simulation.md), so a relation is compared, never a value.
"""
from __future__ import annotations

import pandas as pd

from experiments.reports.tables import peak_breakdown_gb

GB = 1e9
# Section 10.5 on Figure 7: (model, config, other config, the paper's words, the relation it
# states between config's peak and the other's: "lower", "no lower", or None when it states none)
STATEMENTS = (
    ("zr_40b", "C2", "C1", "memory decreases from C1 to C2", "lower"),
    ("zr_40b", "C3", "C2", "C2 vs C3 depends on the model", None),
    ("zr_40b", "C5", "C4", "no decrease from C4 to C5 for 40B", "no lower"),
    ("fig2_100b", "C5", "C4", "a decrease from C4 to C5 for 100B", "lower"),
)
# "No decrease" read as: C5 saves less than this fraction of C4's peak. The paper's bars are
# read by eye; a difference under 2% of a ~30 GB bar is not one a reader of the figure can see.
NO_DECREASE = 0.02


def fig7_records(records: list[dict]) -> list[dict]:
    """The simulated records of Figure 7's points."""
    return [r for r in records if r.get("experiment") == "fig7" and r.get("measured_by") == "simulated"
            and r.get("memory", {}).get("peak_bytes") is not None]


def fig7_table(records: list[dict]) -> pd.DataFrame:
    """One row per simulated Figure 7 point: its configuration, peak and what the peak holds."""
    rows = []
    for r in fig7_records(records):
        mem = r["memory"]
        rows.append({
            "model": r["model"]["name"], "params_B": r["params"] / GB, "config": r.get("zero_r_config"),
            "micro_batch": r["micro_batch"], "peak_GB": mem["peak_bytes"] / GB, "peak_phase": mem.get("peak_phase"),
            **peak_breakdown_gb(mem), "status": r["status"]})
    return pd.DataFrame(rows, columns=["model", "params_B", "config", "micro_batch", "peak_GB", "peak_phase",
                                       "model_states_GB", "activations_GB", "buffers_GB", "temporaries_GB",
                                       "status"])


def fig7_statements(records: list[dict]) -> pd.DataFrame:
    """Each of Section 10.5's statements on Figure 7 with our two peaks and whether they agree
    (None: the paper states no relation, or a point is missing)."""
    peaks = {(r["model"]["name"], r.get("zero_r_config")): r["memory"]["peak_bytes"] / GB
             for r in fig7_records(records)}
    rows = []
    for model, config, other, words, relation in STATEMENTS:
        mine, theirs = peaks.get((model, config)), peaks.get((model, other))
        ours, agrees = "-", None
        if mine is not None and theirs is not None:
            ours = f"{config} {mine:.2f} GB, {other} {theirs:.2f} GB ({mine - theirs:+.2f})"
            if relation == "lower":
                agrees = mine < theirs * (1 - NO_DECREASE)
            elif relation == "no lower":
                agrees = mine >= theirs * (1 - NO_DECREASE)
        rows.append({"model": model, "paper": words, "ours": ours, "agrees": agrees})
    return pd.DataFrame(rows, columns=["model", "paper", "ours", "agrees"])
