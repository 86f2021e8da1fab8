"""Reports: the paper's Table 1 and Table 2 reproduced, every table and figure produced from
records, failed points kept out of the numbers, and the figures notebook executing headless."""
from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import nbclient
import nbformat
import pandas as pd
import pytest

from experiments.reports import scorecard, tables
from experiments.reports.comm_claims import counted
from experiments.records import load_records, validate_record
from experiments.report import build_tables, experiment_tables, format_number, latex_escape, to_latex, write_reports

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures" / "records"


@pytest.fixture(scope="module")
def records() -> list[dict]:
    found = load_records(FIXTURES)
    assert {r["status"] for r in found} == {"ok", "oom", "fail"}
    return found


def test_fixture_records_are_valid(records):
    assert all(validate_record(r) == [] for r in records)


def test_table1_reproduces_every_paper_cell():
    t1 = tables.table1()
    assert len(t1) == 54  # 3 models x 3 stages x 6 DP degrees
    assert t1["matches"].all(), t1[~t1["matches"]]
    cell = t1[(t1.model == "7.5B") & (t1.stage == "Pos+g") & (t1.nd == 4)].iloc[0]
    assert cell.ours_gb == pytest.approx(41.25) and cell.paper_gb == "41.3"  # rounded half up
    cell = t1[(t1.model == "1T") & (t1.stage == "Pos") & (t1.nd == 64)].iloc[0]
    assert cell.ours_gb == pytest.approx(4187.5) and cell.paper_gb == "4187"  # truncated


def test_table2_theoretical_columns_reproduce_the_paper(records):
    t2 = tables.table2(records)
    assert list(t2.mp) == [1, 2, 4, 8, 16]
    assert t2[[c for c in t2.columns if c.endswith("_matches")]].all().all()
    assert t2.loc[0, "theoretical_Pos_ours_B"] == pytest.approx(7.64, abs=0.005)
    assert t2.loc[0, "measured_Pos_ours"] == "0.0B fail"      # the failed fixture point, as such
    assert t2.loc[1, "measured_Pos_ours"] == "not run"


def test_failed_points_keep_their_status_and_no_number(records):
    built = build_tables(records)
    throughput = built["throughput"]
    assert len(throughput) == len(records)
    bad = throughput[throughput.status != "ok"]
    assert set(bad.status) == {"oom", "fail"} and bad.tflops_per_gpu.isna().all()
    assert throughput[throughput.status == "ok"].tflops_per_gpu.notna().all()
    oom = bad[bad.status == "oom"].iloc[0]
    assert oom.paper_tflops_per_gpu == "21.1 (~)"  # the paper's 13B point of Figure 4, read from a figure
    memory = built["memory"]
    assert memory[memory.status != "ok"].meas_total.isna().all()
    assert (memory[memory.status == "ok"].meas_over_pred.between(1.0, 1.001)).all()
    comm = built["communication"]
    sharded = comm[(comm.status == "ok") & (comm.nd > 1)]
    assert (sharded.per_psi.round(3) == sharded.theory_per_psi).all()


def test_report_writes_every_table_and_figure(records, tmp_path):
    written = {p.name for p in write_reports(records, tmp_path)}
    for table in ("table1", "table1_wide", "table2", "throughput", "memory", "communication", "throughput_predicted",
                  "paper_claims", "targets", "sensitivity", "simulation", "largest", "scorecard"):
        assert {f"{table}.md", f"{table}.csv", f"{table}.tex"} <= written
    for figure in ("throughput_vs_size", "scaling", "largest_model", "largest_model_cpu", "memory_bars", "communication",
                   "fig2_predicted", "fig3_predicted", "fig4_predicted", "fig8_predicted", "simulated_memory"):
        assert {f"{figure}.png", f"{figure}.svg"} <= written
        if figure == "simulated_memory":  # the fixtures hold no simulated record: its panel only says so
            continue
        pixels = matplotlib.image.imread(tmp_path / f"{figure}.png")
        assert pixels.std() > 0.05, f"{figure}.png looks blank"
    md = (tmp_path / "throughput.md").read_text().splitlines()
    assert len(md) == 2 + len(records) and sum("| oom |" in line for line in md) == 1


def test_report_cli(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "experiments" / "report.py"), f"results_dir={FIXTURES}",
                           f"out_dir={tmp_path}", "experiment=cpu_default"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"10 records (10 ok) -> 19 files in {tmp_path / 'cpu_default'}" in done.stdout
    # An experiment's folder holds what its records fill: the measured CPU runs' tables and
    # figures; no empty table, no "no ok records" panel, none of the whole set's model tables,
    # no paper table the experiment does not name
    written = {p.name.split(".")[0] for p in (tmp_path / "cpu_default").iterdir()}
    assert written == {"communication", "largest_model_cpu", "memory", "memory_bars", "scaling",
                       "throughput", "throughput_vs_size"}
    bad = subprocess.run([sys.executable, str(REPO / "experiments" / "report.py"), f"results_dir={FIXTURES}",
                          f"out_dir={tmp_path / 'x'}", "experiment=nope"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: Could not find 'experiment/nope'")
    missing = subprocess.run([sys.executable, str(REPO / "experiments" / "report.py"), f"results_dir={FIXTURES}",
                              f"out_dir={tmp_path / 'y'}", "experiment=fig2"], cwd=REPO, capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stderr.startswith("error: no records for experiment 'fig2' under")


def test_one_experiment_report_goes_to_its_own_folder_and_keeps_the_full_set(tmp_path):
    def report(*args):
        done = subprocess.run([sys.executable, str(REPO / "experiments" / "report.py"), f"results_dir={FIXTURES}",
                               f"out_dir={tmp_path}", *args], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    report()  # the full set: every record, in out_dir itself
    full = (tmp_path / "throughput.md").read_text()
    assert len(full.splitlines()) == 2 + len(load_records(FIXTURES))
    report("experiment=cpu_default")
    assert (tmp_path / "throughput.md").read_text() == full, "the one-experiment report replaced the full set"
    one = (tmp_path / "cpu_default" / "throughput.md").read_text().splitlines()
    assert len(one) == 2 + 10 and all("| cpu_default |" in line for line in one[2:])


def test_numbers_are_printed_as_the_paper_prints_them(records, tmp_path):
    assert [format_number(v) for v in (16000.0, 4187.5, 2048.0, 0.46875, 31.40625, 5.271e-05, 11513856.0, 7, None,
                                       float("nan"), True)] == [
        "16000", "4187.5", "2048", "0.46875", "31.4062", "0.00005271", "11513856", "7", "-", "-", "True"]
    write_reports(records, tmp_path)
    for path in [*tmp_path.glob("*.md"), *tmp_path.glob("*.csv"), *tmp_path.glob("*.tex")]:
        text = path.read_text()
        assert not re.search(r"\d[eE][+-]\d", text), f"{path.name} prints a number in scientific notation"
    table1 = (tmp_path / "table1.md").read_text()
    assert "| 1T | Pos | 1 | 16000 | 16000 |" in table1 and "| 1T | Pos | 64 | 4187.5 | 4187 |" in table1
    assert "1T,Pos,1,16000,16000," in (tmp_path / "table1.csv").read_text()
    assert "1T & Pos & 1 & 16000 & 16000 &" in (tmp_path / "table1.tex").read_text()


LATEX_COMMAND = re.compile(r"\\(?:[a-zA-Z]+(?:\{[^{}]*\})?|[&%$#_{}]|\\)")  # a command, an escaped special, or \\


def test_latex_tables_escape_every_special_character(records, tmp_path):
    assert latex_escape("theoretical_Pos+g & 50% $#{}~^\\ >=") == (
        r"theoretical\_Pos+g \& 50\% \$\#\{\}\textasciitilde{}\textasciicircum{}\textbackslash{} \textgreater{}=")
    frame = pd.DataFrame({"a_b": ["x_y & z", "100%"], "c": [1.5, None]})
    assert to_latex(frame).splitlines()[2:5] == [r"a\_b & c \\", r"\midrule", r"x\_y \& z & 1.5 \\"]
    write_reports(records, tmp_path)
    for path in tmp_path.glob("*.tex"):
        lines = path.read_text().splitlines()
        assert lines[0].startswith(r"\begin{tabular}{") and lines[-1] == r"\end{tabular}"
        columns = len(lines[0].split("{")[2].rstrip("}"))
        for line in lines[1:-1]:
            bare = LATEX_COMMAND.sub("", line)
            assert not set(bare) & set("_%$#{}~^\\"), f"{path.name}: unescaped special in {line!r}"
            if line.endswith(r"\\"):
                assert bare.count("&") == columns - 1, f"{path.name}: {line!r} does not have {columns} cells"


def _notebook_outputs(cells) -> tuple[list[str], str]:
    """The figures' titles (show() keeps each in its output's metadata) and all text the cells printed or displayed."""
    outputs = [o for cell in cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"], [o.evalue for o in outputs if o.output_type == "error"]
    titles = [o.metadata["title"] for o in outputs if "image/png" in o.get("data", {})]
    text = "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in outputs)
    return titles, text


def test_figures_notebook_tells_the_reference_story_and_adds_your_runs(tmp_path):
    """After `make run` (records under results/runs) the notebook still shows the paper beside the
    reference set's numbers (scorecard, Table 2's searches, the predicted figures, simulated memory,
    Figures 6-7), then the user's runs in their own part; with none, Part 2 says how to make them."""
    runs = tmp_path / "runs"
    shutil.copytree(FIXTURES, runs)  # what a first `make run` leaves: CPU grid records (and one oom, one fail)
    nb = nbformat.read(REPO / "notebooks" / "figures.ipynb", as_version=4)
    parameters = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(parameters + 1, nbformat.v4.new_code_cell(f"RUNS = Path({str(runs)!r})"))
    part2 = next(i for i, c in enumerate(nb.cells) if c.source.startswith("# Part 2"))
    load = parameters + 2  # the cell that reads both sets
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(REPO / "notebooks")}})
    client.reset_execution_trackers()
    (tmp_path / "none").mkdir()
    none = [nbformat.v4.new_code_cell(f"RUNS = Path({str(tmp_path / 'none')!r})"),
            *(nbformat.v4.new_code_cell(c.source) for c in [nb.cells[load], *nb.cells[part2:]] if c.cell_type == "code")]
    end = len(nb.cells)
    nb.cells += none  # the notebook, then its Part 2 again without runs, in the same kernel
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)

    reference_titles, reference_text = _notebook_outputs(nb.cells[:part2])
    for title in ("Largest model that fits a 32 GB V100", "Figure 2:", "Figure 3:", "Figure 4:", "Figure 8:",
                  "SIMULATED device memory", "Model-state memory", "Communication per training step"):
        assert sum(t.startswith(title) for t in reference_titles) == 1, (title, reference_titles)
    reference = load_records(REPO / "results" / "reference" / "runs")
    assert f"reference set: {len(reference)} records from results/reference/runs" in reference_text
    assert "your runs: 12 records from" in reference_text
    assert "every cell matches the paper within its printed rounding: True" in reference_text
    assert "Figure 4: 13B without model parallelism" in reference_text  # the scorecard
    assert "simulated at full world size" in reference_text and "not in this set" not in reference_text
    assert "not searched" not in reference_text and re.search(r"\d\.\dB \(simulated\)", reference_text)  # Table 2
    assert "memory decreases from C1 to C2" in reference_text  # Figure 7's statements

    your_titles, your_text = _notebook_outputs(nb.cells[part2:end])
    assert [t.split("\n")[0] for t in your_titles] == ["Model-state memory per device by stage and DP degree",
                                                       "Communication per training step (elements handed to torch.distributed)"]
    assert "oom: fig4 fig4_13b stage 2, 2 ranks: RuntimeError: DefaultCPUAllocator" in your_text
    assert "no simulated records among your runs" in your_text
    assert "tiny_s" in your_text and "prediction_check" in your_text  # their throughput, and what it is held against

    none_titles, none_text = _notebook_outputs(nb.cells[end:])
    assert none_titles == [] and "your runs: none yet under" in none_text and "no records under" in none_text


def _fig7_record(model: str, config: str, peak_gb: float) -> dict:
    kinds = {"params": 1e9, "grads": 1e9, "optimizer_states": 4e9, "activations": peak_gb * 1e9 - 6e9}
    return {"experiment": "fig7", "measured_by": "simulated", "model": {"name": model}, "params": 4e10,
            "zero_r_config": config, "micro_batch": 16, "status": "ok",
            "memory": {"peak_bytes": peak_gb * 1e9, "reserved_peak_bytes": peak_gb * 1.25e9,  # the replay's cached peak
                       "peak_by_kind": kinds, "peak_phase": "backward"}}


def test_fig7_checks_each_relation_the_paper_states():
    """Section 10.5 states three relations between Figure 7's bars (no values): C2 below C1,
    no decrease from C4 to C5 at 40B (under 2% of C4's bar), a decrease at 100B."""
    from experiments.reports import zero_r
    records = [_fig7_record("zr_40b", c, gb) for c, gb in (("C1", 27), ("C2", 15), ("C3", 22), ("C4", 10), ("C5", 9.9))]
    records += [_fig7_record("fig2_100b", "C4", 26), _fig7_record("fig2_100b", "C5", 25.9)]
    table = zero_r.fig7_table(records)
    assert list(table.config) == ["C1", "C2", "C3", "C4", "C5", "C4", "C5"] and table.model_states_GB.eq(6).all()
    verdicts = zero_r.fig7_statements(records).set_index("paper").agrees
    assert verdicts["memory decreases from C1 to C2"] is True
    assert verdicts["C2 vs C3 depends on the model"] is None
    assert verdicts["no decrease from C4 to C5 for 40B"] is True    # 1% less: no visible decrease
    assert verdicts["a decrease from C4 to C5 for 100B"] is False   # 0.4% less: not the decrease stated
    missing = zero_r.fig7_statements(records[:1]).agrees
    assert missing.isna().all()  # a statement with a point missing is not judged


def test_fig7_tables_are_written_where_its_points_were_simulated(records):
    from experiments.reports import zero_r
    assert "fig7_memory" not in build_tables(records)  # no Figure 7 records: no empty tables
    figure7 = load_records(REPO / "results" / "reference" / "runs", "fig7")
    built = build_tables(records + figure7)
    assert len(built["fig7_memory"]) == len(zero_r.fig7_records(figure7)) == 14  # C1-C5 and 100B's C4-C5, MD on and off
    # docs/zero_r.md, Figure 7: on cached memory on a 32 GB V100 (100B's C4 and C5 both fill the device)
    assert list(built["fig7_statements"].agrees) == [True, None, False, False]
    assert list(built["fig7_statements"].agrees_unbounded) == [True, None, False, True]


def test_table2_reports_each_baseline_with_its_optimizer_step():
    """Table 2 searches each baseline with a whole and a chunked step: the reports say which is which."""
    table2 = load_records(REPO / "results" / "reference" / "runs", "table2")
    largest = tables.largest_table(table2)
    baselines = largest[largest.stage == "baseline DP"]
    assert sorted(baselines.optimizer_step) == ["chunked"] * 5 + ["whole"] * 5
    for _, pair in baselines.groupby("mp"):
        whole, chunked = (pair[pair.optimizer_step == k].simulated_max_B.item() for k in ("whole", "chunked"))
        assert whole < chunked  # 24 bytes per parameter at the step against 16
    row = tables.table2(table2).set_index("mp").loc[1]
    assert row.largest_baseline_simulated == "1.3B (simulated)"
    assert row.largest_baseline_chunked_step_simulated == "1.9B (simulated)"


def test_an_experiments_report_holds_the_paper_artefacts_it_names(tmp_path, compose):
    """report.py experiment=table1 gives Table 1 (its description: "report.py prints the paper's
    own Table 1"); each experiment's folder holds the tables and figures of the artefact its
    `paper` names: Table 1 and 2 themselves, a figure's points as the step-time model predicts
    them, Figures 6 and 7 from its searches and simulations; and no other paper table."""
    done = subprocess.run([sys.executable, str(REPO / "experiments" / "report.py"),
                           f"results_dir={REPO / 'results' / 'reference' / 'runs'}", f"out_dir={tmp_path}",
                           "experiment=table1"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    table1 = (tmp_path / "table1" / "table1.md").read_text()
    assert "| 1T | Pos | 64 | 4187.5 | 4187 |" in table1 and (tmp_path / "table1" / "table1_wide.md").is_file()
    assert {"memory.md", "communication.md"} <= {p.name for p in (tmp_path / "table1").iterdir()}
    assert not (tmp_path / "table1" / "table2.md").exists()

    reference = load_records(REPO / "results" / "reference" / "runs")
    made_of = {"fig6": "largest", "fig7": "fig7_memory"}  # records' tables: the searches, the simulated peaks
    for path in sorted((REPO / "conf" / "experiment").glob("*.yaml")):
        name = path.stem
        paper = compose(f"experiment={name}").experiment.paper
        named = re.match(r"(Table|Figure) (\d)(?![-\d])", paper)  # not "Table 5-style"
        built = experiment_tables([r for r in reference if r["experiment"] == name], name)
        assert ("table2" in built) == (name == "table2") and ("table1" in built) == (name == "table1"), name
        if named is None:  # cpu_default: "Table 5-style summary", its records' tables
            continue
        kind, number = named.groups()
        if kind == "Table":
            assert f"table{number}" in built, (name, paper)
        elif name in made_of:
            assert made_of[name] in built, (name, paper)
        else:
            assert set(built["throughput_predicted"].figure) == {f"fig{number}"}, (name, paper)


def _accumulating(record: dict, micro_batches: int) -> dict:
    """The record as experiments/plan.py writes one for a global batch: `micro_batches` accumulated
    per optimizer step, each reducing the gradients (stage 2: Ψ a micro-batch, then Ψ gathered)."""
    out = copy.deepcopy(record)
    out["config"]["train"]["grad_accum_steps"] = micro_batches
    out["comm"]["elements_per_step"] = out["comm"]["dp_elements_per_step"] = (micro_batches + 1) * out["params_per_gpu"]
    return out


def test_the_scorecards_communication_rows_count_steps_of_one_micro_batch():
    """Sec 7's 2Ψ and 3Ψ are per step of one micro-batch: records accumulating several (a plan's
    for a global batch) are left out and counted, not read as 9Ψ; stage 3 says what
    stage3_keep_root (the default) saves against 3Ψ and which setting gives 3Ψ."""
    reference = load_records(REPO / "results" / "reference" / "runs")
    card = scorecard.scorecard(reference).set_index("artefact")
    stage2 = next(r for r in reference if r.get("measured_by") == "simulated" and r["stage"] == 2 and r["dp"] > 1
                  and r["status"] == "ok" and not r.get("zero_r_config", "").endswith("Pa"))
    with_plan = scorecard.scorecard(reference + [_accumulating(stage2, 8)] * 2).set_index("artefact")
    comm = tables.comm_table([stage2, _accumulating(stage2, 8)])  # communication.md says why one moves 9Ψ
    assert list(comm.micro_batches) == [1, 8] and list(comm.per_psi.round(2)) == [2.0, 9.0]
    row = with_plan.loc["Communication: Pos+g"]
    assert row.ours == card.loc["Communication: Pos+g"].ours + (
        "; 2 records accumulating micro-batches left out (the claim is per step of one micro-batch; stages 2-3 "
        "reduce-scatter the gradients once per micro-batch)")
    assert "9.0000" not in row.ours and with_plan.loc["Communication: data parallelism"].ours == \
        card.loc["Communication: data parallelism"].ours
    stage3 = card.loc["Communication: Pos+g+p"].ours
    assert re.match(r"2\.\d{4}-2\.\d{4}Ψ per step \(stage 3\): 3Ψ less the root unit's second gather, "
                    r"0\.\d{4}-0\.\d{4}Ψ here, which stage3_keep_root \(the default\) saves; "
                    r"stage3_keep_root=false gives 3Ψ$", stage3), stage3


# What the engine moved for tiny_s at 4 ranks, 4 micro-batches a step (simulate=true, Ψ = 169,728):
# stages 0-1 2Ψ (one reduction a step), stage 2 5Ψ (a reduce-scatter per micro-batch, one gather),
# stage 3 with stage3_keep_root=false 12Ψ (its whole schedule per micro-batch), padding aside.
ACCUMULATED_PER_PSI = {0: 2, 1: 2, 2: 5, 3: 12}


def test_only_stages_2_3_accumulating_records_are_left_out_and_the_theory_counts_their_micro_batches():
    """Stages 0-1 reduce the gradients once per optimizer step whatever it accumulates: such
    records test Sec 7's 2Ψ and count. Stages 2-3 are left out, and communication.md's `theory`
    is the engine's (m + 1)Ψ at stage 2 and m times the one-micro-batch count at stage 3."""
    reference = load_records(REPO / "results" / "reference" / "runs")
    def first(stage: int, simulated: bool) -> dict:
        return next(r for r in reference if r["stage"] == stage and r["dp"] > 1 and r["status"] == "ok"
                    and (r.get("measured_by") == "simulated") == simulated and not r.get("zero_r_config"))
    accumulating = []
    for stage, simulated in ((0, True), (1, True), (2, True), (3, False)):
        r = copy.deepcopy(first(stage, simulated))
        r["config"]["train"]["grad_accum_steps"] = 4
        r["comm"]["elements_per_step"] = r["comm"]["dp_elements_per_step"] = \
            ACCUMULATED_PER_PSI[stage] * r["params_per_gpu"]
        accumulating.append(r)
    by_stage, left_out = counted(reference + accumulating, simulated=True)
    assert left_out == {2: 1} and by_stage[0].per_psi.count(2.0) == counted(reference, True)[0][0].per_psi.count(2.0) + 1
    assert counted(reference + accumulating, simulated=False)[1] == {3: 1}
    card = scorecard.scorecard(reference).set_index("artefact")
    with_them = scorecard.scorecard(reference + accumulating).set_index("artefact")
    assert with_them.loc["Communication: data parallelism"].ours == card.loc["Communication: data parallelism"].ours
    comm = tables.comm_table(accumulating)
    assert list(comm.theory_per_psi) == [2, 2, 5, 12]
    psi = [r["params_per_gpu"] for r in accumulating]
    one = accumulating[3]["comm"]["theory_elements_per_step"]  # 3Ψ less the root kept gathered
    assert list(comm.theory) == [2 * psi[0], 2 * psi[1], 5 * psi[2], 4 * one]
