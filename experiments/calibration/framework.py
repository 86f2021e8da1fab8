"""The host time the sweep's own model costs per layer when its kernels do no work: a GPT built
and trained exactly as the sweep's points are (experiments/run/build.py: megatron-core, this
engine, AdamW, recomputation), at a shape where every tensor is a few elements (hidden 8, one
head, 8 tokens, vocab 16), at two depths. What one more layer adds is the Python, module, hook,
autograd and dispatcher time of one layer's forward, recomputed forward and backward: the
per-kernel floor of a CPU rank, which a one-op micro-benchmark (compute.measure_op_floor, a few
us) undercounts several-fold (megatron-core runs many more ops per layer than the modelled
kernels, each through Python). experiments/analysis/calibrated.py spreads it over the kernels
the step-time model counts for a layer (analysis/kernels.py).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from experiments.launch import spawn
from experiments.points import CONF_DIR, Point
from experiments.schema import register

SHAPE = {"hidden": 8, "heads": 1, "seq_len": 8, "vocab_size": 16}
MICRO_BATCH = 1
DEPTHS = (1, 4)


def vanishing_point(layers: int) -> Point:
    """The sweep's stage-0 one-rank point at the vanishing shape with `layers` layers."""
    from experiments.points import point_from_train_config
    register()
    GlobalHydra.instance().clear()
    overrides = ["model=tiny_s", f"model.layers={layers}", *(f"model.{k}={v}" for k, v in SHAPE.items()),
                 f"micro_batch={MICRO_BATCH}", "stage=0", "gpus=1", "experiment_name=calibrate"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return point_from_train_config(compose("train", overrides=overrides))


def _step_seconds(point_dict: dict, steps: int) -> float:
    """On the rank: the median thread CPU seconds of a training step, after two warm-up steps."""
    from experiments.models.megatron_gpt import gpt_loss, initialize_parallel
    from experiments.run.build import build_model, micro_batch_tokens, wrap_in_engine
    point = Point(**point_dict)
    dp_group, tp_group = initialize_parallel(point.tp, seed=point.train["seed"])
    model, init_fn = build_model(point, torch.device("cpu"))
    engine = wrap_in_engine(point, "fp32", model, init_fn, dp_group, tp_group)
    times = []
    for step in range(steps + 2):
        tokens = micro_batch_tokens(point, step, 0, dist.get_rank(dp_group))
        began = time.thread_time()
        engine.backward(gpt_loss(engine, tokens))
        engine.step()
        times.append(time.thread_time() - began)
    return statistics.median(times[2:])


def measure(steps: int = 15, rounds: int = 5) -> dict:
    """{"shape", "micro_batch", "recompute", "layers": [...], "step_s": [...], "spread"} at DEPTHS:
    per depth the median over `rounds` fresh ranks, the depths interleaved, so that a burst of
    other work on the machine lands on both (one round's per-layer time moved 40% between two
    calibrations); spread: the larger depth's (max - min) / median over the rounds."""
    points = [vanishing_point(layers) for layers in DEPTHS]
    seconds = [[] for _ in points]
    for _ in range(rounds):
        for depth, p in enumerate(points):
            seconds[depth].append(spawn(_step_seconds, 1, p.as_dict(), steps, backend="gloo", timeout=120)[0])
    spreads = [(max(s) - min(s)) / statistics.median(s) for s in seconds]
    return {"shape": dict(SHAPE), "micro_batch": MICRO_BATCH, "recompute": bool(points[0].train["recompute"]),
            "layers": list(DEPTHS), "step_s": [statistics.median(s) for s in seconds],
            "spread": round(max(spreads), 4)}
