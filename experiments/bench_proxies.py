"""Proxy benchmark: what each system's training step would cost a GPU, counted on the CPU.

    python -m experiments.bench_proxies                  # make proxies: world 2, every system found
    python -m experiments.bench_proxies --systems zero2,fsdp2 --out /tmp/proxies.md

It writes results/reports/bench/proxies.md (ignored by git) unless --out says otherwise; the
committed table, results/reference/bench/proxies.md, is rewritten only by `make reference-proxies`,
which installs DeepSpeed first so that its rows are there.

On the engine benchmark's model (bench_engine.py: the same GPT, micro-batch and buckets), one
training step after a warm-up step, with clipping on (1.0) and the optimizer a GPU run would
use (torch's fused AdamW), each system's forward, backward and optimizer step are counted by a
dispatch mode (proxy_counts.py): kernels launched, host syncs, collectives and their elements,
bytes read and written by the non-GEMM kernels. The same counts are then priced on two GPU
profiles (conf/cluster: dgx2_v100, dgx_h100) by the step-time model's constants: each kernel
and each host sync at the profile's kernel_floor_us (the model counts a sync as a kernel: a
D2H copy the GPU waits on), the non-GEMM bytes at its streaming bandwidth, the collectives by
its NCCL model at the counted sizes. Not priced: the GEMMs (the same for every system) and any
overlap (a proxy, not a prediction). Systems: our stages 0-3, FSDP2, and DeepSpeed 1-3 where
installed (make compare).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

import zero_impl
from experiments.analysis.hardware import profile
from experiments.bench_engine import BUCKET, LR, MICRO_BATCH, MODEL, build_model
from experiments.launch import spawn
from experiments.models.tiny_gpt import lm_loss, synthetic_tokens
from experiments.proxy_counts import PHASES, OpCounter
from experiments.records import REPO

CLIP = 1.0
PRICED_ON = ("dgx2_v100", "dgx_h100")
DEFAULT_OUT = REPO / "results" / "reports" / "bench" / "proxies.md"   # a user's run: never the committed table
Phases = tuple[Callable, Callable, Callable]  # forward(tokens) -> loss, backward(loss), step()


def fused_adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, fused=True)


def zero_phases(stage: int) -> Callable[[torch.nn.Module], Phases]:
    def build(model):
        config = zero_impl.ZeroConfig(stage=stage, reduce_bucket_size=BUCKET, allgather_bucket_size=BUCKET,
                                      clip_grad_norm=CLIP, overlap_param_gather=True,
                                      gloo_point_to_point=False)  # count the calls NCCL gets
        engine = zero_impl.initialize(model, config, optimizer=fused_adamw)
        return (lambda tokens: lm_loss(engine(tokens), tokens)), engine.backward, engine.step
    return build


def fsdp2_phases(model) -> Phases:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = fused_adamw(model.parameters())

    def step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (lambda tokens: lm_loss(model(tokens), tokens)), (lambda loss: loss.backward()), step


def deepspeed_phases(stage: int) -> Callable[[torch.nn.Module], Phases]:
    def build(model):
        import deepspeed
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # skip a 1-minute g++ build
        zero = {"stage": stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET, "overlap_comm": True}
        if stage == 3:
            zero["stage3_param_persistence_threshold"] = 0
        config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
                  "gradient_clipping": CLIP, "zero_allow_untested_optimizer": True, "zero_optimization": zero}
        engine, *_ = deepspeed.initialize(model=model, optimizer=fused_adamw(model.parameters()), config=config)
        return (lambda tokens: lm_loss(engine(tokens), tokens)), engine.backward, engine.step
    return build


def systems() -> dict[str, Callable[[torch.nn.Module], Phases]]:
    found = {f"zero{stage}": zero_phases(stage) for stage in (0, 1, 2, 3)}
    found["fsdp2"] = fsdp2_phases
    if importlib.util.find_spec("deepspeed") is not None:
        found.update({f"deepspeed{stage}": deepspeed_phases(stage) for stage in (1, 2, 3)})
    return found


def _count(name: str) -> dict:
    """On every rank: one warm-up step, then one counted step, by phase."""
    forward, backward, step = systems()[name](build_model())
    counter, rank = OpCounter(), dist.get_rank()
    for i in range(2):
        tokens = synthetic_tokens(MICRO_BATCH, MODEL.seq_len, MODEL.vocab_size, seed=1000 * rank + i)
        if i == 0:
            backward(forward(tokens))
            step()
            continue
        with counter:
            counter.phase = "forward"
            loss = forward(tokens)
            counter.phase = "backward"
            backward(loss)
            counter.phase = "step"
            step()
    return counter.phases()


def price(counts: dict, cluster: str, world: int) -> dict[str, dict[str, float]]:
    """Seconds of a step's counts on `cluster`'s profile, by phase (module docstring): launches
    (kernels and host syncs), non-GEMM bytes, and the collectives at `world` ranks on one node."""
    hw = profile(cluster)
    out = {}
    for phase, c in counts.items():
        collectives = sum(n * hw.collectives.time_s(kind, nbytes, world, world)
                          for kind, nbytes, n in c["collective_calls"] if kind != "other")
        out[phase] = {"launch_s": (c["kernels"] + c["host_syncs"]) * hw.kernel_floor_s,
                      "bytes_s": c["non_gemm_bytes"] / hw.stream_bytes_per_s, "collectives_s": collectives}
    return out


def table(results: dict[str, dict], world: int) -> str:
    """One row per system: the counts by phase, then each profile's price of them (ms)."""
    head = ["system", "kernels fwd", "kernels bwd", "kernels step", "host syncs", "collectives", "elements",
            "non-GEMM MB fwd / bwd / step"]
    for cluster in PRICED_ON:
        head += [f"{cluster} launches + bytes ms (step)", f"{cluster} collectives ms"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for name, counts in results.items():
        row = [name, *(str(counts[p]["kernels"]) for p in PHASES), str(sum(counts[p]["host_syncs"] for p in PHASES)),
               str(sum(counts[p]["collectives"] for p in PHASES)),
               f"{sum(counts[p]['collective_elements'] for p in PHASES):,}",
               " / ".join(f"{counts[p]['non_gemm_bytes'] / 1e6:.1f}" for p in PHASES)]
        for cluster in PRICED_ON:
            priced = price(counts, cluster, world)
            total = sum(v["launch_s"] + v["bytes_s"] for v in priced.values())
            step = priced["step"]["launch_s"] + priced["step"]["bytes_s"]
            row += [f"{1e3 * total:.2f} ({1e3 * step:.3f})", f"{1e3 * sum(v['collectives_s'] for v in priced.values()):.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default=None, help="comma-separated (default: every system found)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    names = args.systems.split(",") if args.systems else list(systems())
    unknown = sorted(set(names) - set(systems()))
    if unknown:
        parser.error(f"--systems: unknown {unknown}; found here: {sorted(systems())}")
    world = 2
    results = {name: spawn(_count, world, name, timeout=600)[0] for name in names}
    text = table(results, world)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text, end="")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
