"""The GEMM model (experiments/analysis/gemm.py) against V100 GEMMs measured by DeepBench
(results/external/deepbench_v100_fp16_gemm.csv: fp16, CUDA 10.1, 2019).

Two uses of the same measurements:

- the V100 profiles' `gemm_ceiling` is derived from them, not assumed: for each large GEMM (the
  shapes whose tiles fill the SMs' waves, m·n·k >= 1e10, m and n >= 512) the measured fraction of
  peak divided by the model's tile and wave quantization is the ceiling that GEMM reached; the
  profiles take the median (`derived_ceiling`; a test keeps conf/cluster/dgx2*_v100.yaml equal to
  it);
- every measured row beside the model's prediction of it (`gemm_check_table`), so the small and
  skinny shapes, where quantization and memory bandwidth decide, are checked too.

The prediction is the step-time model's own kernel time (kernels.gemm on the dgx2_v100 profile:
max(FLOP time at the GEMM efficiency, bytes at the streaming bandwidth), no host floor, since
DeepBench times the kernel alone).
"""
from __future__ import annotations

import csv
from functools import cache
from statistics import median

import pandas as pd

from experiments.analysis.gemm import TileWaveGemm
from experiments.analysis.hardware import profile
from experiments.analysis.kernels import gemm
from experiments.records import REPO

DEEPBENCH_CSV = REPO / "results" / "external" / "deepbench_v100_fp16_gemm.csv"
V100_PEAK_TFLOPS, V100_SMS = 125.0, 80  # DeepBench's DGX-1 V100 SXM2 (the dgx2_v100 profile's values)
LARGE_MNK, LARGE_SIDE = 1e10, 512       # a GEMM whose tiles fill the waves: the ceiling's sample


@cache
def deepbench_rows() -> tuple[dict, ...]:
    """The measured GEMMs, typed."""
    with open(DEEPBENCH_CSV) as f:
        return tuple({"workload": r["workload"], "m": int(r["m"]), "n": int(r["n"]), "k": int(r["k"]),
                      "layout": r["a_t"] + r["b_t"], "ms": float(r["ms"]), "tflops": float(r["tflops"])}
                     for r in csv.DictReader(f))


def is_large(row: dict) -> bool:
    return row["m"] * row["n"] * row["k"] >= LARGE_MNK and min(row["m"], row["n"]) >= LARGE_SIDE


def reached_ceilings() -> list[float]:
    """Each large GEMM's measured fraction of peak over the model's quantization of its shape."""
    quantization = TileWaveGemm(sms=V100_SMS, ceiling=1.0)
    return [r["tflops"] / V100_PEAK_TFLOPS / quantization.efficiency(r["m"], r["n"], r["k"])
            for r in deepbench_rows() if is_large(r)]


def derived_ceiling() -> float:
    """The V100 profiles' gemm_ceiling: the median of reached_ceilings(), to 3 decimals."""
    return round(median(reached_ceilings()), 3)


def predicted_tflops(row: dict, cluster: str = "dgx2_v100") -> float:
    kernel = gemm("deepbench", row["m"], row["n"], row["k"], 2)
    device_s, _floor = kernel.times(profile(cluster))
    return kernel.flops / device_s / 1e12


def gemm_check_table() -> pd.DataFrame:
    """Every DeepBench row: measured and predicted TFLOPs and their ratio."""
    rows = []
    for r in deepbench_rows():
        predicted = predicted_tflops(r)
        rows.append({"workload": r["workload"], "m": r["m"], "n": r["n"], "k": r["k"], "layout": r["layout"],
                     "large": "yes" if is_large(r) else "no", "measured TFLOPs": round(r["tflops"], 2),
                     "predicted TFLOPs": round(predicted, 2), "predicted / measured": round(predicted / r["tflops"], 3)})
    return pd.DataFrame(rows)


def gemm_check_summary(table: pd.DataFrame | None = None) -> pd.DataFrame:
    """predicted / measured: median and spread over all rows, the large ones, the rest."""
    table = gemm_check_table() if table is None else table
    groups = {"all": table, "large (the ceiling's sample)": table[table["large"] == "yes"],
              "small or skinny": table[table["large"] == "no"]}
    rows = []
    for name, df in groups.items():
        ratio = df["predicted / measured"]
        rows.append({"GEMMs": name, "count": len(df), "median predicted / measured": round(ratio.median(), 3),
                     "min": round(ratio.min(), 3), "max": round(ratio.max(), 3),
                     "within 25%": int(((ratio - 1).abs() <= 0.25).sum())})
    return pd.DataFrame(rows)


def gemm_ceiling_table() -> pd.DataFrame:
    """The ceiling each large GEMM reached, and the median the V100 profiles take."""
    reached = reached_ceilings()
    return pd.DataFrame([{"sample": f"DeepBench V100 fp16 GEMMs with m·n·k >= {LARGE_MNK:,.0f}, m, n >= {LARGE_SIDE}",
                          "count": len(reached), "gemm_ceiling (median)": derived_ceiling(),
                          "min": round(min(reached), 3), "max": round(max(reached), 3)}])
