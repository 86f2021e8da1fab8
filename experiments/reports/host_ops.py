"""How many operations the host issues for one transformer layer per micro-batch, counted on the
CPU: the denominator a per-op host cost needs (validation.host_constants_table's check).

    python -m experiments.reports.host_ops          # prints the counts; LAYER_HOST_OPS must equal them
    python -m experiments.reports.host_ops --time   # times the same layer's host cost on this CPU and
                                                    # writes results/reports/bench/layer_host_time.csv
    make reference-host-time                        # the same, into the committed
                                                    # results/reference/bench/layer_host_time.csv

megatron-core 0.16.1's GPT (megatron_gpt.build_gpt, the local layer spec: megatron's own modules,
no Transformer Engine), TP 1, fp32, full recomputation one layer per checkpoint, hidden and
attention dropout 0.1 (Megatron's defaults), micro-batch 1, on the CPU. One forward and backward
after a warm-up, under proxy_counts.OpCounter (a TorchDispatchMode: every aten op that reaches the
dispatcher, below autograd, so backward's ops too). A layer's count is the 2-layer model's less the
1-layer model's, by phase: the forward, the recomputed forward (ops issued inside a layer's
forward while backward runs) and the backward. Each op is one of
- kernels: ops that launch one on a GPU (OpCounter's kernels less METADATA_OPS);
- views: views and metadata ops (OpCounter's views, and METADATA_OPS: reshapes that return an
  alias, allocations): dispatched, no kernel;
- syncs: ops whose result the host reads (OpCounter's host syncs).
The host ops are all three: what a per-op host cost (PyTorch's, with autograd) is charged for.
Not counted: what never reaches the dispatcher (Python module calls, autograd.Function's own
apply, checkpoint's RNG-state save and restore, the TorchScript executor around a fused call).

[assumption] A proxy for the development set's stack, Megatron-DeepSpeed @ f01c9e6e, whose
layer (megatron/model/transformer.py) megatron-core's local spec descends from: the same
QKV view and split, baddbmm scores, softmax, dropout under the RNG tracker's fork, bmm context,
permute().contiguous(), row-parallel projection, and MLP. Differences (docs/performance_checks.md):
there, apex's FusedLayerNorm and scaled causal softmax are one extension call each, QKV's bias
rides in F.linear's addmm (megatron-core adds it apart: mm, _unsafe_view, add), the
bias-dropout-add and bias-GeLU are TorchScript-fused calls on the GPU (here eager: their ops
one by one), the two `torch.tensor(0.0, device=...)` of moe_loss and mlp_bias add 2 ops a forward,
and Megatron's LocalDDP hook adds a main_grad.add_ per parameter in backward; megatron-core's RNG
tracker fork compares the CPU RNG state after each fork (3 ops, one a sync), which the 2023 one
does not.

The same layer timed (`time_layer_host`): what one more layer adds to a micro-batch's forward and
to its backward (the recomputed forward inside), with hidden 16 and 8 tokens, so the CPU's
kernels are a microsecond or two each and the time is the host's: Python, megatron-core's
modules, autograd, the dispatcher. It is the microbenchmark the development set's per-kernel
host cost is checked against (validation.host_constants_table), measured on this CPU, not the
development set's (which its source does not name); a CUDA launch (cudaLaunchKernel) takes the
place of each CPU kernel, not timed apart.
"""
from __future__ import annotations

import argparse
import csv
import os
import platform
import time
import warnings
from collections import defaultdict
from importlib import metadata
from pathlib import Path
from statistics import median

import torch

from experiments.calibration.profile import cpu_model
from experiments.proxy_counts import OpCounter
from experiments.records import REPO

PHASES = ("forward", "recompute", "backward")
KINDS = ("kernels", "views", "syncs")
aten = torch.ops.aten
# counted as kernels by OpCounter, but no kernel on a GPU: an alias reshape and allocations
METADATA_OPS = frozenset({"_unsafe_view.default", "new_empty_strided.default", "new_empty.default"})

# What count_layer_ops() counts (a test keeps them equal): one layer, one micro-batch.
LAYER_HOST_OPS = {
    "forward": {"kernels": 29, "views": 36, "syncs": 1},
    "recompute": {"kernels": 29, "views": 37, "syncs": 1},
    "backward": {"kernels": 46, "views": 49, "syncs": 0},
}


def layer_host_ops(counts: dict[str, dict[str, int]] | None = None) -> int:
    """Host ops one layer issues per micro-batch: forward, recomputed forward and backward."""
    counts = LAYER_HOST_OPS if counts is None else counts
    return sum(counts[p][k] for p in PHASES for k in KINDS)


class _LayerCounter(OpCounter):
    """OpCounter whose "backward" ops inside a layer's forward (the recomputation) go to "recompute"."""

    def __init__(self) -> None:
        super().__init__()
        self.in_layer = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        phase = self.phase
        if phase == "backward" and self.in_layer:
            self.phase = "recompute"
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self.phase = phase


def _count_model(layers: int) -> dict[str, dict[str, int]]:
    from experiments.models.gpt_shape import GPTShape
    from experiments.models.megatron_gpt import build_gpt, gpt_loss
    from experiments.models.tiny_gpt import synthetic_tokens
    from megatron.core.transformer.transformer_layer import TransformerLayer

    shape = GPTShape(layers=layers, hidden=16, heads=4, seq_len=8, vocab_size=256)
    model = build_gpt(shape, recompute=True, dropout=0.1)
    model.train()
    counter = _LayerCounter()

    def enter(*_):
        counter.in_layer += 1

    def leave(*_):
        counter.in_layer -= 1
    for m in model.modules():
        if isinstance(m, TransformerLayer):
            m.register_forward_pre_hook(enter)
            m.register_forward_hook(leave)
    for i in range(2):  # a warm-up step, then the counted one
        tokens = synthetic_tokens(1, shape.seq_len + 1, shape.vocab_size, seed=i)
        counter.counts.clear()
        with counter:
            counter.phase = "forward"
            loss = gpt_loss(model, tokens)
            counter.phase = "backward"
            loss.backward()
    out = {}
    for phase in PHASES:
        c = counter.counts[phase]
        metadata = sum(n for name, n in c.ops.items() if name in METADATA_OPS)
        out[phase] = {"kernels": c.kernels - metadata, "views": c.views + metadata, "syncs": c.host_syncs,
                      "ops": {**{n: v for n, v in c.ops.items() if n not in METADATA_OPS},
                              **{f"{n} (view)": v for n, v in c.view_ops.items()},
                              **{f"{n} (view)": v for n, v in c.ops.items() if n in METADATA_OPS}}}
    return out


def _initialize() -> None:
    import logging

    from experiments.models.megatron_gpt import initialize_parallel
    initialize_parallel(1)
    # megatron-core's RNG tracker warns on each fork when dropout draws from the CPU generator
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)


def _rank_count() -> dict:
    _initialize()
    one, two = _count_model(1), _count_model(2)
    out = {}
    for phase in PHASES:
        out[phase] = {k: two[phase][k] - one[phase][k] for k in KINDS}
        ops = defaultdict(int)
        for name, n in two[phase]["ops"].items():
            ops[name] += n
        for name, n in one[phase]["ops"].items():
            ops[name] -= n
        out[phase]["ops"] = {n: v for n, v in sorted(ops.items()) if v}
    return out


def count_layer_ops(detail: bool = False) -> dict[str, dict]:
    """One layer's host ops per micro-batch by phase and kind (module docstring), counted in a
    fresh process of world 1 (megatron's parallel state is global); `detail`: also the ops by
    name ("... (view)" for views and metadata ops)."""
    from experiments.launch import spawn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        [out] = spawn(_rank_count, 1, backend="gloo", timeout=120)
    if not detail:
        for phase in out.values():
            phase.pop("ops")
    return out


LAYER_HOST_TIME_CSV = REPO / "results" / "reference" / "bench" / "layer_host_time.csv"   # the committed timing
TIMED_OUT = REPO / "results" / "reports" / "bench" / "layer_host_time.csv"   # --time's default: ignored by git
TIMED_LAYERS = (2, 12)   # the slope over ten layers: the embedding, loss and optimizer-free rest cancel


def _rank_time(rounds: int, steps: int) -> dict:
    """Per round, the seconds one more layer adds to a micro-batch's forward and backward: each
    depth's median over `steps` timed steps (after 5 untimed), the depths interleaved per round;
    and the rank's intra-op threads."""
    from experiments.models.gpt_shape import GPTShape
    from experiments.models.megatron_gpt import build_gpt, gpt_loss
    from experiments.models.tiny_gpt import synthetic_tokens
    _initialize()
    shapes = {n: GPTShape(layers=n, hidden=16, heads=4, seq_len=8, vocab_size=256) for n in TIMED_LAYERS}
    models = {n: build_gpt(s, recompute=True, dropout=0.1).train() for n, s in shapes.items()}
    tokens = [synthetic_tokens(1, 9, 256, seed=i) for i in range(steps + 5)]
    out = []
    for _ in range(rounds):
        phases = {}
        for n, model in models.items():
            forward, backward = [], []
            for i, t in enumerate(tokens):
                start = time.perf_counter()
                loss = gpt_loss(model, t)
                mid = time.perf_counter()
                loss.backward()
                end = time.perf_counter()
                if i >= 5:
                    forward.append(mid - start)
                    backward.append(end - mid)
            phases[n] = (median(forward), median(backward))
        (f_lo, b_lo), (f_hi, b_hi) = phases[TIMED_LAYERS[0]], phases[TIMED_LAYERS[1]]
        layers = TIMED_LAYERS[1] - TIMED_LAYERS[0]
        out.append({"forward": (f_hi - f_lo) / layers, "backward": (b_hi - b_lo) / layers})
    return {"rounds": out, "threads": torch.get_num_threads()}


def time_layer_host(rounds: int = 5, steps: int = 30) -> dict:
    """One layer's host seconds per micro-batch on this CPU (module docstring), in a fresh process:
    the median over `rounds` of forward, recomputed forward with backward, and their sum, with the
    rounds' lowest and highest sums (the spread a noisy machine leaves)."""
    from experiments.launch import spawn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        [timed] = spawn(_rank_time, 1, rounds, steps, backend="gloo", timeout=600)
    per_round = timed["rounds"]
    sums = [r["forward"] + r["backward"] for r in per_round]
    return {"layer_ms": median(sums) * 1e3, "forward_ms": median(r["forward"] for r in per_round) * 1e3,
            "recompute_backward_ms": median(r["backward"] for r in per_round) * 1e3,
            "lowest_ms": min(sums) * 1e3, "highest_ms": max(sums) * 1e3, "rounds": rounds, "steps": steps,
            "cpu": cpu_model(), "threads": timed["threads"], "python": platform.python_version(),
            "torch": torch.__version__, "megatron_core": metadata.version("megatron-core")}


TEXT_FIELDS = ("cpu", "python", "torch", "megatron_core")


def read_layer_host_time(path: Path = LAYER_HOST_TIME_CSV) -> dict:
    """The committed timing (`make reference-host-time`), numbers as floats."""
    with open(path) as f:
        [row] = list(csv.DictReader(f))
    return {k: (v if k in TEXT_FIELDS else float(v)) for k, v in row.items()}


def write_layer_host_time(timing: dict, path: Path) -> None:
    """Write a timing (time_layer_host) as the one-row CSV read_layer_host_time reads."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(timing))
        writer.writeheader()
        writer.writerow(timing)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--time", action="store_true",
                        help="time the layer's host cost on this CPU instead of counting its ops")
    parser.add_argument("--out", type=Path, default=TIMED_OUT, help="where --time writes its CSV")
    args = parser.parse_args(argv)
    if args.time:
        t = time_layer_host()
        write_layer_host_time(t, args.out)
        print(f"one layer's host time a micro-batch: {t['layer_ms']:.3f} ms (forward {t['forward_ms']:.3f}, "
              f"recomputed forward and backward {t['recompute_backward_ms']:.3f}; rounds {t['lowest_ms']:.3f}-"
              f"{t['highest_ms']:.3f}) on {t['cpu']}, torch {t['torch']}, megatron-core {t['megatron_core']}: {args.out}")
        return 0
    counts = count_layer_ops(detail=True)
    for phase in PHASES:
        c = counts[phase]
        print(f"{phase}: {c['kernels']} kernels, {c['views']} views, {c['syncs']} syncs")
        for name, n in c["ops"].items():
            print(f"    {name}: {n}")
    total = layer_host_ops(counts)
    print(f"host ops per layer: {total} ({sum(counts[p]['kernels'] for p in PHASES)} kernels, "
          f"{sum(counts[p]['views'] for p in PHASES)} views, {sum(counts[p]['syncs'] for p in PHASES)} syncs)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
