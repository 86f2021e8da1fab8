"""The engine benchmark's ratios lie within their own repeat-by-repeat range."""
from __future__ import annotations

from experiments.bench_engine import Measured, report


def test_a_ratio_is_the_median_of_its_repeats_ratios_inside_their_range():
    # repeat by repeat zero2 takes 1.05x and 1.10x ddp's median; the overall medians pair steps of
    # different repeats (ddp's second repeat, zero2's two halves): 1.625 / 2.0, outside that range
    measured = {"ddp": Measured(times=[1.0, 1.0, 3.0, 2.0, 2.0, 2.0], round_medians=[1.0, 2.0], faults=[0.0]),
                "zero2": Measured(times=[1.05] * 3 + [2.2] * 3, round_medians=[1.05, 2.2], faults=[0.0])}
    [_, _, ddp, zero2] = report(measured).splitlines()
    assert "| 1.000 |" in ddp
    assert "| 1.075 (1.050-1.100) |" in zero2
