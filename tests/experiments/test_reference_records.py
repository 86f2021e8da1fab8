"""The committed CPU reference records (results/reference/runs/cpu_default and table1, real runs
on a 2-core CPU box) are what the code gives for their points, as the committed reports are what
report.py gives for the records: the same points as a fresh sweep of their experiment, and the
same traffic and model-state bytes as rank 0 of each point played now on fake tensors (a second
each; tests/experiments/test_simulate.py checks a simulated rank against a real one). Else a
change to the engine's schedule leaves the README's and the scorecard's measured numbers stale."""
from __future__ import annotations

from pathlib import Path

import pytest

from experiments.points import Point, expand
from experiments.records import load_records
from experiments.run.fake import simulate_in_child

REFERENCE_RUNS = Path(__file__).resolve().parents[2] / "results" / "reference" / "runs"
CPU_EXPERIMENTS = ("cpu_default", "table1")
MODEL_STATES = ("params", "grads", "optimizer_states", "buffers", "total")
TRAFFIC = ("elements_per_step", "bytes_per_step", "by_purpose")
RERUN = "make reference-cpu"


def committed(experiment: str) -> list[dict]:
    return [r for r in load_records(REFERENCE_RUNS, experiment) if r.get("measured_by") != "simulated"]


@pytest.mark.parametrize("experiment", CPU_EXPERIMENTS)
def test_the_committed_cpu_records_are_a_fresh_sweeps_points(experiment, compose):
    fresh = {p.point_id for p in expand(compose(f"experiment={experiment}"))}
    kept = {r["point_id"] for r in committed(experiment)}
    assert kept == fresh, f"stale: {sorted(kept - fresh)}, missing: {sorted(fresh - kept)}; run {RERUN}"
    assert all(r["status"] == "ok" for r in committed(experiment))


@pytest.mark.parametrize("experiment", CPU_EXPERIMENTS)
def test_the_committed_cpu_records_move_and_hold_what_the_code_does(experiment):
    differ = []
    for record in committed(experiment):
        config = {k: v for k, v in record["config"].items() if k not in ("precision_resolved", "launcher")}
        now = simulate_in_child(Point(**config).as_dict(), record["precision"], 0)["stats"]
        held = {k: now["memory"][k] for k in MODEL_STATES}
        last = now["comm"]["last_step"]
        moved = {"elements_per_step": last["elements"], "bytes_per_step": last["bytes"], "by_purpose": last["by_purpose"]}
        if held != {k: record["memory"]["measured"][k] for k in MODEL_STATES} \
                or moved != {k: record["comm"][k] for k in TRAFFIC}:
            differ.append((record["point_id"], held, moved))
    assert not differ, f"committed records the code no longer gives: {differ}; run {RERUN}"
