"""Figure 7: peak memory per ZeRO-R configuration (Table 3's C1-C5), from simulated records,
beside what the paper says of it; and MD's measured effect.

The paper prints no GB values for Figure 7 (results/paper/README.md); Section 10.5 states three
relations between its bars, which `fig7_statements` checks against our simulated peaks. Its bars
are "maximum memory cached by PyTorch": the bytes the caching allocator reserves, which our
records carry as the replay of the simulated rank's allocations through PyTorch's CUDA caching
allocator (memory.reserved_peak_bytes, experiments/allocator; docs/simulation.md) on the
paper's 32 GB V100, where a cache that reaches the device's size is freed and retried; and with
no device limit (memory.allocator.unbounded: the cache's own high-water mark). Each relation is
judged on that cached memory (`agrees`), and beside it with no limit and on the allocated peak.
A relation is compared, never a value.

MD (contiguous memory optimization) exists to cut fragmentation, so only reserved memory can
show it: the Figure 7 experiment runs each configuration again with MD off, and `md_effect`
sets each pair side by side.
"""
from __future__ import annotations

import pandas as pd

from experiments.reports.tables import peak_breakdown_gb
from zero_impl import ZERO_R_SWITCHES, zero_r_config

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
NO_MD = " no MD"


def fig7_records(records: list[dict]) -> list[dict]:
    """The simulated records of Figure 7's points (its MD-off runs included)."""
    return [r for r in records if r.get("experiment") == "fig7" and r.get("measured_by") == "simulated"
            and r.get("memory", {}).get("peak_bytes") is not None]


def config_label(record: dict) -> str | None:
    """Table 3's name of the record's configuration, or "<name> no MD" for one with MD off and
    otherwise the same switches; None for anything else."""
    if record.get("zero_r_config"):
        return record["zero_r_config"]
    zero = (record.get("config") or {}).get("zero") or {}
    switches = {k: bool(zero.get(k)) for k in ZERO_R_SWITCHES}
    if switches["contiguous_memory_optimization"]:
        return None
    base = zero_r_config(record["stage"], **dict(switches, contiguous_memory_optimization=True))
    return base + NO_MD if base else None


def _gb(mem: dict, key: str) -> float | None:
    """A record's memory field in GB ("unbounded": the replay's reserved peak with no device limit)."""
    if key == "unbounded":
        mem, key = (mem.get("allocator") or {}).get("unbounded") or {}, "reserved_peak_bytes"
    return mem[key] / GB if mem.get(key) is not None else None


def fig7_table(records: list[dict]) -> pd.DataFrame:
    """One row per simulated Figure 7 point: its configuration, the allocated peak and what it
    holds, and the cached (reserved) peak with its fragmentation and the allocator's retries."""
    rows = []
    for r in fig7_records(records):
        mem = r["memory"]
        rows.append({
            "model": r["model"]["name"], "params_B": r["params"] / GB, "config": config_label(r),
            "micro_batch": r["micro_batch"], "peak_GB": mem["peak_bytes"] / GB,
            "reserved_GB": _gb(mem, "reserved_peak_bytes"), "fragmentation": mem.get("fragmentation"),
            "alloc_retries": mem.get("alloc_retries"), "reserved_unbounded_GB": _gb(mem, "unbounded"),
            "peak_phase": mem.get("peak_phase"),
            **peak_breakdown_gb(mem), "status": r["status"]})
    return pd.DataFrame(rows, columns=["model", "params_B", "config", "micro_batch", "peak_GB", "reserved_GB",
                                       "fragmentation", "alloc_retries", "reserved_unbounded_GB", "peak_phase",
                                       "model_states_GB",
                                       "activations_GB", "buffers_GB", "temporaries_GB", "status"])


def _judge(relation: str | None, mine: float, theirs: float) -> bool | None:
    if relation == "lower":
        return mine < theirs * (1 - NO_DECREASE)
    if relation == "no lower":
        return mine >= theirs * (1 - NO_DECREASE)
    return None


def fig7_statements(records: list[dict]) -> pd.DataFrame:
    """Each of Section 10.5's statements on Figure 7 with our two peaks and whether they agree,
    on cached memory (`ours`, `agrees`: the reserved peaks on the device, what the figure
    plots), on cached memory with no device limit (`_unbounded`) and on allocated memory
    (`_allocated`). None: the paper states no relation, or a point (or that peak) is missing."""
    found = {(r["model"]["name"], config_label(r)): r["memory"] for r in fig7_records(records)}
    rows = []
    for model, config, other, words, relation in STATEMENTS:
        row = {"model": model, "paper": words}
        a, b = found.get((model, config)), found.get((model, other))
        for key, suffix in (("reserved_peak_bytes", ""), ("unbounded", "_unbounded"), ("peak_bytes", "_allocated")):
            row.update({"ours" + suffix: "-", "agrees" + suffix: None})
            mine, theirs = (_gb(m, key) if m else None for m in (a, b))
            if mine is not None and theirs is not None:
                row["ours" + suffix] = f"{config} {mine:.2f} GB, {other} {theirs:.2f} GB ({mine - theirs:+.2f})"
                row["agrees" + suffix] = _judge(relation, mine, theirs)
        rows.append(row)
    return pd.DataFrame(rows, columns=["model", "paper", "ours", "agrees", "ours_unbounded", "agrees_unbounded",
                                       "ours_allocated", "agrees_allocated"])


def md_effect(records: list[dict]) -> pd.DataFrame:
    """Each configuration with MD on beside the same one with MD off: allocated and reserved
    peaks, fragmentation, and what MD saves of each (positive: less with MD)."""
    found = {(r["model"]["name"], config_label(r)): r["memory"] for r in fig7_records(records)}
    rows = []
    for (model, label), off in sorted(found.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        if not label or not label.endswith(NO_MD) or (model, label[:-len(NO_MD)]) not in found:
            continue
        config, on = label[:-len(NO_MD)], found[(model, label[:-len(NO_MD)])]
        row = {"model": model, "config": config,
               "allocated_GB_md": on["peak_bytes"] / GB, "allocated_GB_no_md": off["peak_bytes"] / GB,
               "reserved_GB_md": _gb(on, "reserved_peak_bytes"), "reserved_GB_no_md": _gb(off, "reserved_peak_bytes"),
               "fragmentation_md": on.get("fragmentation"), "fragmentation_no_md": off.get("fragmentation"),
               "unbounded_GB_md": _gb(on, "unbounded"), "unbounded_GB_no_md": _gb(off, "unbounded")}
        row["md_saves_allocated_GB"] = row["allocated_GB_no_md"] - row["allocated_GB_md"]
        for key in ("reserved", "unbounded"):
            md, no_md = row[f"{key}_GB_md"], row[f"{key}_GB_no_md"]
            row[f"md_saves_{key}_GB"] = no_md - md if md is not None and no_md is not None else None
        rows.append(row)
    return pd.DataFrame(rows, columns=["model", "config", "allocated_GB_md", "allocated_GB_no_md", "reserved_GB_md",
                                       "reserved_GB_no_md", "fragmentation_md", "fragmentation_no_md", "unbounded_GB_md",
                                       "unbounded_GB_no_md", "md_saves_allocated_GB", "md_saves_reserved_GB",
                                       "md_saves_unbounded_GB"])
