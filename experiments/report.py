"""Reports: the paper's tables and figures beside the suite's, from result records.

    python experiments/report.py                          # all records under results/runs -> results/reports/
    python experiments/report.py experiment=cpu_default   # one experiment's records -> results/reports/cpu_default/
    python experiments/report.py only=dev_set             # the development set's validation tables alone

Writes Markdown, CSV and LaTeX tables and PNG + SVG figures under `out_dir` (results/reports/),
or its subfolder named after the experiment when one is given, so a one-experiment report never
replaces the full set (regenerated, never edited by hand): Table 1 and Table 2 from the memory model beside the paper's cells, a
Table-5-style throughput table, memory and communication tables, and the figures. An
experiment's folder holds its records' tables and figures and the paper artefacts the experiment
names (experiment=table1: Table 1; table2: Table 2; fig2: Figure 2's predicted points). With this
machine's calibrated profile (`make calibrate`) it also checks the step-time model against the
measured CPU records (prediction_check; reports/prediction_check.py), or says how to make one.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra
import matplotlib.pyplot as plt
import pandas as pd
from omegaconf import DictConfig

from experiments.reports import dev_set, figures, gemm_check, prediction_check, scorecard, tables, validation, zero_r
from experiments.reports.tables import format_number
from experiments.cli import preflight_or_exit
from experiments.commands import script_command
from experiments.points import ConfigError
from experiments.records import REPO, load_records


def table1_tables() -> dict[str, pd.DataFrame]:
    """The paper's Table 1 from the memory model, long and as the paper lays it out."""
    t1 = tables.table1()
    return {"table1": t1, "table1_wide": tables.table1_wide(t1)}


def model_tables() -> dict[str, pd.DataFrame]:
    """The tables no record changes: Table 1's formula and the step-time model's checks."""
    return {**table1_tables(), "targets": tables.targets(),
            "sensitivity": tables.sensitivity(), "measured_steps": tables.measured_steps(),
            "gemm_check": gemm_check.gemm_check_table(), "gemm_check_summary": gemm_check.gemm_check_summary(),
            "gemm_ceiling": gemm_check.gemm_ceiling_table(),
            # the step-time model against measured A100 steps (reports/validation.py)
            "validation": validation.validation_table(), "validation_summary": validation.validation_summary(),
            "validation_out_of_scope": validation.out_of_scope_table(),
            "validation_host_constants": validation.host_constants_table(),
            "validation_layer_slopes": validation.layer_slopes_table(), "nccl_check": validation.nccl_check(),
            # each development-set file scored with its host constants left one source out (reports/dev_set.py)
            **dev_set.dev_set_tables()}


def record_tables(records: list[dict]) -> dict[str, pd.DataFrame]:
    """The tables of these records, one row or more per record (an experiment's folder holds those with rows)."""
    built = {"throughput": tables.throughput_table(records),
             "memory": tables.memory_table(records), "communication": tables.comm_table(records),
             "simulation": tables.simulation_table(records), "largest": tables.largest_table(records)}
    if zero_r.fig7_records(records):  # Figure 7's tables where its points were simulated
        built.update(fig7_memory=zero_r.fig7_table(records), fig7_statements=zero_r.fig7_statements(records),
                     fig7_md=zero_r.md_effect(records))  # MD on beside off, allocated and reserved
    return built


def build_tables(records: list[dict]) -> dict[str, pd.DataFrame]:
    """Every table of the whole record set's report: the model's, the records', Table 2, every
    paper point's prediction and claim (with ours where records hold it), and the README's
    scorecard, which reads them."""
    return {**model_tables(), **record_tables(records), "table2": tables.table2(records),
            "throughput_predicted": tables.throughput_predicted(records),
            "paper_claims": tables.paper_claims(records), "scorecard": scorecard.scorecard(records)}


def _predicted(figure: str) -> Callable[[list[dict]], dict[str, pd.DataFrame]]:
    def build(records: list[dict]) -> dict[str, pd.DataFrame]:
        every = tables.throughput_predicted(records)
        return {"throughput_predicted": every[every.figure == figure].reset_index(drop=True)}
    return build


# The paper's figures the step-time model predicts (reports/predictions.py), each an experiment.
PREDICTED = ("fig2", "fig3", "fig4", "fig8")
# The paper artefacts each experiment names (conf/experiment/<name>.yaml, `paper` and
# `description`), which its folder holds beside its records' tables: Table 1 from the memory
# model, Table 2 with its searches, and a figure's points as the step-time model predicts them.
ARTEFACT_TABLES: dict[str, Callable[[list[dict]], dict[str, pd.DataFrame]]] = {
    "table1": lambda records: table1_tables(), "table2": lambda records: {"table2": tables.table2(records)},
    **{figure: _predicted(figure) for figure in PREDICTED}}
# The model's predicted figures: the whole set's report draws them all, an experiment's folder its own.
PREDICTED_FIGURES = {f"{figure}_predicted": figure for figure in PREDICTED}


def experiment_tables(records: list[dict], experiment: str) -> dict[str, pd.DataFrame]:
    """One experiment's folder: its records' tables that have rows, and the paper artefacts the
    experiment names (ARTEFACT_TABLES)."""
    built = {name: df for name, df in record_tables(records).items() if len(df)}
    return {**built, **ARTEFACT_TABLES.get(experiment, lambda r: {})(records)}


def to_markdown(df: pd.DataFrame) -> str:
    """A GitHub table (pandas' own needs the tabulate package)."""
    def cell(v) -> str:
        return format_number(v).replace("|", "/")
    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def to_csv(df: pd.DataFrame) -> str:
    """CSV with every digit, numbers positional (no 1.6e+04), missing values empty."""
    def cell(v) -> str:
        return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format_number(v, significant=None)
    return df.map(cell).to_csv(index=False)


LATEX_SPECIALS = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
                  "<": r"\textless{}", ">": r"\textgreater{}", "|": r"\textbar{}"}


def latex_escape(text: str) -> str:
    """Text safe in a LaTeX table cell: every special character escaped (theoretical\\_Pos...)."""
    return "".join(LATEX_SPECIALS.get(c, c) for c in text)


def to_latex(df: pd.DataFrame) -> str:
    """A booktabs tabular (needs \\usepackage{booktabs}); headers and cells escaped."""
    numeric = [pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c]) for c in df.columns]
    lines = ["\\begin{tabular}{" + "".join("r" if n else "l" for n in numeric) + "}", "\\toprule",
             " & ".join(latex_escape(str(c)) for c in df.columns) + " \\\\", "\\midrule"]
    lines += [" & ".join(latex_escape(format_number(v)) for v in row) + " \\\\" for row in df.itertuples(index=False)]
    return "\n".join(lines + ["\\bottomrule", "\\end{tabular}"]) + "\n"


def write_tables(tables: dict[str, pd.DataFrame], out_dir: Path) -> list[Path]:
    """Each table as .md, .csv and .tex; returns the files written."""
    written = []
    for name, df in tables.items():
        for suffix, text in ((".md", to_markdown(df)), (".csv", to_csv(df)), (".tex", to_latex(df))):
            path = out_dir / f"{name}{suffix}"
            path.write_text(text)
            written.append(path)
    return written


def write_reports(records: list[dict], out_dir: Path, experiment: str | None = None) -> list[Path]:
    """Every table (.md, .csv, .tex) and figure (.png, .svg); returns the files written. For one
    `experiment`'s folder, what its records fill (their tables with rows, figures without an
    empty panel) and the paper artefacts it names, its own predicted figure among them (the
    model's other tables and figures, the claims and the scorecard are the whole set's report's)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    built = build_tables(records) if experiment is None else experiment_tables(records, experiment)
    written = write_tables(built, out_dir)
    for name, draw in figures.FIGURES.items():
        if experiment is not None and PREDICTED_FIGURES.get(name, experiment) != experiment:
            continue
        fig = draw(records)
        if experiment is not None and name not in PREDICTED_FIGURES and figures.has_empty_panel(fig):
            plt.close(fig)
            continue
        for suffix in (".png", ".svg"):  # no date in the files: regenerated reports diff cleanly
            fig.savefig(out_dir / f"{name}{suffix}", dpi=110, metadata={"Date": None} if suffix == ".svg" else None)
            written.append(out_dir / f"{name}{suffix}")
        plt.close(fig)
    return written


# only=NAME: the tables written alone (no records read, no figures), into out_dir
ONLY: dict[str | None, Callable[[], dict[str, pd.DataFrame]] | None] = {None: None, "dev_set": dev_set.dev_set_tables}


def _records_dir(cfg: DictConfig) -> tuple[Path, str | None]:
    experiment = cfg.experiment.name if cfg.get("experiment") else None
    return Path(cfg.results_dir), experiment


def _validate(cfg: DictConfig, remote: bool) -> None:
    if cfg.get("only") not in ONLY:
        raise ConfigError(f"only must be one of {[k for k in ONLY if k]} (or unset), got {cfg.only!r}")
    results, experiment = _records_dir(cfg)
    if experiment and not (results / experiment).is_dir():
        raise ConfigError(f"no records for experiment {experiment!r} under {results} "
                          f"(run: {script_command('experiments/sweep.py', f'experiment={experiment}')})")


@hydra.main(config_path="../conf", config_name="report", version_base="1.3")
def main(cfg: DictConfig) -> None:
    if cfg.get("only"):   # some of the model's tables alone, no records read
        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
        written = write_tables(ONLY[cfg.only](), Path(cfg.out_dir))
        print(f"only={cfg.only}: {len(written)} files in {cfg.out_dir}")
        return
    results, experiment = _records_dir(cfg)
    records = load_records(results, experiment)
    out_dir = Path(cfg.out_dir) / experiment if experiment else Path(cfg.out_dir)
    written = write_reports(records, out_dir, experiment)
    host_checked = not results.resolve().is_relative_to(REPO / "results" / "reference")  # committed reports: no host's check
    if host_checked and experiment and all(r.get("measured_by") == "simulated" for r in records):  # nothing to check
        print(f"prediction_check: experiment {experiment}'s records are simulated (no step times); the check reads "
              f"measured CPU records: {script_command('experiments/report.py', 'experiment=cpu_default')}")
    elif host_checked:
        check, line = prediction_check.from_default_profile(records)
        if check is not None:  # this host's check: on its own line, apart from the host-independent files
            line += f" -> {write_tables({'prediction_check': check}, out_dir)[0]}"
        print(line)
    ok = sum(r["status"] == "ok" for r in records)
    print(f"{len(records)} records ({ok} ok) -> {len(written)} files in {out_dir}")


if __name__ == "__main__":
    preflight_or_exit("report", sys.argv[1:], _validate)
    main()
