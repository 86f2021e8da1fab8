"""Rows that look alike say what tells them apart: Table 2's search summary names each
baseline's optimizer step, a prediction names the system whose step it models, and the dry
run's memory verdict says it is the formulas' while the simulation decides."""
from __future__ import annotations

from pathlib import Path

from experiments.points import expand
from experiments.records import load_records
from experiments.reports import scorecard, tables
from experiments.sweeps.dry_run import dry_run
from experiments.sweeps.largest import Search, rows_to_search
from experiments.sweeps.summary import largest_markdown, simulated_summary_markdown, simulated_summary_rows

REFERENCE_RUNS = Path(__file__).resolve().parents[2] / "results" / "reference" / "runs"


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _table(markdown: str) -> list[dict[str, str]]:
    header, _, *rows = markdown.splitlines()
    return [dict(zip(_cells(header), _cells(row))) for row in rows]


def test_table2s_summaries_name_each_baselines_optimizer_step(compose, tmp_path):
    """Table 2 runs each baseline with a whole and a chunked optimizer step: the search's summary
    and the simulated sweep's show which row is which."""
    points = expand(compose("experiment=table2", "simulate=true", "simulate_largest=true"))
    baselines = [row for row in rows_to_search(points) if row.stage == 0 and row.tp == 1]
    searched = _table(largest_markdown([Search(row).result() for row in baselines]))
    assert sorted(r["optimizer step"] for r in searched) == ["chunked", "whole"]
    assert searched[0]["family (h, heads)"] == searched[1]["family (h, heads)"] and searched[0]["MP"] == "1"
    simulated = _table(simulated_summary_markdown(simulated_summary_rows(baselines, tmp_path)))
    assert sorted(r["optimizer step"] for r in simulated) == ["chunked", "whole"]


def test_a_predicted_throughput_names_the_system_it_models():
    """throughput.md predicts each record's point as this engine runs it; the scorecard's and
    Figure 2's 100B is ZeRO-100B as DeepSpeed 2020 ran it: each says which."""
    fig2 = tables.throughput_table(load_records(REFERENCE_RUNS, "fig2"))
    z100 = fig2[(fig2.model == "fig2_100b") & (fig2.stage == "Pos+g")]
    assert set(z100.predicted_system) == {"zero_repro (this engine)"}
    card = scorecard.scorecard(load_records(REFERENCE_RUNS)).set_index("artefact")
    assert card.loc["Figure 2: 100B at 38 TFLOPs/GPU, 15 PFLOPs"].how == \
        "predicted (step-time model): ZeRO-100B (DeepSpeed 2020)"
    assert card.loc["Throughput target: ZeRO-100B, Figure 2 (TFLOPs/GPU)"].how.endswith("ZeRO-100B (DeepSpeed 2020)")


def test_the_dry_run_says_its_verdict_is_analytic_and_the_simulation_decides(compose, capsys):
    dry_run([p for p in expand(compose("experiment=fig2", "dry_run=true")) if p.model["name"] == "fig2_170b"])
    out = capsys.readouterr().out
    assert "memory per GPU, analytic (formulas, no simulation)" in out and "| fits (analytic) |" in out
    assert "'fits (analytic)' is an estimate from formulas: the simulation decides (simulate=true" in out
