"""How far the step-time model is expected to miss a point: its error on the measured A100 steps
of the same regime (results/reference/reports/validation.csv, written by report.py from
experiments/reports/validation.py; a test keeps the committed file equal to the code).

A regime is (TP degree, micro-batch): the two axes along which the model's error moves most on
the development set. The expected error is the median |predicted / measured - 1| of that
regime's rows; a point outside the measured range (TP above 8, a micro-batch above 8) takes the
nearest measured regime, and says so. It is the error of `megatron_ds2023` on one A100 node:
for another system or machine it is a guide to how sure the model is, not a bound.
"""
from __future__ import annotations

import csv
from functools import cache
from pathlib import Path
from statistics import median

VALIDATION_CSV = Path(__file__).resolve().parents[2] / "results" / "reference" / "reports" / "validation.csv"


@cache
def regime_errors() -> dict[tuple[int, int], float]:
    """(TP, micro-batch) -> median |predicted / measured - 1| over the development set's rows."""
    errors: dict[tuple[int, int], list[float]] = {}
    with open(VALIDATION_CSV) as f:
        for row in csv.DictReader(f):
            errors.setdefault((int(row["tp"]), int(row["micro_batch"])), []).append(abs(float(row["ratio"]) - 1))
    return {regime: median(values) for regime, values in errors.items()}


def expected_error(tp: int, micro_batch: int) -> tuple[float, str]:
    """(expected |predicted / measured - 1|, the regime it was measured in: "TP t, micro-batch b",
    with "nearest" when the point lies outside the development set)."""
    known = regime_errors()
    if (tp, micro_batch) in known:
        return known[(tp, micro_batch)], f"TP {tp}, micro-batch {micro_batch}"
    nearest = min(known, key=lambda r: (abs(r[0] - tp) / max(r[0], tp), abs(r[1] - micro_batch) / max(r[1], micro_batch)))
    return known[nearest], f"nearest: TP {nearest[0]}, micro-batch {nearest[1]}"
