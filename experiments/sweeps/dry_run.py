"""sweep.py dry_run=true: the points an experiment would run, with their predicted memory per GPU."""
from __future__ import annotations

from experiments.models.gpt_shape import parameter_count
from experiments.points import Point, host_available, host_memory_shortfall, local_devices, predicted_memory_bytes
from experiments.sweeps.summary import format_bytes


def dry_run(points: list[Point]) -> None:
    """List the points with their shapes, GPU counts and predicted peak memory per GPU (model
    states, activations of the micro-batch, engine buffers: points.predicted_memory_bytes); a
    point fits when the total is within the cluster's device_memory_gb (x 1e9 bytes, as the
    paper's Table 2). Run nothing. The verdict is the formulas': what the caching allocator
    reserves, and so whether the point fits, is the simulation's (simulate=true), which can
    disagree (Figure 2's 170B fits here and does not in the simulation)."""
    print("memory per GPU, analytic (formulas, no simulation): the larger of backward's Table 1 model states + "
          "activations (Korthikanti et al. 2022, dropout masks counted, checkpoints replicated over TP unless the "
          "point's ZeRO-R Pa partitions them, on the host with Pa+cpu) + engine buffers, and the optimizer step's "
          "model states + its temporaries; 'fits (analytic)' against cluster.device_memory_gb. 'runnable here' "
          "checks this machine's devices and, for CPU ranks, the host's available memory per rank against the point "
          "at the precision a CPU run trains in (auto: fp32, not the half precision of the sizes here)")
    print("| point | layers | hidden | heads | params (B) | GPUs | TP | DP | stage | batch | micro-batch | recompute "
          "| model states/GPU | activations/GPU | buffers/GPU | step temporaries/GPU | total/GPU | fits (analytic) "
          "| runnable here |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---|")
    for p in points:  # described for the target cluster's GPUs: "auto" means half precision there
        precision = p.train["precision"] if p.train["precision"] != "auto" else "fp16"
        predicted = predicted_memory_bytes(p, precision)
        device_gb = p.cluster["device_memory_gb"]
        fits = "-" if device_gb is None else ("yes" if predicted["total"] <= device_gb * 1e9 else "no")
        here = _runnable_here(p)
        print(f"| {p.point_id} | {p.shape.layers} | {p.shape.hidden} | {p.shape.heads} "
              f"| {parameter_count(p.shape, p.tp) / 1e9:.3f} | {p.gpus} "
              f"| {p.tp} | {p.dp} | {p.stage} | {p.global_batch} | {p.micro_batch} "
              f"| {'yes' if p.train['recompute'] else 'no'} | {format_bytes(predicted['model_states'])} "
              f"| {format_bytes(predicted['activations'])} | {format_bytes(predicted['buffers'])} "
              f"| {format_bytes(predicted['step_temporaries'])} | {format_bytes(predicted['total'])} "
              f"| {fits} | {here} |")
    print("'fits (analytic)' is an estimate from formulas: the simulation decides (simulate=true plays rank 0 at the "
          "point's world size on fake tensors and replays what PyTorch's caching allocator would reserve, "
          "fragmentation included)")


def _runnable_here(point: Point) -> str:
    """Whether sweep.py could run the point for real on this machine: enough devices (or CPU
    ranks), and on CPU its predicted memory per process within what the host has available, the
    check a real run makes before it builds anything (points.host_memory_shortfall), with both
    numbers where it is not."""
    if point.gpus > local_devices(point.cluster)[0]:
        return "no (devices)"
    short = host_memory_shortfall(point, point.gpus, host_available())
    if short is not None:
        needed, per_rank = short
        return f"no (host: {format_bytes(needed)} > {format_bytes(per_rank)} per rank)"
    return "yes"
