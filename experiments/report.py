"""Reports: the paper's tables and figures beside the suite's, from result records.

    python experiments/report.py                          # all records under results/runs
    python experiments/report.py experiment=cpu_default   # one experiment's records (a conf/experiment option)

Writes Markdown, CSV and LaTeX tables and PNG + SVG figures under results/reports/ (regenerated,
never edited by hand): Table 1 and Table 2 from the memory model beside the paper's cells, a
Table-5-style throughput table, memory and communication tables, and five figures.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra
import matplotlib.pyplot as plt
import pandas as pd
from omegaconf import DictConfig

from experiments.reports import figures, tables
from experiments.cli import preflight_or_exit
from experiments.points import ConfigError
from experiments.records import load_records


def build_tables(records: list[dict]) -> dict[str, pd.DataFrame]:
    t1 = tables.table1()
    return {"table1": t1, "table1_wide": tables.table1_wide(t1), "table2": tables.table2(records),
            "throughput": tables.throughput_table(records), "memory": tables.memory_table(records),
            "communication": tables.comm_table(records)}


def to_markdown(df: pd.DataFrame) -> str:
    """A GitHub table (pandas' own needs the tabulate package)."""
    def cell(v) -> str:
        if v is None or (isinstance(v, float) and pd.isna(v)):
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v).replace("|", "/")
    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def write_reports(records: list[dict], out_dir: Path) -> list[Path]:
    """Every table (.md, .csv, .tex) and figure (.png, .svg); returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, df in build_tables(records).items():
        for suffix, text in ((".md", to_markdown(df)), (".csv", df.to_csv(index=False)),
                             (".tex", df.to_latex(index=False, float_format="%.4g", na_rep="-"))):
            path = out_dir / f"{name}{suffix}"
            path.write_text(text)
            written.append(path)
    for name, draw in figures.FIGURES.items():
        fig = draw(records)
        fig.tight_layout()
        for suffix in (".png", ".svg"):  # no date in the files: regenerated reports diff cleanly
            fig.savefig(out_dir / f"{name}{suffix}", dpi=110, metadata={"Date": None} if suffix == ".svg" else None)
            written.append(out_dir / f"{name}{suffix}")
        plt.close(fig)
    return written


def _records_dir(cfg: DictConfig) -> tuple[Path, str | None]:
    experiment = cfg.experiment.name if cfg.get("experiment") else None
    return Path(cfg.results_dir), experiment


def _validate(cfg: DictConfig, remote: bool) -> None:
    results, experiment = _records_dir(cfg)
    if experiment and not (results / experiment).is_dir():
        raise ConfigError(f"no records for experiment {experiment!r} under {results} "
                          f"(run: python experiments/sweep.py experiment={experiment})")


@hydra.main(config_path="../conf", config_name="report", version_base="1.3")
def main(cfg: DictConfig) -> None:
    results, experiment = _records_dir(cfg)
    records = load_records(results, experiment)
    written = write_reports(records, Path(cfg.out_dir))
    ok = sum(r["status"] == "ok" for r in records)
    print(f"{len(records)} records ({ok} ok) -> {len(written)} files in {cfg.out_dir}")


if __name__ == "__main__":
    preflight_or_exit("report", sys.argv[1:], _validate)
    main()
