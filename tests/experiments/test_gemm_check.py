"""The GEMM model against DeepBench's V100 measurements (experiments/reports/gemm_check.py):
the copied data is what DeepBench computed, the V100 profiles' ceiling is the one the data
gives, and two rows worked by hand."""
from __future__ import annotations

import pytest

from experiments.analysis.hardware import load_cluster
from experiments.reports import gemm_check


def test_each_copied_row_is_deepbenchs_own_flop_rate():
    rows = gemm_check.deepbench_rows()
    assert len(rows) == 160
    for r in rows:  # DeepBench's TFLOPs are 2·m·n·k over its time (whole microseconds), as copied
        assert 2 * r["m"] * r["n"] * r["k"] / (r["ms"] * 1e-3) / 1e12 == pytest.approx(r["tflops"], rel=1e-9), r


@pytest.mark.parametrize("cluster", ["dgx2_v100", "dgx2h_v100"])
def test_the_v100_profiles_ceiling_is_the_one_deepbench_gives(cluster):
    assert load_cluster(cluster)["gemm_ceiling"] == gemm_check.derived_ceiling() == 0.816


def test_a_large_gemm_by_hand():
    # 4096 x 7000 x 4096, NN, measured 112.28 TFLOPs. Best tile 128 x 128 (or 256 x 128): 32 x 55 =
    # 1760 tiles, 22 full waves of 80 SMs; tile quantization 7000 / 7040 = 0.99432. FLOP time
    # 2.349e11 / (125e12 x 0.816 x 0.99432) = 2.316 ms > its 148 MB at 750 GB/s (0.197 ms).
    row = next(r for r in gemm_check.deepbench_rows() if (r["m"], r["n"], r["k"], r["layout"]) == (4096, 7000, 4096, "NN"))
    assert gemm_check.predicted_tflops(row) == pytest.approx(125 * 0.816 * 7000 / 7040, rel=1e-6)
    assert gemm_check.predicted_tflops(row) / row["tflops"] == pytest.approx(0.9033, abs=1e-3)


def test_a_skinny_gemm_by_hand():
    # 1760 x 16 x 1760, NN, measured 4.96 TFLOPs. Best tile 64 x 64: 28 tiles on 80 SMs (one wave,
    # 28/80) covering 1792 x 64 for 1760 x 16, half the 128 x 128 tile's operand reuse:
    # 0.35 x 0.2455 x 0.5. FLOP time 99.1 MFLOP / (125e12 x 0.816 x 0.04297) = 22.6 us > its 6.31 MB
    # at 750 GB/s (8.4 us).
    row = next(r for r in gemm_check.deepbench_rows() if (r["m"], r["n"], r["k"], r["layout"]) == (1760, 16, 1760, "NN"))
    assert gemm_check.predicted_tflops(row) == pytest.approx(125 * 0.816 * 28 / 80 * (1760 * 16) / (1792 * 64) * 0.5, rel=1e-6)
    assert row["tflops"] == pytest.approx(4.956, abs=1e-3)


def test_the_ceilings_sample_is_the_74_gemms_that_fill_their_waves():
    large = [r for r in gemm_check.deepbench_rows() if gemm_check.is_large(r)]
    assert len(large) == 74 and all(min(r["m"], r["n"]) >= 512 and r["m"] * r["n"] * r["k"] >= 1e10 for r in large)
    assert gemm_check.gemm_ceiling_table().iloc[0]["count"] == 74
    assert gemm_check.gemm_check_summary().set_index("GEMMs").loc["large (the ceiling's sample)", "count"] == 74
