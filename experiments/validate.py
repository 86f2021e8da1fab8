"""The step-time model against any file of measured training steps in a development-set schema.

    python -m experiments.validate results/external/vtrain_a100_single_node.csv
    python -m experiments.validate results/external/vtrain_a100_multi_node.csv system=zero_repro
    python -m experiments.validate results/external/llm_foundry_a100_fsdp.csv system=zero_repro cluster=dgx_a100
    python -m experiments.validate FILE.csv format=json      # the summary and every row, one JSON object

The file's schema is told by its columns (experiments/analysis/measured.py): vTrain's iteration
times (system megatron_ds2023 on cluster dgx_a100; the multi-node file, which has the parameter
count, on dgx_a100_800g: 800 Gb/s between nodes, as vTrain's configs state) or the
sharded-data-parallel throughput compilation (llm-foundry's rows by llm_foundry_fsdp1, another
source's refused unless `system=` names one; the cluster from each row's GPU). `system=` and `cluster=`
replace every row's own. It prints the rows predicted and those refused, grouped by reason; the
median, 90th percentile and worst |predicted / measured - 1| on step time; and the median ratio
(predicted / measured time) over all rows and by TP degree, sequence-length band and, where the
file has them, GPU, sharding and activation checkpointing; for a throughput file, how often the
model's fastest row is the measured fastest among rows alike but for micro-batch and activation
checkpointing (measured.fastest_in_family). `format=json` adds `per_row`: every
input row's index, status and reason, predicted and measured value in the file's unit, and the
step's terms in seconds.

Bad input is one line on stderr and exit code 2.
"""
from __future__ import annotations

import difflib
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.analysis.hardware import PROFILES
from experiments.analysis.measured import (Outcome, Schema, SchemaError, fastest_in_family_text, per_row,
                                           predict_file, summary)
from experiments.analysis.systems import SYSTEMS
from experiments.points import ConfigError

FORMATS = ("table", "json")
ALLOWED = {"system": tuple(SYSTEMS), "cluster": PROFILES, "format": FORMATS}
USAGE = "python -m experiments.validate CSV [system=NAME] [cluster=NAME] [format=json]"


def parse(argv: list[str]) -> tuple[Path, dict[str, str]]:
    """The CSV and the key=value options; ConfigError naming the key and its allowed values."""
    options: dict[str, str] = {}
    files = [a for a in argv if "=" not in a]
    for arg in (a for a in argv if "=" in a):
        key, value = arg.split("=", 1)
        if key not in ALLOWED:
            close = difflib.get_close_matches(key, ALLOWED, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown key {key!r}: allowed {list(ALLOWED)}{hint}")
        if value not in ALLOWED[key]:
            raise ConfigError(f"{key} must be one of {list(ALLOWED[key])}, got {value!r}")
        options[key] = value
    if len(files) != 1:
        raise ConfigError(f"give one CSV file, got {len(files)}: {USAGE}")
    path = Path(files[0])
    if not path.is_file():
        raise ConfigError(f"CSV {path}: no such file")
    return path, options


def _number(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def text(path: Path, s: dict) -> str:
    """The summary as lines: counts, refusals by reason, the error, the median ratio by group."""
    by = ", ".join(f"{n} by {who}" for who, n in s["predicted_by"].items())
    lines = [f"{path}: {s['rows']} rows, {s['description']} ({s['unit']})",
             f"predicted: {s['predicted']}" + (f" ({by})" if by else ""), f"refused: {s['refused']}"]
    lines += [f"  {n:>5}  {reason}" for reason, n in s["refused_by_reason"].items()]
    if s["error"] is None:
        lines.append("no row predicted: no error to report")
        return "\n".join(lines)
    e = s["error"]
    lines.append(f"|predicted / measured - 1| on step time: median {_number(e['median'])}, p90 {_number(e['p90'])}, "
                 f"worst {_number(e['worst'])} (row {e['worst_row']})")
    if s["fastest_in_family"] is not None:
        lines.append(fastest_in_family_text(s["fastest_in_family"]))
    table = [("group", "value", "rows", "median ratio"), ("all", "", str(s["predicted"]), _number(e["median_ratio"]))]
    table += [(group, value, str(v["rows"]), _number(v["median_ratio"]))
              for group, values in s["median_ratio_by_group"].items() for value, v in values.items()]
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    lines.append("median ratio (predicted / measured step time):")
    lines += ["  " + "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
              for r in table]
    return "\n".join(lines)


def report(path: Path, schema: Schema, outcomes: list[Outcome], fmt: str) -> str:
    s = summary(schema, outcomes)
    if fmt == "json":
        return json.dumps({"file": str(path), "summary": s, "per_row": [per_row(schema, o) for o in outcomes]},
                          indent=1)
    return text(path, s)


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        path, options = parse(argv)
        schema, outcomes = predict_file(path, options.get("system"), options.get("cluster"))
    except (ConfigError, SchemaError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(path, schema, outcomes, options.get("format", "table")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
