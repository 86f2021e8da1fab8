"""experiments/predict.py: a paper experiment as JSON objects with the point and its prediction,
one point by overrides, and bad input rejected in one line with exit code 2."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from experiments.records import REPO


def predict(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "experiments/predict.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=240)


def test_experiment_as_json_array_with_point_and_prediction():
    out = predict("experiment=fig2", "format=json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert len(rows) == 18
    keys = {"model", "params", "gpus", "tp", "dp", "stage", "micro_batch", "system", "series",
            "tflops_per_gpu_predicted", "step_s", "terms"}
    assert all(keys <= set(r) for r in rows)
    z100 = next(r for r in rows if r["model"] == "fig2_100b")
    assert (z100["series"], z100["system"], z100["tp"], z100["dp"]) == ("ZeRO", "deepspeed2020", 16, 25)
    assert sum(z100["terms"].values()) == pytest.approx(z100["step_s"])
    assert {r["system"] for r in rows if r["series"] == "baseline"} == {"megatron2019"}


def test_one_custom_point_by_overrides():
    out = predict("model.layers=4", "model.hidden=1024", "model.heads=16", "gpus=32", "tp=2", "stage=0",
                  "micro_batch=4", "system=pytorch_ddp", "format=json")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    assert (row["gpus"], row["tp"], row["dp"], row["system"], row["stage"]) == (32, 2, 16, "pytorch_ddp", 0)
    assert row["terms"]["tp_comm"] > 0 and row["tflops_per_gpu_predicted"] > 0


@pytest.mark.parametrize("args, words", [(["system=nope"], "system must be one of"),
                                         (["format=xml"], "format must be one of"),
                                         (["system=megatron2019", "stage=2"], "stage must be one of [0]"),
                                         (["tp=3"], "TP")])
def test_bad_overrides_are_one_line_and_exit_2(args, words):
    out = predict(*args)
    assert out.returncode == 2 and out.stdout == ""
    assert words in out.stderr and out.stderr.count("\n") == 1


def test_kernel_list_of_a_point():
    out = predict("model=fig2_100b", "gpus=400", "tp=16", "micro_batch=32", "format=kernels")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("fig2_100b, stage 2, 400 GPUs, TP 16") and "GEMM eff" in lines[1]
    qkv = next(line.split() for line in lines if line.split()[:2] == ["forward", "QKV"])
    # QKV per GPU: 2 x (32 x 1024 tokens) x (3 x 8192 / 16) x 8192 FLOPs = 824.6 GFLOP
    assert float(qkv[2]) == pytest.approx(2 * 32 * 1024 * 3 * 8192 / 16 * 8192 / 1e9, abs=0.01)
