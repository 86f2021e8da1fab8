"""`make gpu-check`'s engine rows: megatron-core GPT at ZeRO stages 0-3 in bf16 and fp16 through
experiments/run/real.py's `train_rank`, every collective through the backend at world 1 and each
point against itself with the local copies; TinyGPT in fp32 on CUDA against the same run on the
CPU and without collectives (parity); and the 1.3B point's throughput and peak memory.

Through the collectives against the local copies: at world 1 a sum over one rank and a gather of
one shard are copies, so with deterministic kernels (common.deterministic) the two runs are bit
for bit the same unless a collective's result is read before its wait (NCCL runs on its own
stream) or a buffer is reused while NCCL still reads it: whatever the collectives' path does
wrong that changes a value shows as a loss that differs. New buffers are filled with NaN, so one
read before NCCL wrote it shows as a NaN loss; a bucket never sent shows as traffic short of the
ledger's 2Ψ/3Ψ (common.dp_traffic). Not visible at
world 1: an in-place all-gather (stages 1-2 after the step) copies a shard onto itself, so a
missing wait there changes nothing; the multi-rank rows cover it (multi_rank_rows.py)."""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from experiments.gpu_check.common import attempt, deterministic, dp_traffic, error_line, parity_distance, verdict
from experiments.gpu_check.multi_rank_rows import global_batch_run
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


def short_circuit(point: dict) -> dict:
    """The same point with the communicator's local copies at world 1 (no collective)."""
    return {**point, "zero": {**point["zero"], "force_collectives": False}}


def device_rank(points: list[tuple[dict, str]], stages: list[int], references: dict[str, dict]) -> dict:
    """One rank on the accelerator, deterministic kernels: each megatron point through train_rank
    (its collectives forced) and then its short circuit; the parity runs with and without the
    collectives; and the single-process references of the multi-rank rows (`references`)."""
    deterministic(nan_fill=True)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return {"backend": dist.get_backend(),
            "points": [(attempt(train_rank, p, prec), attempt(train_rank, short_circuit(p), prec)) for p, prec in points],
            "parity": attempt(parity_run, stages, device_type, True),
            "parity_local": attempt(parity_run, stages, device_type, False),
            "references": {name: attempt(global_batch_run, p) for name, p in references.items()}}


def parity_run(stages: list[int], device_type: str, force: bool = False) -> dict[int, dict]:
    """TinyGPT in fp32 through the engine at each stage: initial and final parameters (on the
    CPU), the losses and the data-parallel traffic of the last step (common.dp_traffic). Weights
    are drawn on the CPU and tokens are the same on any device. `force`: every collective
    through the backend (ZeroConfig.force_collectives)."""
    import zero_impl
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32
    cfg, out = TinyGPTConfig(**PARITY["model"]), {}
    for stage in stages:
        torch.manual_seed(0)
        model = TinyGPT(cfg)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        config = zero_impl.ZeroConfig(stage=stage, clip_grad_norm=1.0, force_collectives=force,
                                      overlap_param_gather=True)
        engine = zero_impl.initialize(model.to(device), config,
                                      optimizer=lambda g: torch.optim.AdamW(g, lr=PARITY["lr"], weight_decay=0.01))
        losses = []
        for step in range(PARITY["steps"]):
            tokens = synthetic_tokens(PARITY["batch"], cfg.seq_len, cfg.vocab_size, seed=step).to(device)
            loss = lm_loss(engine(tokens), tokens)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        final = {n: t.detach().cpu() for n, t in engine.full_parameters().items()}
        out[stage] = {"initial": initial, "final": final, "losses": losses,
                      "traffic": dp_traffic(engine.stats(), stage)}
    return out


def parity_row(stage: int, cpu: dict, forced: dict, local: dict, where: str) -> tuple[str, str, str, str]:
    """TinyGPT fp32 at one stage through the collectives on this device: against the CPU's run
    (PARITY's bounds) and bit for bit against the same run with local copies on this device."""
    name = f"parity fp32 stage {stage} (TinyGPT, {PARITY['steps']} steps, {where}, collectives forced)"
    bounds = (f"vs CPU: update distance <= {PARITY['update_bound']:g}, losses within {PARITY['loss_bound']:g}; "
              f"vs local copies: bitwise; DP traffic {3 if stage == 3 else 2}Ψ/step")
    failed = next((o for o in (cpu, forced, local) if not o["ok"]), None)
    if failed is not None:
        return name, error_line(failed["error"]), bounds, "FAIL"
    run = forced["value"][stage]
    d = parity_distance(cpu["value"][stage], run)
    same = parity_distance(local["value"][stage], run)
    bitwise = same["max_abs"] == 0 and same["loss_abs"] == 0
    traffic, traffic_ok = run["traffic"]
    measured = (f"vs CPU gloo: update distance {d['update_rel']:.2e}, max abs param diff {d['max_abs']:.2e}, "
                f"max loss diff {d['loss_abs']:.2e}; vs local copies: "
                f"{'bitwise equal' if bitwise else 'DIFFER by up to ' + format(same['max_abs'], '.2e')}; "
                f"DP traffic {traffic:.4f}Ψ/step")
    return name, measured, bounds, verdict(d["update_rel"] <= PARITY["update_bound"],
                                           d["loss_abs"] <= PARITY["loss_bound"], bitwise, traffic_ok)


def point_row(name: str, outcome: dict, reference: dict, point, precision: str) -> tuple[str, str, str, str]:
    """(check, measured, expected, verdict) of one megatron point from its train_rank result,
    its collectives forced, against `reference`, the same point with local copies."""
    expected = (f"finite losses, a step applied, model states 1-1.01 x Table 1, DP traffic "
                f"{3 if point.stage == 3 else 2}Ψ/step, losses bitwise the local copies'")
    failed = next((o for o in (outcome, reference) if not o["ok"]), None)
    if failed is not None:
        return name, error_line(failed["error"]), expected, "FAIL"
    r = build_record(point, precision, "gpu_check", "ok", [outcome["value"]], None, time.strftime("%FT%T"))
    applied = len(r["losses"]) - r["comm"]["skipped_steps"]
    ratio = r["memory"]["measured"]["total"] / r["memory"]["predicted"]["total"]
    traffic, traffic_ok = dp_traffic(outcome["value"]["stats"], point.stage)
    local = reference["value"]["losses"]
    same = r["losses"] == local
    diff = max((abs(a - b) for a, b in zip(r["losses"], local)), default=math.inf)
    measured = (f"loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}, {applied}/{len(r['losses'])} steps applied, "
                f"model states {ratio:.4f} x Table 1, DP traffic {traffic:.4f}Ψ/step, losses "
                f"{'bitwise equal' if same else f'DIFFER by up to {diff:.2e}'}")
    ok = all(map(math.isfinite, r["losses"])) and applied > 0 and 1.0 <= ratio <= 1.01 and traffic_ok and same
    return name, measured, expected, verdict(ok)


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
