"""`make gpu-check`'s engine rows: megatron-core GPT at ZeRO stages 0-3 in bf16 and fp16 through
experiments/run/real.py's `train_rank`; TinyGPT in fp32 on CUDA against the same run on the CPU
(parity); and the 1.3B point's throughput and peak memory."""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from experiments.gpu_check.common import attempt, error_line, verdict
from experiments.models.tiny_gpt import TinyGPT, TinyGPTConfig, lm_loss, synthetic_tokens
from experiments.run.real import train_rank
from experiments.run.record import build_record

STAGE_MODEL, BIG_MODEL, BIG_MICRO_BATCH = "tiny_m", "gpt_1.3b", 4

# Parity: fp32 on both sides (no TF32), so the runs differ only by rounding: CPU and CUDA kernels
# (GEMM blocking, reductions, softmax, erf) round each op differently, by a few units of fp32's
# unit roundoff u = 2^-24 = 6e-8. Each run is the exact (real-arithmetic) trajectory plus its own
# rounding, so their distance is at most the sum of the two distances from exact. Measured on the
# CPU for this model, 10 steps of AdamW (lr 1e-3) with clipping: fp32 ends 1.8e-5 (relative to
# the update) from the same run in fp64, and its losses within 1e-6. Allowing CUDA's kernels 10x
# the CPU's rounding distance gives 2e-4; the bounds take 1e-3 and 1e-4 (loss ~6.2). Adam divides
# out the gradient scale, so a real fault (a missed bucket, a stale shard, a wrong device) moves
# whole updates: a distance of order 1, far above the bound.
PARITY = {"model": dict(vocab_size=512, seq_len=64, hidden=128, layers=2, heads=4), "steps": 10, "batch": 8,
          "lr": 1e-3, "update_bound": 1e-3, "loss_bound": 1e-4}


def device_rank(points: list[tuple[dict, str]], stages: list[int]) -> dict:
    """One rank on the accelerator: the megatron points through train_rank, then the parity runs."""
    return {"backend": dist.get_backend(), "points": [attempt(train_rank, p, prec) for p, prec in points],
            "parity": attempt(parity_run, stages, "cuda" if torch.cuda.is_available() else "cpu")}


def parity_run(stages: list[int], device_type: str) -> dict[int, dict]:
    """TinyGPT in fp32 through the engine at each stage: initial and final parameters (on the
    CPU) and the losses. Weights are drawn on the CPU and tokens are the same on any device."""
    import zero_impl
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32
    cfg, out = TinyGPTConfig(**PARITY["model"]), {}
    for stage in stages:
        torch.manual_seed(0)
        model = TinyGPT(cfg)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine = zero_impl.initialize(model.to(device), zero_impl.ZeroConfig(stage=stage, clip_grad_norm=1.0),
                                      optimizer=lambda g: torch.optim.AdamW(g, lr=PARITY["lr"], weight_decay=0.01))
        losses = []
        for step in range(PARITY["steps"]):
            tokens = synthetic_tokens(PARITY["batch"], cfg.seq_len, cfg.vocab_size, seed=step).to(device)
            loss = lm_loss(engine(tokens), tokens)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        final = {n: t.detach().cpu() for n, t in engine.full_parameters().items()}
        out[stage] = {"initial": initial, "final": final, "losses": losses}
    return out


def parity_distance(reference: dict, other: dict) -> dict[str, float]:
    """How far `other`'s run ends from `reference`'s: the L2 distance of the final parameters
    relative to the reference's update (final - initial), the largest element difference, and
    the largest loss difference over the steps. Runs that do not match in shape are infinitely far."""
    ref, oth = reference["final"], other["final"]
    if ref.keys() != oth.keys() or any(ref[n].shape != oth[n].shape for n in ref) or \
            len(reference["losses"]) != len(other["losses"]):
        return {"update_rel": math.inf, "max_abs": math.inf, "loss_abs": math.inf}
    squared = sum(float(((oth[n].double() - ref[n].double()) ** 2).sum()) for n in ref)
    update = sum(float(((ref[n].double() - reference["initial"][n].double()) ** 2).sum()) for n in ref)
    return {"update_rel": math.sqrt(squared / update) if update else (0.0 if squared == 0 else math.inf),
            "max_abs": max((float((oth[n].double() - ref[n].double()).abs().max()) for n in ref), default=0.0),
            "loss_abs": max((abs(a - b) for a, b in zip(reference["losses"], other["losses"])), default=0.0)}


def point_row(name: str, outcome: dict, point, precision: str) -> tuple[str, str, str, str]:
    """(check, measured, expected, verdict) of one megatron point from its train_rank result."""
    if not outcome["ok"]:
        return name, error_line(outcome["error"]), "trains", "FAIL"
    r = build_record(point, precision, "gpu_check", "ok", [outcome["value"]], None, time.strftime("%FT%T"))
    applied = len(r["losses"]) - r["comm"]["skipped_steps"]
    ratio = r["memory"]["measured"]["total"] / r["memory"]["predicted"]["total"]
    measured = (f"loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}, {applied}/{len(r['losses'])} steps applied, "
                f"model states {ratio:.4f} x Table 1")
    ok = all(map(math.isfinite, r["losses"])) and applied > 0 and 1.0 <= ratio <= 1.01
    return name, measured, "finite losses, a step applied, model states 1-1.01 x Table 1", verdict(ok)


def big_row(outcome: dict, point, precision: str) -> tuple[str, str, str, str]:
    """The 1.3B point: throughput, and peak memory beside the model-state prediction."""
    name = f"{point.model['name']} ({point.shape.layers} x {point.shape.hidden}, {precision}, stage {point.stage}, " \
           f"recompute, micro-batch {point.micro_batch})"
    if not outcome["ok"]:
        return name, error_line(outcome["error"]), "trains", "FAIL"
    r = build_record(point, precision, "gpu_check", "ok", [outcome["value"]], None, time.strftime("%FT%T"))
    m, gb = r["memory"]["measured"], 1e9
    kind = "allocated" if "cuda_max_allocated" in m else "RSS"  # CUDA's peak; peak RSS in a CPU rehearsal
    peak = m.get("cuda_max_allocated", m["peak_rss"])
    predicted = r["memory"]["predicted"]["total"]
    rest = peak - m["total"] - m["peak_buffers"] - m["activations_saved"]
    measured = (f"{r['tflops_per_gpu']:.1f} TFLOPs/GPU ({r['step_time_s'] * 1e3:.0f} ms/step, "
                f"{r['tokens_per_s_per_gpu']:.0f} tokens/s/GPU); peak {kind} {peak / gb:.2f} GB = model states "
                f"{m['total'] / gb:.2f} + gradient staging {m['peak_buffers'] / gb:.2f} + saved activations "
                f"{m['activations_saved'] / gb:.2f} + the rest {rest / gb:.2f}")
    expected = (f"model states {predicted / gb:.2f} GB (Table 1 with this run's dtypes, {r['params'] / 1e9:.3g}B "
                "params); it omits activations, logits, gradient staging, temporaries and allocator slack")
    return name, measured, expected, verdict(all(map(math.isfinite, r["losses"])), peak >= predicted)
