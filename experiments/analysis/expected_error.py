"""How far the step-time model is expected to miss a point: its error on the measured A100 steps
of the same regime (results/reference/reports/validation.csv, written by report.py from
experiments/reports/validation.py; a test keeps the committed file equal to the code).

It is known for one pair only: system megatron_ds2023 on cluster dgx_a100 (VALIDATED), the stack
and machine the development set measured (one node of 2-8 A100s). Any other system or cluster,
and any regime the development set has no rows of (TP above one node's 8 GPUs, which crosses
InfiniBand; a TP degree or micro-batch it never ran), is "not validated": no number, no nearest
regime standing in for it.

- `expected_error`: a regime is (TP degree, micro-batch), the two axes along which the model's
  error moves most on the development set; its expected error is the median |predicted /
  measured - 1| of that regime's rows.
- `pair_ratio_errors`: how well the model orders TP degrees. Among rows alike but for TP (a
  family: TP_FAMILY_KEY), for every pair of TP degrees, |predicted ratio / measured ratio - 1|
  of their step times; `pair_ratio_p90` is its 90th percentile, the margin below which two
  plan rows' order is the model's guess.
"""
from __future__ import annotations

import csv
from collections import defaultdict
from functools import cache
from itertools import combinations
from pathlib import Path
from statistics import median

VALIDATION_CSV = Path(__file__).resolve().parents[2] / "results" / "reference" / "reports" / "validation.csv"
VALIDATED = ("megatron_ds2023", "dgx_a100")   # (system, cluster) of the development set
NODE_GPUS = 8                                 # the development set's node: TP above it was never measured
# rows alike but for TP (and so DP = GPUs / TP)
TP_FAMILY_KEY = ("gpus", "global_batch", "micro_batch", "hidden", "heads", "layers", "seq_len")


@cache
def _validation_rows() -> tuple[dict, ...]:
    with open(VALIDATION_CSV) as f:
        return tuple({k: float(v) if k in ("measured_ms", "predicted_ms", "ratio") else int(v) for k, v in r.items()
                      if k in TP_FAMILY_KEY + ("tp", "measured_ms", "predicted_ms", "ratio")} for r in csv.DictReader(f))


@cache
def regime_errors() -> dict[tuple[int, int], float]:
    """(TP, micro-batch) -> median |predicted / measured - 1| over the development set's rows."""
    errors: dict[tuple[int, int], list[float]] = {}
    for row in _validation_rows():
        errors.setdefault((row["tp"], row["micro_batch"]), []).append(abs(row["ratio"] - 1))
    return {regime: median(values) for regime, values in errors.items()}


def expected_error(tp: int, micro_batch: int, system: str, cluster: str) -> tuple[float | None, str]:
    """(expected |predicted / measured - 1|, the regime it was measured in: "TP t, micro-batch b"),
    or (None, "not validated: why") outside the validated pair and its measured regimes."""
    if (system, cluster) != VALIDATED:
        return None, f"not validated: system {system} on {cluster} (only {VALIDATED[0]} on {VALIDATED[1]} is)"
    if tp > NODE_GPUS:
        return None, f"not validated: TP {tp} spans nodes (the development set is one node of {NODE_GPUS})"
    known = regime_errors()
    if (tp, micro_batch) not in known:
        return None, f"not validated: TP {tp}, micro-batch {micro_batch} not in the development set"
    return known[(tp, micro_batch)], f"TP {tp}, micro-batch {micro_batch}"


def tp_families(rows: list[dict]) -> list[list[dict]]:
    """Rows grouped by TP_FAMILY_KEY, families of two TP degrees or more, each ordered by TP."""
    families = defaultdict(list)
    for r in rows:
        families[tuple(r[k] for k in TP_FAMILY_KEY)].append(r)
    return [sorted(f, key=lambda r: r["tp"]) for f in families.values() if len(f) > 1]


def pair_ratio_errors(rows: list[dict]) -> list[float]:
    """|(predicted_b / predicted_a) / (measured_b / measured_a) - 1| for every pair of TP degrees a < b
    within each family."""
    return [abs((b["predicted_ms"] / a["predicted_ms"]) / (b["measured_ms"] / a["measured_ms"]) - 1)
            for f in tp_families(rows) for a, b in combinations(f, 2)]


def quantile(values: list[float], q: float) -> float:
    """The q-quantile, linear between order statistics (numpy's default)."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(pos)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)


@cache
def pair_ratio_p90() -> float:
    """The 90th percentile of pair_ratio_errors over the committed validation rows."""
    return quantile(pair_ratio_errors(list(_validation_rows())), 0.9)
