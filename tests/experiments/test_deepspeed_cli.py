"""deepspeed_config=path.json on the command line (experiments/points.py expand, zero_impl/deepspeed.py):
a DeepSpeed ZeRO-2 JSON runs train.py to the record its equivalent overrides give; a JSON this
engine cannot honour, or a command line that contradicts it, is exit code 2 before anything runs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments.points import ConfigError, expand

REPO = Path(__file__).resolve().parents[2]
QUICK = ["train.warmup_steps=1", "train.steps=2"]
# The ZeRO tutorial's stage-2 block with an AdamW block and the usual logging keys, in fp32 so it
# runs on CPU; DeepSpeed's defaults fill what it omits (persistence 1e5; sub_group_size is stage 3's).
ZERO2 = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
         "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True, "reduce_scatter": True,
                               "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8},
         "optimizer": {"type": "AdamW", "params": {"lr": 1.5e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                   "weight_decay": 0.01}},
         "gradient_clipping": 1.0, "steps_per_print": 10, "wall_clock_breakdown": False}
# what ZERO2 says, as this suite's overrides (its lr, weight decay and clipping are the defaults)
EQUIVALENT = ["stage=2", "micro_batch=2", "train.precision=fp32", "train.adam_betas=[0.9,0.95]",
              "zero.reduce_bucket_size=500000000", "zero.allgather_bucket_size=500000000",
              "zero.overlap_comm=true",
              "zero.stage3_param_persistence_threshold=100000"]
# measurements that differ from run to run: the clock and the process's resident memory
MEASURED = ("started", "finished", "step_time_s", "step_times_s", "tflops_per_gpu", "tokens_per_s_per_gpu")


def write(tmp_path: Path, values: dict, name: str = "ds.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(values))
    return path


def run(script: str, tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "experiments" / script), *overrides,
                           f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=REPO, capture_output=True, text=True, timeout=180)


def without_measurements(record: dict) -> dict:
    record = {k: v for k, v in record.items() if k not in MEASURED}
    for side in ("measured", "measured_max_over_ranks"):
        record["memory"][side].pop("peak_rss")
    return record


def test_zero2_json_runs_train_py_as_its_overrides(tmp_path):
    config = write(tmp_path, ZERO2)
    by_json = run("train.py", tmp_path, f"deepspeed_config={config}", "gpus=1", "model=tiny_s",
                  f"results_dir={tmp_path / 'json'}", *QUICK)
    assert by_json.returncode == 0, by_json.stderr
    # printed once, though the preflight and the run both expand the config
    line = f"deepspeed_config {config}: ignored (no effect here): steps_per_print ("
    assert by_json.stderr.count("ignored (no effect here)") == 1 and line in by_json.stderr, by_json.stderr
    assert "; wall_clock_breakdown (" in by_json.stderr
    by_overrides = run("train.py", tmp_path, "gpus=1", "model=tiny_s", f"results_dir={tmp_path / 'overrides'}",
                       *EQUIVALENT, *QUICK)
    assert by_overrides.returncode == 0, by_overrides.stderr
    assert "deepspeed_config" not in by_overrides.stderr
    [a] = (tmp_path / "json" / "adhoc").glob("*.json")
    [b] = (tmp_path / "overrides" / "adhoc").glob("*.json")
    assert a.name == b.name
    a, b = json.loads(a.read_text()), json.loads(b.read_text())
    assert a["status"] == "ok" and a["config"]["train"]["adam_betas"] == [0.9, 0.95]
    assert a["config"]["zero"]["reduce_bucket_size"] == 500_000_000 and len(a["losses"]) == 3
    assert without_measurements(a) == without_measurements(b)


def test_a_json_this_engine_cannot_honour_is_exit_2(tmp_path):
    bad = dict(ZERO2, zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}})
    done = run("sweep.py", tmp_path, f"deepspeed_config={write(tmp_path, bad)}", "model=tiny_s", "gpus=[1]",
               f"results_dir={tmp_path / 'runs'}", *QUICK)
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: deepspeed_config zero_optimization.offload_optimizer.device: offloading to "
                                   "the CPU/NVMe (ZeRO-Offload, ZeRO-Infinity) is not implemented by this engine; "
                                   'remove the block or set device "none"'), done.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("script, override, message", [
    ("sweep.py", "stage=3", "stage=3 contradicts deepspeed_config {} (zero_optimization.stage: 2)"),
    ("train.py", "stage=3", "stage=3 contradicts deepspeed_config {} (zero_optimization.stage: 2)"),
    ("train.py", "micro_batch=4", "micro_batch=4 contradicts deepspeed_config {} (train_micro_batch_size_per_gpu: 2)"),
])
def test_a_command_line_that_contradicts_the_json_is_exit_2(tmp_path, script, override, message):
    config = write(tmp_path, ZERO2)
    done = run(script, tmp_path, f"deepspeed_config={config}", "model=tiny_s", override,
               f"results_dir={tmp_path / 'runs'}", *QUICK)
    assert done.returncode == 2 and f"error: {message.format(config)}; set it in one place" in done.stderr, done.stderr
    assert not (tmp_path / "runs").exists()


def test_the_json_gives_each_point_its_batch_by_deepspeeds_rule(compose, tmp_path):
    config = write(tmp_path, {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                              "zero_optimization": {"stage": 1}, "gradient_clipping": 0.5})
    points = expand(compose("model=tiny_s", "gpus=[1,2,4]", "dry_run=true", f"deepspeed_config={config}"))
    # 8 = 2 x accumulation x DP
    assert [(p.gpus, p.stage, p.micro_batch, p.train["grad_accum_steps"]) for p in points] == [
        (1, 1, 2, 4), (2, 1, 2, 2), (4, 1, 2, 1)]
    assert {p.train["precision"] for p in points} == {"bf16"} and {p.zero["clip_grad_norm"] for p in points} == {0.5}
    for point, accum in zip(points, (4, 2, 1)):  # the same points as these overrides, one DP at a time
        [same] = expand(compose("model=tiny_s", f"gpus=[{point.gpus}]", "dry_run=true", "stage=1", "micro_batch=2",
                                f"train.grad_accum_steps={accum}", "train.precision=bf16", "zero.clip_grad_norm=0.5",
                                "zero.reduce_bucket_size=500000000", "zero.allgather_bucket_size=500000000",
                                "zero.overlap_comm=false", "zero.stage3_param_persistence_threshold=100000"))
        assert same.point_id == point.point_id
    with pytest.raises(ConfigError, match=r"point \(tiny_s, 8 GPUs, TP 1\): deepspeed_config train_batch_size: "
                                          r"8 != .* = 2 x \? x 8 for any whole \?"):
        expand(compose("model=tiny_s", "gpus=[8]", "dry_run=true", f"deepspeed_config={config}"))


def test_zero_r_switches_stay_the_command_lines_without_an_activation_checkpointing_block(compose, tmp_path):
    """A JSON without the block says nothing about checkpoints (plan.py adds Pa per candidate); one
    with it decides them, and a command line that says otherwise is an error."""
    silent = write(tmp_path, ZERO2)
    [point] = expand(compose("model=tiny_s", "gpus=[2]", "tp=[2]", "dry_run=true", "zero.partition_activations=true",
                             f"deepspeed_config={silent}"))
    assert point.zero["partition_activations"] is True and point.stage == 2
    speaks = write(tmp_path, dict(ZERO2, activation_checkpointing={"partition_activations": False}), "pa.json")
    with pytest.raises(ConfigError, match=r"zero.partition_activations=True contradicts deepspeed_config .*pa.json "
                                          r"\(activation_checkpointing.partition_activations: False\)"):
        expand(compose("model=tiny_s", "gpus=[2]", "tp=[2]", "dry_run=true", "zero.partition_activations=true",
                       f"deepspeed_config={speaks}"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="train.precision auto hashes as auto-gpu on a GPU machine")
def test_earlier_point_ids_are_unchanged(compose):
    """Ids of reference records (results/reference/runs/fig2/simulated/), from before the
    DeepSpeed keys existed: the keys' defaults stay out of the hash (points.LATER_*)."""
    ids = {p.point_id for p in expand(compose("experiment=fig2", "dry_run=true"))}
    assert {"fig2_1.5b-s0-g400-tp2-mb16-baseline-00c59a8f", "fig2_1.5b-s2-g400-tp1-mb24-zero-c6dbe33e",
            "fig2_100b-s2-g400-tp16-mb32-zero-926894fb"} <= ids
