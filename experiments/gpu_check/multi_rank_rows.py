"""`make gpu-check`'s multi-rank rows, on machines with 2 GPUs or more (2 CPU ranks on gloo in a
rehearsal): megatron-core GPT `tiny_m` in fp32 at every ZeRO stage, at world 2 (DP 2) and, with 4
GPUs, at TP 2 x DP 2, plus Pa there (its all-gather over a real TP group). Each DP rank trains its
slice of one global batch; the reference is one process training the whole batch (world 1, run
in the device rank). A row reports parity (losses, gradient norms, final parameters), the
data-parallel traffic per step beside the paper's 2Ψ/3Ψ, model states beside Table 1 at the run's
Nd, and the peak allocated memory per rank in training beside the single process's.

Bounds (BOUNDS): both sides are fp32 (TF32 off) and differ only by rounding: a sum over ranks
instead of one GEMM over the batch, and at TP 2 megatron's split GEMMs and all-reduces. Each side
is the exact trajectory plus its own rounding, as for engine_rows.PARITY. Measured on CPU ranks
(gloo), 6 steps of AdamW at lr 1e-3: world 2 ends 1.2e-5 from the single process (relative to the
update), TP2xDP2 2e-5; losses within 5e-7, gradient norms within 2e-5 (relative, the norm follows
the trajectory's drift). 1e-3 allows CUDA's kernels 10x the CPU's distance with room, as PARITY
does (the norm too: it follows the update). A fault (a bucket reduced twice or not at all, a stale shard, a TP slice at the
wrong offset, a norm counting replicated parameters twice) moves whole updates or the norm by
order 1 (a swapped TP slice: 23). Pa changes where checkpoints live, not values: its run is
compared bit for bit to the same layout without it (deterministic kernels)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from experiments.analysis.memory import predicted_for_engine
from experiments.gpu_check.common import (attempt, deterministic, dp_traffic, error_line, parity_distance, safe_row,
                                         verdict)
from experiments.models.megatron_gpt import gpt_loss, initialize_parallel
from experiments.models.tiny_gpt import synthetic_tokens
from experiments.points import Point
from experiments.run.build import build_model, wrap_in_engine

GLOBAL_BATCH, STEPS, LR = 8, 6, 1e-3
BOUNDS = {"update": 1e-3, "loss": 1e-4, "grad_norm": 1e-3}
LAYOUTS = {"world 2": (2, 1), "TP2xDP2": (4, 2)}  # name -> (GPUs, TP)
PA = ["zero.partition_activations=true"]  # Pa, stage 2 at TP2xDP2 (recompute is on: the suite's default)


def layout_points(make_point, stages: list[int], gpus: int, tp: int) -> dict[str, Point]:
    """{run name: point} of one layout: every stage, and at TP > 1 stage 2 with Pa."""
    def point(stage: int, *extra: str) -> Point:
        return make_point("model=tiny_m", f"stage={stage}", f"gpus={gpus}", f"tp={tp}",
                          f"micro_batch={GLOBAL_BATCH * tp // gpus}", "train.precision=fp32",
                          f"train.lr={LR}", "train.warmup_steps=0", f"train.steps={STEPS}", *extra)
    runs = {f"stage {s}": point(s) for s in stages}
    return {**runs, "stage 2 + Pa": point(2, *PA)} if tp > 1 and 2 in stages else runs


def global_batch_run(point_dict: dict) -> dict:
    """Train a point in fp32 with each DP rank on its slice of the same global batch per step;
    this rank's TP-local parameters (initial and final, on the CPU), the losses over the whole
    batch, the gradient norms before clipping, engine stats and the allocator's peak."""
    point = Point(**point_dict)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32
    dp_group, tp_group = initialize_parallel(point.tp, seed=point.train["seed"])
    torch.manual_seed(point.train["seed"])
    model, init_fn = build_model(point, device)
    engine = wrap_in_engine(point, "fp32", model, init_fn, dp_group, tp_group)
    dp_rank, dp = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    initial = {n: t.cpu() for n, t in engine.full_parameters().items()}
    if device.type == "cuda":  # the peak of training: the full fp32 copy just exported is not the stage's
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    losses, norms = [], []
    for step in range(point.train["steps"]):
        tokens = synthetic_tokens(GLOBAL_BATCH, point.shape.seq_len + 1, point.shape.vocab_size, seed=step)
        loss = gpt_loss(engine, tokens[dp_rank * point.micro_batch:(dp_rank + 1) * point.micro_batch].to(device))
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp_group)  # the mean over equal slices is the global batch's mean
        losses.append(total.item() / dp)
        norms.append(engine.sharded_optimizer.grad_norm)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    final = {n: t.cpu() for n, t in engine.full_parameters().items()}
    partition = {n: p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
                 for n, p in engine.module.named_parameters()}
    return {"initial": initial, "final": final, "losses": losses, "grad_norms": norms, "stats": engine.stats(),
            "peak": peak, "tp_rank": dist.get_rank(tp_group), "tp": point.tp, "partition": partition}


def layout_rank(points: dict[str, dict]) -> dict[str, dict]:
    """One rank of a multi-rank layout: every run of `points`, one after another."""
    deterministic(nan_fill=True)
    return {name: attempt(global_batch_run, p) for name, p in points.items()}


def tp_distance(reference: dict, ranks: list[dict]) -> dict[str, float]:
    """parity_distance of a TP x DP run against a world-1 run: every TP rank's slice of each
    tensor-parallel parameter against the same slice of the reference's full tensor (chunks
    along megatron's partition_dim), replicated parameters once (TP rank 0's)."""
    tp = ranks[0]["tp"]
    by_tp = {r["tp_rank"]: r for r in ranks}  # DP replicas hold the same full parameters

    def sliced(run: dict, key: str, rank: dict, whole: bool) -> dict[str, torch.Tensor]:
        """`run`'s tensors as TP rank `rank` holds them: slices of whole ones, or its own."""
        dims, r = rank["partition"], rank["tp_rank"]
        return {f"{n}@{r}": t.chunk(tp, dims[n])[r] if whole and dims.get(n) is not None else t
                for n, t in run[key].items() if dims.get(n) is not None or r == 0}
    ref = {"losses": reference["losses"], **{key: {k: v for r in by_tp.values()
                                                   for k, v in sliced(reference, key, r, whole=True).items()}
                                             for key in ("initial", "final")}}
    oth = {"losses": ranks[0]["losses"],
           "final": {k: v for r in by_tp.values() for k, v in sliced(r, "final", r, whole=False).items()}}
    return parity_distance(ref, oth)


def layout_row(layout: str, run: str, outcomes: list[dict], reference: dict, backend: str) -> tuple[str, str, str, str]:
    """(check, measured, expected, verdict) of one run of a layout against the single process
    (or, for Pa, against the same layout without Pa)."""
    gpus, tp = LAYOUTS[layout]
    name = f"{layout} {run} (tiny_m fp32, {backend}, {gpus} ranks, global batch {GLOBAL_BATCH}, {STEPS} steps)"
    if run.endswith("+ Pa"):
        return pa_row(name, outcomes, reference)
    stage = int(run.split()[-1])
    bounds = (f"vs 1 process: update distance <= {BOUNDS['update']:g}, losses within {BOUNDS['loss']:g}, "
              f"gradient norms within {BOUNDS['grad_norm']:g} (relative); DP traffic {3 if stage == 3 else 2}Ψ/step "
              "up to padding; model states 1-1.01 x Table 1")
    failed = next((o for o in [*outcomes, reference] if not o["ok"]), None)
    if failed is not None:
        return name, error_line(failed["error"]), bounds, "FAIL"
    ranks, ref = [o["value"] for o in outcomes], reference["value"]
    d = tp_distance(ref, ranks) if tp > 1 else parity_distance(ref, ranks[0])
    norm = max(abs(a - b) / b for a, b in zip(ranks[0]["grad_norms"], ref["grad_norms"]))
    stats = ranks[0]["stats"]
    traffic, traffic_ok = dp_traffic(stats, stage)
    states = max(r["stats"]["memory"]["total"] for r in ranks) / predicted_for_engine(stats)["total"]
    peaks = [r["peak"] for r in ranks if r["peak"] is not None]
    peak = (f"peak allocated {max(peaks) / 1e6:.1f} MB/rank (1 process {ref['peak'] / 1e6:.1f} MB)" if peaks
            else "no allocator on CPU")
    measured = (f"update distance {d['update_rel']:.2e}, max loss diff {d['loss_abs']:.2e}, grad-norm diff "
                f"{norm:.2e}; DP traffic {traffic:.4f}Ψ/step; model states {states:.4f} x Table 1 "
                f"(Nd {stats['dp_size']}); {peak}")
    return name, measured, bounds, verdict(d["update_rel"] <= BOUNDS["update"], d["loss_abs"] <= BOUNDS["loss"],
                                           norm <= BOUNDS["grad_norm"], traffic_ok, 1.0 <= states <= 1.01)


def pa_row(name: str, outcomes: list[dict], without: dict) -> tuple[str, str, str, str]:
    """Pa at TP 2: its checkpoints gathered over the TP group, training bit for bit unchanged."""
    expected = "losses and final parameters bitwise the same layout's without Pa; Pa's all-gathers counted"
    failed = next((o for o in [*outcomes, without] if not o["ok"]), None)
    if failed is not None:
        return name, error_line(failed["error"]), expected, "FAIL"
    pa, plain = outcomes[0]["value"], without["value"]
    same = pa["losses"] == plain["losses"] and all(torch.equal(pa["final"][n], plain["final"][n]) for n in plain["final"])
    gathered = pa["stats"]["comm"]["last_step"]["by_purpose"].get("activations", {}).get("elements", 0)
    measured = (f"losses and parameters {'bitwise equal' if same else 'DIFFER'}; Pa gathered {gathered} elements "
                f"in the last step ({pa['stats']['activations']['gathers']} gathers in all)")
    return name, measured, expected, verdict(same, gathered > 0)


def layout_rows(layout: str, outcomes: list[dict[str, dict]], references: dict[str, dict],
                backend: str) -> list[tuple[str, str, str, str]]:
    """The rows of one layout: `outcomes` per rank {run: attempt}, `references` the world-1
    runs by name (Pa's reference is the layout's own stage 2)."""
    return [safe_row(f"{layout} {run}", layout_row, layout, run, [o[run] for o in outcomes],
                     outcomes[0]["stage 2"] if run.endswith("+ Pa") else references[run], backend)
            for run in outcomes[0]]


def failed_rows(layout: str, runs: list[str], error: str) -> list[tuple[str, str, str, str]]:
    """One FAIL row per run of a layout whose ranks did not come back."""
    return [(f"{layout} {run}", error_line(error), "ranks finish", "FAIL") for run in runs]


def skipped_layouts() -> dict[str, str]:
    """{layout: why it does not run here}: too few GPUs. Without CUDA (a rehearsal) every layout
    runs, on CPU ranks with gloo."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else None
    return {layout: f"{n} GPU{'s' * (n != 1)}, needs {gpus}" for layout, (gpus, _) in LAYOUTS.items()
            if n is not None and n < gpus}
