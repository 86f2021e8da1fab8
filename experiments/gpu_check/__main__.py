"""`make gpu-check`: the CUDA path end to end, in at most 8 minutes (BUDGET_S).

    python -m experiments.gpu_check              # on a machine with a GPU
    python -m experiments.gpu_check --rehearse   # on CPU: the same script at CPU sizes (proves the script, not CUDA)

1. stages: megatron-core GPT `tiny_m`, ZeRO stages 0-3 x bf16 and fp16, world 1, every
   collective through NCCL (zero.force_collectives: the communicator does not short-circuit
   a world of one), trained by experiments/run/real.py's `train_rank`: finite losses, applied
   steps, model states equal to Table 1's prediction up to padding, the ledger's traffic 2Ψ/3Ψ
   per step, and losses bitwise those of the same point with local copies (engine_rows.py);
2. parity: TinyGPT in fp32 at stages 0-3, collectives forced, on CUDA against the CPU (gloo)
   within the bounds of engine_rows.PARITY, and bitwise against CUDA with local copies;
3. multi-rank (multi_rank_rows.py; with >= 2 GPUs, >= 4 for TP2xDP2): `tiny_m` in fp32 at every
   stage at world 2 and at TP 2 x DP 2 (and Pa there) against one process on the global batch:
   parity, traffic beside 2Ψ/3Ψ, model states beside Table 1 and the peak per rank;
4. 1.3B: megatron GPT of GPT-3 XL's shape (24 x 2048, 16 heads, seq 1024), bf16, stage 2,
   activation recomputation, micro-batch 4: TFLOPs/GPU (Narayanan Eq. 3) and
   torch.cuda.max_memory_allocated beside the suite's model-state prediction (local copies:
   the compute path's throughput);
5. ZeRO-R (zero_r_rows.py): the 1.3B point at stage 2 without and with MD, and with Pa and
   Pa+cpu, collectives forced, against stage 2 with local copies: bitwise losses, the
   allocator's fragmentation with and without MD, and whether Pa+cpu's host round trip is
   prefetched and exact, and what it costs in memory and time;
6. bench: experiments/bench_engine.py at world 1, a few steps per system;
7. after the 1.3B row, the step-time model (prediction_rows.py): the device's GEMM curve and the 1.3B point's step
   time, each beside what experiments/analysis/step_time.py predicts on the device's profile;
8. the allocator (memory_rows.py; CUDA only): tiny_m and the 1.3B point, MD off and on, under
   _record_memory_history: the caching allocator's replay equal to the GPU's trace (reserved
   and segment peaks, exactly), and the simulated rank's reserved prediction beside it.

Prints a Markdown block (docs/cluster_path.md's `make gpu-check` section takes it as is), then
a line naming the row groups that ran and those skipped, and why; exit code 1 if any check
FAILs. Without CUDA it prints one line and exits 0. Ranks are started with `spawn` (CUDA does
not survive `fork`). A rehearsal runs the multi-rank rows on 2 and 4 CPU ranks with gloo.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from experiments import bench_engine
from experiments.gpu_check import memory_rows as memory
from experiments.gpu_check import prediction_rows as prediction
from experiments.gpu_check import zero_r_rows as zero_r
from experiments.gpu_check.common import BUDGET_S, FORCE, SKIPPED, attempt, error_line, make_point, safe_row
from experiments.gpu_check.engine_rows import (BIG_MICRO_BATCH, BIG_MODEL, STAGE_MODEL, big_row, device_rank,
                                               parity_row, parity_run, point_row)
from experiments.gpu_check.multi_rank_rows import (LAYOUTS, failed_rows, layout_points, layout_rank, layout_rows,
                                                   skipped_layouts)
from experiments.launch import RankFailed, spawn
from experiments.points import resolve_precision
from experiments.run.real import train_rank


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rehearse", action="store_true", help="run on CPU at CPU sizes (tests the script)")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.rehearse:
        print(SKIPPED)
        return 0
    deadline = time.monotonic() + BUDGET_S
    left = lambda cap: max(10.0, min(cap, deadline - time.monotonic()))  # noqa: E731

    rows: list[tuple[str, str, str, str]] = []
    ran: list[str] = []  # the row groups, for the closing line
    stages = [0, 1, 2, 3]
    # bf16 rows only where the GPU computes bf16 natively (not is_bf16_supported(): True on a V100 by emulation)
    precisions = ["bf16", "fp16"] if not torch.cuda.is_available() or resolve_precision("auto") == "bf16" else ["fp16"]
    small = [(make_point(f"model={STAGE_MODEL}", f"stage={s}", f"train.precision={p}", FORCE), p)
             for p in precisions for s in stages]
    skipped = skipped_layouts()
    layouts = {layout: {name: p.as_dict() for name, p in layout_points(make_point, stages, *LAYOUTS[layout]).items()}
               for layout in LAYOUTS if layout not in skipped}
    references = {name: p.as_dict() for name, p in layout_points(make_point, stages, 1, 1).items()} if layouts else {}
    try:
        [device] = spawn(device_rank, 1, [(pt.as_dict(), p) for pt, p in small], stages, references,
                         start_method="spawn", timeout=left(200))
    except RankFailed as e:
        failed = {"ok": False, "error": str(e)}
        device = {"backend": "?", "points": [(failed, failed)] * len(small), "parity": failed,
                  "parity_local": failed, "references": {name: failed for name in references}}
    where = f"{device['backend']}, world 1"
    rows += [safe_row(name, point_row, name, forced, local, pt, p)
             for (pt, p), (forced, local) in zip(small, device["points"])
             for name in [f"{STAGE_MODEL} stage {pt.stage} {p} ({where}, collectives forced)"]]
    ran.append(f"stages through the collectives ({where}) {len(small)}")

    try:
        [cpu] = spawn(attempt, 1, parity_run, stages, "cpu", backend="gloo", start_method="spawn", timeout=left(90))
    except RankFailed as e:
        cpu = {"ok": False, "error": str(e)}
    rows += [safe_row(f"parity fp32 stage {s}", parity_row, s, cpu, device["parity"], device["parity_local"], where)
             for s in stages]
    ran.append(f"parity {len(stages)}")

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    for layout, runs in layouts.items():
        try:
            outcomes = spawn(layout_rank, LAYOUTS[layout][0], runs, start_method="spawn", timeout=left(120))
            rows += layout_rows(layout, outcomes, device["references"], backend)
        except RankFailed as e:
            rows += failed_rows(layout, list(runs), str(e))
        ran.append(f"{layout} ({backend}) {len(runs)}")

    big_model = BIG_MODEL if torch.cuda.is_available() else "tiny_l"
    warmup, steps = (2, 5) if torch.cuda.is_available() else (1, 2)  # a rehearsal proves the script: few steps
    precision = resolve_precision("auto")  # bf16 where the GPU has it (H100, H200), fp16 on a V100
    big = make_point(f"model={big_model}", "stage=2", f"micro_batch={BIG_MICRO_BATCH}", f"train.precision={precision}",
                     "train.recompute=true", f"train.warmup_steps={warmup}", f"train.steps={steps}")
    try:
        [outcome] = spawn(attempt, 1, train_rank, big.as_dict(), precision, start_method="spawn", timeout=left(150))
    except RankFailed as e:
        outcome = {"ok": False, "error": str(e)}
    rows.append(safe_row(f"{big_model} point", big_row, outcome, big, precision))
    ran.append(f"{big_model} 1")

    hw_profile = prediction.device_hardware()  # the step-time model beside the measured GEMMs and step (issue 21)
    try:
        [curve] = spawn(attempt, 1, prediction.gemm_curve, precision, start_method="spawn", timeout=left(60))
    except RankFailed as e:
        curve = {"ok": False, "error": str(e)}
    rows.append(safe_row("GEMM curve vs the step-time model", prediction.gemm_row, curve, hw_profile, precision))
    rows.append(safe_row(f"{big_model} step vs the step-time model", prediction.step_row, outcome, big, precision, hw_profile))
    ran.append("step-time model 2")

    runs = zero_r.zero_r_points(make_point, big_model, BIG_MICRO_BATCH, precision)
    try:
        [outcomes] = spawn(zero_r.zero_r_rank, 1, {n: p.as_dict() for n, p in runs.items()}, precision,
                           start_method="spawn", timeout=left(200))
    except RankFailed as e:
        outcomes = {name: {"ok": False, "error": str(e)} for name in runs}
    label = f"{big_model}, micro-batch {BIG_MICRO_BATCH}, {precision}"
    rows.append(safe_row("ZeRO-R through the collectives", zero_r.collectives_row, outcomes, label))
    rows.append(safe_row("MD fragmentation", zero_r.md_row, outcomes, label))
    rows.append(safe_row("Pa+cpu prefetch and cost", zero_r.overlap_row, outcomes, label))
    ran.append("ZeRO-R 3")

    if torch.cuda.is_available():  # the allocator's own trace exists only on CUDA
        runs = memory.memory_runs(STAGE_MODEL, big_model, BIG_MICRO_BATCH, precision)
        measured = {}
        for name, overrides in runs.items():  # a fresh process each: its allocator starts empty
            try:
                [one] = spawn(memory.memory_rank, 1, {name: make_point(*overrides).as_dict()}, precision,
                              start_method="spawn", timeout=left(60))
                measured.update(one)
            except RankFailed as e:
                measured[name] = {"ok": False, "error": str(e)}
        rows.append(safe_row("allocator replay = GPU trace", memory.replay_row, measured))
        rows.append(safe_row("fake-trace reserved prediction", memory.prediction_row, measured,
                             memory.predictions(runs, left(120) / len(runs))))
        ran.append("allocator 2")
    else:
        ran.append("allocator 0 (needs CUDA's own trace)")

    systems = list(bench_engine.systems()) if torch.cuda.is_available() else ["ddp", "zero2"]
    try:
        measured = bench_engine.run(systems, world=1, warmup=warmup, steps=steps, repeats=1, timeout=left(60))
        medians = ", ".join(f"{n} {1e3 * sorted(m.times)[len(m.times) // 2]:.1f}" for n, m in measured.items())
        rows.append(("bench_engine (world 1, 9.5M GPT, fp32)", f"median ms/step: {medians}", "runs", "PASS"))
    except (RankFailed, SystemExit) as e:
        rows.append(("bench_engine (world 1, 9.5M GPT, fp32)", error_line(str(e)), "runs", "FAIL"))
    ran.append("bench 1")

    hw = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU rehearsal (no CUDA)"
    print(f"### GPU check: {hw}, torch {torch.__version__}, CUDA {torch.version.cuda}, {time.strftime('%Y-%m-%d')}\n")
    print("| check | measured | expected | verdict |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\nrows: {', '.join(ran)}; skipped: "
          + ("; ".join(f"{layout} ({why})" for layout, why in skipped.items()) or "none"))
    failed = sum(row[3] != "PASS" for row in rows)
    print(f"\n{len(rows) - failed}/{len(rows)} checks pass, {BUDGET_S - (deadline - time.monotonic()):.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
