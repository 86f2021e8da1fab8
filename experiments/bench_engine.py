"""Engine benchmark: our ZeRO stages beside torch DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed.

    python -m experiments.bench_engine                 # world 2, all systems found
    python -m experiments.bench_engine --systems zero1,ddp --repeats 5

Every system trains the same ~10M-parameter GPT (4 layers, hidden 256, vocab 24576, seq 128,
micro-batch 8 per rank, fp32, AdamW) on the same ranks in the same run; systems are run
round-robin `--repeats` times so that slow phases of a noisy machine hit all of them, and the
table reports the median step time over all timed steps. Gradient buckets are 25 MiB of fp32
(6,553,600 elements) everywhere, DDP's default; FSDP2 shards each block and the root, and the
stage-3 systems partition every parameter (no persistence threshold). Speed is measured here,
never asserted in tests.

On GPUs each rank trains on its own CUDA device (NCCL; ranks started with `spawn`, since CUDA
does not survive `fork`); on CPU, ranks are forked processes on gloo.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import zero_impl
from experiments.launch import spawn
from experiments.models.tiny_gpt import TinyGPT, TinyGPTConfig, lm_loss, synthetic_tokens

MODEL = TinyGPTConfig(vocab_size=24576, seq_len=128, hidden=256, layers=4, heads=4)
MICRO_BATCH = 8
LR = 1e-4
BUCKET = 25 * 2**20 // 4  # elements: DDP's default 25 MiB bucket in fp32
# On gloo, our reduce-scatters and all-gathers as point-to-point exchanges: gloo's own move twice
# a reduce-scatter's bytes or copy through a temporary (comm.py). No effect on NCCL.
EXCHANGE = True
# DeepSpeed 0.19.8 still calls the collectives torch 2.13 renamed; the warnings are noise here.
warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyGPT(MODEL)


def rank_device() -> torch.device:
    """This rank's device: its CUDA device when there is one (launch.py set it), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _engine_step(engine) -> Callable:
    """A training step through an engine with DeepSpeed's API (ours or DeepSpeed's)."""
    def step(tokens):
        engine.backward(lm_loss(engine(tokens), tokens))
        engine.step()
    # ours leaves the last step's parameter gathers in flight (overlap_param_gather): complete
    # them before the ranks leave, as a training script's next forward or close() would
    step.finish = getattr(engine, "finish_param_gathers", lambda: None)
    return step


def _torch_step(module: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable:
    """A plain torch training step (DDP, FSDP2)."""
    def step(tokens):
        opt.zero_grad(set_to_none=True)
        lm_loss(module(tokens), tokens).backward()
        opt.step()
    return step


def zero_system(stage: int) -> Callable:
    def build(model):
        return _engine_step(zero_impl.initialize(
            model, zero_impl.ZeroConfig(stage=stage, reduce_bucket_size=BUCKET, allgather_bucket_size=BUCKET,
                                           overlap_param_gather=True, gloo_point_to_point=EXCHANGE),
            optimizer=lambda groups: torch.optim.AdamW(groups, lr=LR)))
    return build


def ddp_system(sharded_optimizer: bool) -> Callable:
    def build(model):
        device = rank_device()
        ddp = DDP(model, bucket_cap_mb=25, device_ids=[device.index] if device.type == "cuda" else None)
        if sharded_optimizer:
            return _torch_step(ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR))
        return _torch_step(ddp, torch.optim.AdamW(ddp.parameters(), lr=LR))
    return build


def fsdp2_system() -> Callable:
    def build(model):
        mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return _torch_step(model, torch.optim.AdamW(model.parameters(), lr=LR))
    return build


def deepspeed_system(stage: int) -> Callable:
    def build(model):
        import deepspeed
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # skip a 1-minute g++ build
        zero = {"stage": stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET, "overlap_comm": True}
        if stage == 3:  # partition every parameter, as the paper's Pos+g+p and our default do
            zero["stage3_param_persistence_threshold"] = 0
        config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
                  "zero_allow_untested_optimizer": True, "zero_optimization": zero}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                                          config=config)
        return _engine_step(engine)
    return build


def systems() -> dict[str, Callable]:
    found = {"ddp": ddp_system(False), "zero_redundancy": ddp_system(True), "fsdp2": fsdp2_system(),
             "zero0": zero_system(0), "zero1": zero_system(1), "zero2": zero_system(2), "zero3": zero_system(3)}
    if importlib.util.find_spec("deepspeed") is not None:
        found.update({f"deepspeed{stage}": deepspeed_system(stage) for stage in (1, 2, 3)})
    return found


def _time_steps(name: str, warmup: int, steps: int) -> dict[str, list[float]]:
    """Runs on every rank (the system by name: spawned ranks cannot receive closures); returns
    rank 0's step times in seconds and the minor page faults of each timed step (pages the
    kernel mapped and zeroed for it: what a CPU allocator that gives memory back costs)."""
    device = rank_device()
    step = systems()[name](build_model().to(device))
    rank = dist.get_rank()
    times, faults = [], []
    for i in range(warmup + steps):
        tokens = synthetic_tokens(MICRO_BATCH, MODEL.seq_len, MODEL.vocab_size, seed=1000 * rank + i).to(device)
        _sync(device)
        dist.barrier()
        faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        step(tokens)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted)
    getattr(step, "finish", lambda: None)()
    return {"times": times, "faults": faults}


@dataclass
class Measured:
    """One system's timed steps over every repeat, each repeat's median, its steps' page faults."""

    times: list[float] = field(default_factory=list)
    round_medians: list[float] = field(default_factory=list)
    faults: list[float] = field(default_factory=list)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(names: list[str], world: int, warmup: int, steps: int, repeats: int,
        timeout: float = 1800) -> dict[str, Measured]:
    table = systems()
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"error: unknown system(s) {unknown}; available: {sorted(table)}")
    start_method = "spawn" if torch.cuda.is_available() else "fork"  # CUDA does not survive fork
    if any(n.startswith("deepspeed") for n in names) and start_method == "fork":
        import deepspeed  # noqa: F401  (imported once here so forked ranks inherit it)
    measured = {n: Measured() for n in names}
    for repeat in range(repeats):
        for name in names:
            got = spawn(_time_steps, world, name, warmup, steps, start_method=start_method, timeout=timeout)[0]
            m = measured[name]
            m.times += got["times"]
            m.faults += got["faults"]
            m.round_medians.append(statistics.median(got["times"]))
            print(f"  repeat {repeat + 1}/{repeats} {name:16s} median {1e3 * m.round_medians[-1]:8.1f} ms",
                  file=sys.stderr, flush=True)
    return measured


def report(measured: dict[str, Measured]) -> str:
    """The table: each system's median step (rank 0's, over every repeat) and its ratios to its
    peers: the median over repeats of the ratio repeat by repeat, then its lowest and highest (a
    repeat runs every system back to back, so a ratio's spread over repeats is the noise it
    carries; the ratio of the two overall medians pairs steps of different repeats and can fall
    outside that spread); then rank 0's median minor page faults a step."""
    med = {n: statistics.median(m.times) for n, m in measured.items()}

    def ratio(name: str, peer: str | None) -> str:
        if peer not in med:
            return "-"
        per_repeat = [a / b for a, b in zip(measured[name].round_medians, measured[peer].round_medians)]
        spread = f" ({min(per_repeat):.3f}-{max(per_repeat):.3f})" if name != peer else ""
        return f"{statistics.median(per_repeat):.3f}{spread}"
    lines = ["| system | median step (ms) | vs DDP (repeats) | vs DeepSpeed same stage (repeats) "
             "| vs FSDP2 (repeats) | minor faults a step |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, m in med.items():
        ds_peer = f"deepspeed{name[-1]}" if name in ("zero1", "zero2", "zero3") else None
        fsdp_peer = "fsdp2" if name == "zero3" else None
        lines.append(f"| {name} | {1e3 * m:.1f} | {ratio(name, 'ddp')} | {ratio(name, ds_peer)} "
                     f"| {ratio(name, fsdp_peer)} | {statistics.median(measured[name].faults):.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(systems()), help="comma-separated; default: all found")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write rank 0's step times, repeats' medians and faults here")
    args = parser.parse_args()
    began = time.perf_counter()
    params = sum(p.numel() for p in build_model().parameters())
    where = f"{torch.cuda.get_device_name()} (NCCL)" if torch.cuda.is_available() else "CPU (gloo)"
    print(f"model: {params / 1e6:.1f}M parameters, world {args.world} on {where}, micro-batch {MICRO_BATCH}, fp32, "
          f"torch {torch.__version__}, {args.repeats} x {args.steps} timed steps per system")
    if not torch.cuda.is_available():
        print("zero0-3: gloo_point_to_point=true, reduce-scatters and all-gathers as point-to-point exchanges "
              "(the peers call gloo's own collectives)")
    measured = run(args.systems.split(","), args.world, args.warmup, args.steps, args.repeats)
    print(report(measured))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({n: vars(m) for n, m in measured.items()}, f, indent=1)
    print(f"bench took {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
