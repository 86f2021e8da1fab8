"""Megatron-LM's own 1.2B step times (results/external/megatron_lm_steps.csv) and the table that
sets the model's prediction beside them (reports/predictions.measured_steps_table)."""
from __future__ import annotations

import pytest

from experiments.reports import predictions


def test_the_derived_2019_row_follows_its_formula_and_the_model_predicts_it():
    table = predictions.measured_steps_table().set_index("step")
    v1, y2019 = table.loc["Megatron-LM v1.0 (2020)"], table.loc["Megatron-LM 2019"]
    assert (v1["measured s"], v1["stated TFLOPs"], y2019["stated TFLOPs"]) == (1.288, 62.4, 39.0)
    # 2019's time is v1.0's scaled by the rates (2.0611 s, stored to the ms), so both rows state
    # the same FLOPs per step (80.4 TFLOP): v1.0's count, which the post's comparison carries over
    assert y2019["measured s"] == pytest.approx(1.288 * 62.4 / 39, abs=5e-4)
    assert y2019["stated TFLOP per step"] == pytest.approx(v1["stated TFLOP per step"], rel=1e-3)
    step = predictions.megatron_check()
    assert y2019["predicted s"] == round(step.step_s, 3) and v1["predicted s"] == "-"
    assert y2019["predicted / measured"] == round(step.step_s / y2019["measured s"], 3)
    # the slowest large DeepBench GEMM's ceiling slows the GEMMs, so the step grows
    slowest = next(c for c in table.columns if c.startswith("predicted s, ceiling"))
    assert slowest == "predicted s, ceiling 0.727" and y2019[slowest] > y2019["predicted s"]
    # Eq. 3 counts 8.63e13 FLOPs for the point: 96·8·1024·40·1536²·(1 + 1024/9216 + 51200/(16·40·1536))
    assert y2019["Eq. 3 TFLOP per step"] == round(96 * 8 * 1024 * 40 * 1536 ** 2
                                                  * (1 + 1024 / 9216 + 51200 / (16 * 40 * 1536)) / 1e12, 2)
