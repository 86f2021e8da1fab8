"""`make gpu-check`: the CUDA path end to end on one GPU, in at most 8 minutes.

    python experiments/gpu_check.py              # on a machine with a GPU
    python experiments/gpu_check.py --rehearse   # on CPU: the same script at CPU sizes (proves the script, not CUDA)

1. stages: megatron-core GPT `tiny_m`, ZeRO stages 0-3 x bf16 and fp16, world 1 over NCCL,
   trained by experiments/train.py's `train_rank`: finite losses, applied steps, and model
   states equal to Table 1's prediction up to padding;
2. parity: TinyGPT in fp32 at stages 0-3, the same seeds and tokens on CUDA (NCCL) and on the
   CPU (gloo), against the bounds below;
3. 1.3B: megatron GPT of GPT-3 XL's shape (24 x 2048, 16 heads, seq 1024), bf16, stage 2,
   activation recomputation, micro-batch 4: TFLOPs/GPU (Narayanan Eq. 3) and
   torch.cuda.max_memory_allocated beside the suite's model-state prediction;
4. ZeRO-R (experiments/gpu_check_zero_r.py): the 1.3B point again at stage 2 without and with
   MD, and with Pa and Pa+cpu: the allocator's fragmentation with and without MD, and whether
   Pa+cpu's host round trip is prefetched and exact, and what it costs in memory and time;
5. bench: experiments/bench_engine.py at world 1, a few steps per system.

Prints a Markdown block (the README's "GPU check" section takes it as is); exit code 1 if any
check FAILs. Without CUDA it prints one line and exits 0. Ranks are started with `spawn`
(CUDA does not survive `fork`).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from experiments.launch import RankFailed, spawn
from experiments.models.tiny_gpt import TinyGPT, TinyGPTConfig, lm_loss, synthetic_tokens

SKIPPED = "gpu-check: skipped, no CUDA device here (torch.cuda.is_available() is False)"
BUDGET_S = 470  # the whole check, start-ups included
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


def make_point(*overrides: str):
    """A point of experiments/train.py from its Hydra overrides, validated as train.py does."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from experiments.points import CONF_DIR
    from experiments.train import point_from_train_config
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return point_from_train_config(compose("train", overrides=["experiment_name=gpu_check", "gpus=1", *overrides]))


def attempt(fn, *args) -> dict:
    try:
        return {"ok": True, "value": fn(*args)}
    except Exception:
        return {"ok": False, "error": traceback.format_exc()}


def device_rank(points: list[tuple[dict, str]], stages: list[int]) -> dict:
    """One rank on the accelerator: the megatron points through train_rank, then the parity runs."""
    from experiments.train import train_rank
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


def verdict(*checks: bool) -> str:
    return "PASS" if all(checks) else "FAIL"


def point_row(name: str, outcome: dict, point, precision: str) -> tuple[str, str, str, str]:
    """(check, measured, expected, verdict) of one megatron point from its train_rank result."""
    from experiments.train import build_record
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
    from experiments.train import build_record
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


def safe_row(name: str, make_row, *args) -> tuple[str, str, str, str]:
    """make_row(*args), or a FAIL row saying why it could not be built."""
    try:
        return make_row(*args)
    except Exception:
        return name, error_line(traceback.format_exc()), "a row", "FAIL"


def error_line(error: str) -> str:
    return error.strip().splitlines()[-1][:200].replace("|", "/")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rehearse", action="store_true", help="run on CPU at CPU sizes (tests the script)")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.rehearse:
        print(SKIPPED)
        return 0
    deadline = time.monotonic() + BUDGET_S
    left = lambda cap: max(10.0, min(cap, deadline - time.monotonic()))  # noqa: E731
    from experiments import bench_engine
    from experiments.points import resolve_precision

    rows: list[tuple[str, str, str, str]] = []
    stages = [0, 1, 2, 3]
    precisions = ["bf16", "fp16"] if not torch.cuda.is_available() or torch.cuda.is_bf16_supported() else ["fp16"]
    small = [(make_point(f"model={STAGE_MODEL}", f"stage={s}", f"train.precision={p}"), p)
             for p in precisions for s in stages]
    try:
        [device] = spawn(device_rank, 1, [(pt.as_dict(), p) for pt, p in small], stages, start_method="spawn",
                         timeout=left(150))
    except RankFailed as e:
        failed = {"ok": False, "error": str(e)}
        device = {"backend": "?", "points": [failed] * len(small), "parity": failed}
    where = f"{device['backend']}, world 1"
    rows += [safe_row(name, point_row, name, outcome, pt, p) for (pt, p), outcome in zip(small, device["points"])
             for name in [f"{STAGE_MODEL} stage {pt.stage} {p} ({where})"]]

    try:
        [cpu] = spawn(attempt, 1, parity_run, stages, "cpu", backend="gloo", start_method="spawn", timeout=left(90))
    except RankFailed as e:
        cpu = {"ok": False, "error": str(e)}
    for stage in stages:
        name = f"parity fp32 stage {stage} (TinyGPT, {PARITY['steps']} steps, {where} vs CPU gloo)"
        bounds = f"update distance <= {PARITY['update_bound']:g}, losses within {PARITY['loss_bound']:g}"
        if not (cpu["ok"] and device["parity"]["ok"]):
            rows.append((name, error_line((cpu if not cpu["ok"] else device["parity"])["error"]), bounds, "FAIL"))
            continue
        d = parity_distance(cpu["value"][stage], device["parity"]["value"][stage])
        rows.append((name, f"update distance {d['update_rel']:.2e}, max abs param diff {d['max_abs']:.2e}, "
                           f"max loss diff {d['loss_abs']:.2e}", bounds,
                     verdict(d["update_rel"] <= PARITY["update_bound"], d["loss_abs"] <= PARITY["loss_bound"])))

    big_model = BIG_MODEL if torch.cuda.is_available() else "tiny_l"
    precision = resolve_precision("auto")  # bf16 where the GPU has it (H100, H200), fp16 on a V100
    big = make_point(f"model={big_model}", "stage=2", f"micro_batch={BIG_MICRO_BATCH}", f"train.precision={precision}",
                     "train.recompute=true", "train.warmup_steps=2", "train.steps=5")
    from experiments.train import train_rank
    try:
        [outcome] = spawn(attempt, 1, train_rank, big.as_dict(), precision, start_method="spawn", timeout=left(150))
    except RankFailed as e:
        outcome = {"ok": False, "error": str(e)}
    rows.append(safe_row(f"{big_model} point", big_row, outcome, big, precision))

    from experiments import gpu_check_zero_r as zero_r
    runs = zero_r.zero_r_points(make_point, big_model, BIG_MICRO_BATCH, precision)
    try:
        [outcomes] = spawn(zero_r.zero_r_rank, 1, {n: p.as_dict() for n, p in runs.items()}, precision,
                           start_method="spawn", timeout=left(180))
    except RankFailed as e:
        outcomes = {name: {"ok": False, "error": str(e)} for name in runs}
    label = f"{big_model}, micro-batch {BIG_MICRO_BATCH}, {precision}"
    rows.append(safe_row("MD fragmentation", zero_r.md_row, outcomes, label))
    rows.append(safe_row("Pa+cpu prefetch and cost", zero_r.overlap_row, outcomes, label))

    systems = list(bench_engine.systems()) if torch.cuda.is_available() else ["ddp", "zero2"]
    try:
        times = bench_engine.run(systems, world=1, warmup=2, steps=5, repeats=1, timeout=left(60))
        medians = ", ".join(f"{n} {1e3 * sorted(t)[len(t) // 2]:.1f}" for n, t in times.items())
        rows.append(("bench_engine (world 1, 9.5M GPT, fp32)", f"median ms/step: {medians}", "runs", "PASS"))
    except (RankFailed, SystemExit) as e:
        rows.append(("bench_engine (world 1, 9.5M GPT, fp32)", error_line(str(e)), "runs", "FAIL"))

    hw = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU rehearsal (no CUDA)"
    print(f"### GPU check: {hw}, torch {torch.__version__}, CUDA {torch.version.cuda}, {time.strftime('%Y-%m-%d')}\n")
    print("| check | measured | expected | verdict |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    failed = sum(row[3] != "PASS" for row in rows)
    print(f"\n{len(rows) - failed}/{len(rows)} checks pass, {BUDGET_S - (deadline - time.monotonic()):.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
