"""The step-time model held against the CPU sweep's measured step times (issue 21, item 4).

With this machine's calibrated profile (`make calibrate`: results/calibration/<hostname>.yaml),
every measured CPU record it can speak for is predicted with the system `zero_repro` (this
engine, its record's own settings) and set beside its measured step time (the median of the
timed steps). Records it cannot speak for are left out, each rule for a reason:
- simulated records (no time), failed ones, GPU ones (the profile is this host's CPU);
- records measured on another host than the profile's (another machine's speed);
- world sizes the profile did not measure: more ranks than cores time-share the cores, which
  the model, one device per rank, does not describe (make calibrate says which it measured).

Target (issue 21): median |predicted/measured - 1| <= 25%, no point off by more than 2x. The
measured step times are wall-clock on a machine that may be shared: a rank preempted by other
processes runs slower than its core, which the profile (each rank's own CPU clock) does not see;
several runs of a point (runs_by_point) let the check take the least disturbed.
"""
from __future__ import annotations

import statistics
from pathlib import Path

import pandas as pd

from experiments.analysis import step_time as st
from experiments.analysis.calibrated import default_path, hardware_from_profile, load_profile
from experiments.analysis.hardware import Hardware

SYSTEM = "zero_repro"
COLUMNS = ["point", "runs", "measured s", "predicted s", "ratio", "largest term"]
MEDIAN_TARGET, FACTOR_TARGET = 0.25, 2.0


def checkable(records: list[dict], profile: dict) -> list[dict]:
    """The measured CPU records of the profile's host at world sizes it measured (1 always)."""
    worlds = {1} | {int(w) for w in profile["collectives"]}
    return [r for r in records if r.get("status") == "ok" and r.get("measured_by") != "simulated"
            and isinstance(r.get("step_time_s"), float) and not (r.get("hardware") or {}).get("gpu_count")
            and (r.get("hardware") or {}).get("host") == profile["host"] and r.get("world_size") in worlds]


def runs_by_point(records: list[dict]) -> dict[str, list[dict]]:
    """Records grouped by point (several `make run`s of one point, e.g. with other train.steps).
    A point's measured step is its fastest run's (each run's own the median of its timed
    steps): other processes on a shared machine only ever add time, and one run can sit in
    another process's burst for all its steps (tiny_l stage 2 world 1 here: 0.11 s and 0.25 s)."""
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(point_label(r), []).append(r)
    return out


def point_label(record: dict) -> str:
    """The point without its config hash: model, stage, world, TP, micro-batch, and the precision
    it ran in (an fp32 and an fp16 run of one shape are two points: their steps differ)."""
    return f"{record['point_id'].rsplit('-', 1)[0]}-{record.get('precision', '?')}"


def prediction_rows(records: list[dict], hw: Hardware) -> pd.DataFrame:
    """One row per point: its runs, the fastest run's measured and the predicted seconds per
    step, their ratio, the model's largest term (where the prediction's time goes)."""
    rows = []
    for label, runs in sorted(runs_by_point(records).items(),
                              key=lambda kv: (kv[1][0]["params"], kv[1][0]["stage"], kv[1][0]["world_size"])):
        measured = min(r["step_time_s"] for r in runs)
        predicted = st.predict(st.inputs_from_record(runs[0]), hw, system=SYSTEM)
        rows.append({"point": label, "runs": len(runs), "measured s": measured, "predicted s": predicted.step_s,
                     "ratio": predicted.step_s / measured, "largest term": max(predicted.terms, key=predicted.terms.get)})
    return pd.DataFrame(rows, columns=COLUMNS)


def summary(rows: pd.DataFrame) -> dict[str, float]:
    """median abs(ratio - 1), max abs(ratio - 1) and the worst factor max(ratio, 1/ratio)."""
    ratios = list(rows["ratio"])
    return {"median abs(ratio - 1)": statistics.median(abs(x - 1) for x in ratios),
            "max abs(ratio - 1)": max(abs(x - 1) for x in ratios),
            "worst factor": max(max(x, 1 / x) for x in ratios)}


def prediction_check(records: list[dict], profile: dict) -> pd.DataFrame | None:
    """The table: a row per checkable record, then the summary rows (their value under ratio,
    the target under largest term). None when no record is checkable."""
    found = checkable(records, profile)
    if not found:
        return None
    rows = prediction_rows(found, hardware_from_profile(profile))
    targets = {"median abs(ratio - 1)": f"target <= {MEDIAN_TARGET:g}", "max abs(ratio - 1)": "",
               "worst factor": f"target <= {FACTOR_TARGET:g}"}
    tail = [{"point": k, "ratio": v, "largest term": targets[k]} for k, v in summary(rows).items()]
    return pd.concat([rows, pd.DataFrame(tail, columns=COLUMNS)], ignore_index=True)


def from_default_profile(records: list[dict], path: Path | None = None) -> tuple[pd.DataFrame | None, str]:
    """(the table or None, a line saying what was checked or how to make the profile)."""
    path = path or default_path()
    if not path.exists():
        return None, (f"prediction_check: no calibrated profile at {path}; run `make calibrate` "
                      "(about a minute) to check the step-time model against the CPU sweep's records")
    profile = load_profile(path)
    table = prediction_check(records, profile)
    if table is None:
        return None, (f"prediction_check: no measured CPU record of host {profile['host']} at worlds "
                      f"{[1] + sorted(int(w) for w in profile['collectives'])}; run `make run` first")
    s = summary(table[~table["point"].isin(["median abs(ratio - 1)", "max abs(ratio - 1)", "worst factor"])])
    return table, (f"prediction_check: {len(table) - 3} points against {path.name} ({profile['date']}): "
                   f"median abs(ratio - 1) {s['median abs(ratio - 1)']:.2f} (target <= {MEDIAN_TARGET:g}), "
                   f"worst factor {s['worst factor']:.2f} (target <= {FACTOR_TARGET:g})" + spread_note(profile))


def spread_note(profile: dict) -> str:
    """How steady the machine was while `make calibrate` measured it (profiles before the
    rounds have none)."""
    spread = profile.get("spread")
    if not spread:
        return ""
    return (f"; the profile's spread over {spread['rounds']} rounds: GEMM rates {spread['gemm_median']:.0%} "
            f"(largest {spread['gemm_max']:.0%}), stream {spread['stream']:.0%}, framework step "
            f"{spread['framework_step']:.0%}"
            + (f", hidden fraction of async collectives (interquartile range over repeats) {spread['collective_overlap']:.2f}"
               if "collective_overlap" in spread else ""))
