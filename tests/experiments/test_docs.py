"""The README and docs/ stay true: every pasted table equals its generated file, the scorecard is
what report.py makes of the reference records, no claim is left "not implemented", the quoted
numbers come from the reference reports, the library example runs, and the guides read as guides."""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from experiments.records import load_records
from experiments.report import to_markdown
from experiments.reports import pasted, predictions, scorecard

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "results" / "reference"
DOCS = sorted((REPO / "docs").glob("*.md"))


@pytest.fixture(scope="module")
def reference_records() -> list[dict]:
    return load_records(REFERENCE / "runs")


def prose(text: str) -> str:
    """The text without its generated blocks and code fences: what a person wrote."""
    text = pasted.BLOCK.sub("", text)
    return re.sub(r"```.*?```", "", text, flags=re.S)


def test_every_pasted_block_equals_its_generated_file():
    documents = pasted.documents()
    assert REPO / "README.md" in documents and len(documents) > 1
    stale = [p.relative_to(REPO) for p in documents if pasted.refresh(p.read_text()) != p.read_text()]
    assert not stale, f"pasted tables differ from their files in {stale}: run python -m experiments.reports.pasted"
    readme = (REPO / "README.md").read_text()
    assert "<!-- generated: results/reference/reports/scorecard.md -->\n| artefact | paper | ours | how |" in readme


def test_pasted_blocks_select_columns_and_rows():
    body = pasted.render("results/reference/reports/fig6/largest.md", "columns=zero_r,simulated_max_layers; where=zero_r:C4")
    table = pd.read_csv(REFERENCE / "reports" / "fig6" / "largest.csv")  # the value the block must select
    [c4] = table.loc[table["zero_r"] == "C4", "simulated_max_layers"]
    assert body.splitlines() == ["| zero_r | simulated_max_layers |", "|---|---|", f"| C4 | {c4} |"]
    with pytest.raises(ValueError, match="no column 'nope'"):
        pasted.render("results/reference/reports/fig6/largest.md", "columns=nope")
    first_two = pasted.render("results/reference/reports/fig6/largest.md", "columns=zero_r; sort=zero_r; top=2")
    assert first_two.splitlines()[2:] == ["| C1 |", "| C2 |"]
    either = pasted.render("results/reference/reports/fig6/largest.md", "columns=zero_r; where=zero_r:C4|C1; sort=zero_r")
    assert either.splitlines()[2:] == ["| C1 |", "| C4 |"]


def test_reference_scorecard_is_what_the_reference_records_give(reference_records):
    generated = to_markdown(scorecard.scorecard(reference_records))
    assert (REFERENCE / "reports" / "scorecard.md").read_text() == generated, "run make reference's report.py steps"
    card = scorecard.scorecard(reference_records).set_index("artefact")
    assert not card.ours.eq("-").any(), "the reference set leaves a scorecard row without our number"
    assert {how.split(":")[0] for how in card.how} <= {"formula", "measured on CPU", "simulated at full world size",
                                                       "predicted (step-time model)"}
    fig4 = card.loc["Figure 4: 13B without model parallelism"]
    assert fig4.ours.startswith("12.90B") and fig4.how == "simulated at full world size"


def test_every_committed_report_table_is_what_the_code_gives(reference_records):
    """Every table under results/reference/reports (the docs paste from them) is what report.py
    makes of the reference records now, the whole set's and each experiment's folder's; else a
    change to the model or the tables leaves the docs quoting old numbers."""
    from experiments.report import build_tables, experiment_tables
    reports = REFERENCE / "reports"
    folders = {reports: build_tables(reference_records)}
    for folder in sorted(p for p in reports.iterdir() if p.is_dir()):
        folders[folder] = experiment_tables([r for r in reference_records if r["experiment"] == folder.name], folder.name)
    stale = [str((folder / f"{name}.md").relative_to(REPO)) for folder, built in folders.items()
             for name, df in built.items()
             if not (folder / f"{name}.md").is_file() or (folder / f"{name}.md").read_text() != to_markdown(df)]
    left = [str(p.relative_to(REPO)) for folder, built in folders.items() for p in folder.glob("*.md")
            if p.stem not in built and p.name != "test_suite.md"]  # make test-timing's, not report.py's
    assert not stale, f"stale: {stale}; run make reference's report.py steps"
    assert not left, f"no longer generated: {left}"


# Artefacts the suite reproduces (reports/tables.py, figures.py, zero_r.py): a claim about one of
# them is checked from the reference records, never left "not checked".
REPRODUCED = re.compile(r"\b(?:Fig|Table) ?(?:[1-4]|[6-8])\b")


def test_no_claim_about_something_the_suite_implements_is_left_unchecked(reference_records):
    claims = predictions.paper_claims(reference_records)
    assert not claims.how.str.contains("not implemented").any(), claims[claims.how.str.contains("not implemented")]
    about = claims[claims.section.str.contains(REPRODUCED)]
    assert len(about) == 5  # Sec 10.5's rows on Figures 6, 7 and 8 (S10-11..15)
    unchecked = about[about.kind == "not checked"]
    assert unchecked.empty, f"claims about reproduced artefacts left unchecked: {list(unchecked.id)}"
    fig6 = claims.set_index("id").loc["S10-11"]
    assert fig6.kind == "simulated" and fig6.ours.startswith("45.5B / 90.5B")
    without = predictions.paper_claims([]).set_index("id").loc["S10-11"]  # no records: says how to make them
    assert without.kind == "not checked" and "simulate_largest=true" in without.how


def test_the_readme_is_a_front_page_and_the_guides_fit():
    # 210: the front page's 200, plus the test tiers' measured durations (make test-timing's table)
    assert len((REPO / "README.md").read_text().splitlines()) <= 210
    long = {p.name: n for p in DOCS if (n := len(p.read_text().splitlines())) > 250}
    assert not long, f"guides over 250 lines: {long}"
    named = set(re.findall(r"\(docs/(\w+\.md)\)", (REPO / "README.md").read_text()))
    assert named == {p.name for p in DOCS}, "the README's index and docs/ differ"


# Wording of a change log, not of a guide (history stays in git).
CHANGELOG = re.compile(r"since (that|the last) (run|round)|re-?measured after|this round|\bbefore: |used to be|"
                       r"\bno longer\b|\bnow (runs|peaks|holds|fits)\b|\bbefore this\b", re.I)


def test_the_guides_are_not_a_change_log():
    found = {p.name: m.group(0) for p in [REPO / "README.md", *DOCS] if (m := CHANGELOG.search(prose(p.read_text())))}
    assert not found, f"change-log wording: {found}"


# A result quoted in prose: a decimal number of bytes, parameters, FLOPs, time or a ratio (link
# rates, GB/s, are the cluster configs' constants; µs and us count). Each must be a number of a reference report,
# to the digits it is quoted with: within half a unit of its last digit, as rounding leaves it.
QUANTITY = re.compile(r"(?<![\w.])(\d+\.\d+) ?(GB(?!/)|MB|B\b|TFLOPs|PFLOPs|ms\b|µs|us\b|x\b|%)")


def reference_numbers() -> list[float]:
    """The reports' numbers, and the reference plans' (make reference-plans: docs/plan.md)."""
    files = [*(REFERENCE / "reports").rglob("*.md"), *(REFERENCE / "plans" / "plan").glob("*/*.md")]
    text = " ".join(p.read_text() for p in files)
    return [float(n) for n in re.findall(r"(?<![\w.])\d+\.\d+|\d+", text)]


def test_numbers_quoted_in_prose_come_from_the_reference_reports():
    numbers = reference_numbers()

    def found(quoted: str) -> bool:
        value, half = float(quoted), 0.5 * 10 ** -len(quoted.split(".")[1])
        return any(math.isclose(n, value, abs_tol=half + 1e-12) for n in numbers)
    missing = {(p.name, q) for p in [REPO / "README.md", *DOCS] for q, _ in QUANTITY.findall(prose(p.read_text()))
               if not found(q)}
    assert not missing, f"numbers quoted in prose that no reference report holds: {sorted(missing)}"


def test_the_readme_library_example_runs(tmp_path):
    readme = (REPO / "README.md").read_text()
    [example] = re.findall(r"## The library\n\n```python\n(.*?)```", readme, flags=re.S)
    assert len(example.strip().splitlines()) <= 12
    done = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "'optimizer_states'" in done.stdout  # the stats line printed the model states by kind
