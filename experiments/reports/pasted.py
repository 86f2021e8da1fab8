"""Tables pasted from generated reports into the README and docs/, kept equal to their files.

A block names its source file, optionally the columns to keep, the rows to keep and their order:

    <!-- generated: results/reference/reports/fig6/largest.md columns=zero_r,family,simulated_max_B; where=stage:Pos -->
    | zero_r | family | simulated_max_B |
    ...
    <!-- end generated -->

`python -m experiments.reports.pasted` rewrites every block's body from its file (after
`make reference` or report.py changed one); tests/experiments/test_docs.py fails while a pasted
copy differs from what this would write, so no number quoted in a block can age.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from experiments.records import REPO

BLOCK = re.compile(r"(<!-- generated: (?P<path>\S+)(?P<options>[^>]*?) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)
DOCUMENTS = ("README.md", "docs/*.md")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _order(cell: str) -> tuple:
    """Numbers before text, numbers by value: 2 before 16."""
    try:
        return (0, float(cell), "")
    except ValueError:
        return (1, 0.0, cell)


def _columns(value: str, names: list[str], path: str) -> list[str]:
    """`a,b,c` as column names; a name holding a comma ("DeepSpeed figure, APPROX") is matched whole."""
    keep, pending = [], ""
    for piece in value.split(","):
        pending = f"{pending},{piece}" if pending else piece
        if pending in names:
            keep.append(pending)
            pending = ""
    if pending:
        raise ValueError(f"{path} has no column {pending!r} (columns: {', '.join(names)})")
    return keep


def render(path: str, options: str = "") -> str:
    """The body a block pastes: the file itself, or a Markdown table's chosen columns and rows
    (options separated by "; ", applied in order: columns=a,b,c in that order; where=column:value,
    repeatable, keeps the rows that match (where=column:a|b: either; a Markdown cell holds no |);
    sort=a,b orders the rows by those columns; top=N keeps the first N rows)."""
    text = (REPO / path).read_text()
    opts = [o.strip().split("=", 1) for o in options.split(";") if o.strip()]
    if not opts:
        return text
    header, _, *rows = text.rstrip("\n").split("\n")
    names = _cells(header)
    table = [dict(zip(names, _cells(row))) for row in rows]
    keep = names
    for key, value in opts:
        if key == "columns":
            keep = _columns(value, names, path)
        elif key == "where":
            column, wanted = value.split(":", 1)
            table = [row for row in table if row.get(column) in wanted.split("|")]
        elif key == "sort":
            table.sort(key=lambda row: [_order(row[c]) for c in value.split(",")])
        elif key == "top":
            table = table[:int(value)]
        else:
            raise ValueError(f"unknown option {key!r} of a generated block from {path} (columns=, where=, sort=, top=)")
    lines = ["| " + " | ".join(keep) + " |", "|" + "---|" * len(keep)]
    lines += ["| " + " | ".join(row[c] for c in keep) + " |" for row in table]
    return "\n".join(lines) + "\n"


def refresh(text: str) -> str:
    """`text` with every generated block's body rendered again from its file."""
    return BLOCK.sub(lambda m: m.group(1) + render(m["path"], m["options"]) + m.group(5), text)


def documents() -> list[Path]:
    return sorted(p for pattern in DOCUMENTS for p in REPO.glob(pattern))


def main() -> int:
    for path in documents():
        text = path.read_text()
        if (new := refresh(text)) != text:
            path.write_text(new)
            print(f"refreshed {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
