"""`make gpu-check`'s ZeRO-R rows: what only CUDA can show of MD and Pa+cpu (paper Section 6).

- MD (contiguous_memory_optimization): the caching allocator's fragmentation, stage 2 without and
  with MD (C3): the peak bytes of inactive split blocks (free pieces of cached segments), and the
  reserved and allocated peaks (taken at different moments: their difference bounds the slack). On the CPU there is no allocator to fragment;
  the arena's mechanics are tested in tests/zero_impl/test_zero_r.py.
- Pa+cpu (cpu_checkpointing): the checkpoints go to pinned host memory on a side stream and come
  back one layer ahead of their recomputation. The row checks every checkpoint was prefetched
  (none fetched on demand) and that the losses are bitwise C4's (the same run kept on the
  device, deterministic kernels), and reports memory and the step time against C4 (near 1 when
  the copies overlap the compute; measured, not judged).

- Through the collectives: all four runs send every collective through the backend at world 1
  (common.FORCE; NCCL on a GPU): the gradient reduce-scatters, the parameter all-gathers and
  Pa's all-gather of each checkpoint over the model-parallel group, on NCCL's stream. Each is
  compared bit for bit with REFERENCE, stage 2 with local copies: at world 1 every collective
  is a copy, and MD, Pa and Pa+cpu move checkpoints without changing them.

All five runs share one spawned rank (one CUDA context), one after another, the same model,
seed and tokens. At world 1 the model-parallel group has one rank, so Pa's slice is the whole
checkpoint: what is measured is the host round trip and the arena, not the partitioning (the
TP2xDP2 rows of multi_rank_rows.py gather over two ranks).
"""
from __future__ import annotations

import gc
import math
import os
import warnings

import torch

from experiments.gpu_check.common import FORCE, attempt, deterministic, dp_traffic, error_line, verdict
from experiments.run.real import train_rank

REFERENCE = "stage 2, local copies"
RUNS = {  # name -> Hydra overrides of experiments/train.py (all but REFERENCE also get FORCE)
    REFERENCE: ["zero.force_collectives=false"],
    "stage 2": [],
    "C3 (MD)": ["zero.contiguous_memory_optimization=true"],
    "C4 (Pa, MD)": ["zero.contiguous_memory_optimization=true", "zero.partition_activations=true"],
    "C5 (Pa+cpu, MD)": ["zero.contiguous_memory_optimization=true", "zero.partition_activations=true",
                        "zero.cpu_checkpointing=true"],
}


def zero_r_points(make_point, model: str, micro_batch: int, precision: str) -> dict[str, object]:
    """One experiments/train.py point per run of RUNS, stage 2 with recomputation."""
    return {name: make_point(f"model={model}", "stage=2", f"micro_batch={micro_batch}",
                             f"train.precision={precision}", "train.recompute=true", "train.warmup_steps=1",
                             "train.steps=3", *([] if name == REFERENCE else [FORCE]), *overrides)
            for name, overrides in RUNS.items()}


ALLOCATOR_STATS = ("allocated_bytes.all.peak", "reserved_bytes.all.peak", "inactive_split_bytes.all.peak")


def zero_r_rank(points: dict[str, dict], precision: str) -> dict[str, dict]:
    """Runs inside the spawned rank: each point through train_rank (which resets CUDA's peak
    statistics), the previous run's memory collected and returned to the driver first, and the
    allocator's peaks read right after. Deterministic kernels (common.deterministic) so that
    runs differing only in where checkpoints live can be compared bit for bit."""
    deterministic(nan_fill=False)
    out = {}
    for name, point in points.items():
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # each run's reserved bytes are its own
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out[name] = attempt(train_rank, point, precision)
        # ops without a deterministic kernel (warn_only): what to suspect if two runs differ
        out[name]["nondeterministic"] = sorted({str(w.message).split(".")[0][:80] for w in caught
                                                if "deterministic" in str(w.message)})
        if out[name]["ok"] and torch.cuda.is_available():
            stats = torch.cuda.memory_stats()
            out[name]["allocator"] = {k: stats.get(k, 0) for k in ALLOCATOR_STATS}
    return out


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _median_ms(result: dict) -> float:
    times = sorted(result["step_times_s"])
    return 1e3 * times[len(times) // 2]


def md_row(outcomes: dict[str, dict], label: str) -> tuple[str, str, str, str]:
    """MD: the allocator's fragmentation, without and with the arena."""
    name = f"MD fragmentation ({label}, stage 2 vs C3)"
    expected = ("both train, C3's checkpoints in its arena; the peak bytes of inactive split blocks (fragments) "
                "and reserved - allocated peaks, measured (the paper: MD avoids OOM from fragmentation)")
    failure = _first_failure(outcomes, ("stage 2", "C3 (MD)"))
    if failure:
        return name, failure, expected, "FAIL"
    parts, finite = [], True
    for run in ("stage 2", "C3 (MD)"):
        r = outcomes[run]["value"]
        finite &= all(map(math.isfinite, r["losses"]))
        parts.append(f"{run}: {_allocator(outcomes[run], r)}")
    arena = outcomes["C3 (MD)"]["value"]["stats"]["buffers"].get("md_arena_device", 0)
    parts.append(f"arena {_size(arena)}; PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}")
    return name, "; ".join(parts), expected, "PASS" if finite and arena > 0 else "FAIL"


def overlap_row(outcomes: dict[str, dict], label: str) -> tuple[str, str, str, str]:
    """Pa+cpu: every checkpoint prefetched, training unchanged, memory and step time against C4."""
    name = f"Pa+cpu prefetch and cost ({label}, C5 vs C4)"
    expected = ("all checkpoints prefetched, none on demand, losses bitwise C4's; memory and the step time "
                "ratio measured (near 1x when the side-stream copies overlap recomputation)")
    failure = _first_failure(outcomes, ("C4 (Pa, MD)", "C5 (Pa+cpu, MD)"))
    if failure:
        return name, failure, expected, "FAIL"
    c4, c5 = outcomes["C4 (Pa, MD)"]["value"], outcomes["C5 (Pa+cpu, MD)"]["value"]
    acts = c5["stats"]["activations"]
    host = c5["stats"]["buffers"].get("md_arena_host", 0)
    diff = max((abs(a - b) for a, b in zip(c4["losses"], c5["losses"])), default=math.inf)
    same = c4["losses"] == c5["losses"]
    suspects = sorted(set(outcomes["C4 (Pa, MD)"]["nondeterministic"] + outcomes["C5 (Pa+cpu, MD)"]["nondeterministic"]))
    ratio = _median_ms(c5) / _median_ms(c4)
    measured = (f"prefetched {acts['prefetched']}/{acts['checkpoints']}, on demand {acts['on_demand']}, "
                f"host arena {_size(host)}, losses {'bitwise equal' if same else f'DIFFER by up to {diff:.2e}'}"
                f"{'' if same or not suspects else ' (nondeterministic ops: ' + ', '.join(suspects) + ')'}; "
                f"C4: {_allocator(outcomes['C4 (Pa, MD)'], c4)}; C5: {_allocator(outcomes['C5 (Pa+cpu, MD)'], c5)}; "
                f"step {_median_ms(c5):.0f} ms vs {_median_ms(c4):.0f} ms ({ratio:.2f}x)")
    ok = same and acts["on_demand"] == 0 and acts["prefetched"] == acts["checkpoints"] > 0 and host > 0
    return name, measured, expected, "PASS" if ok else "FAIL"


def collectives_row(outcomes: dict[str, dict], label: str) -> tuple[str, str, str, str]:
    """Stage 2, MD, Pa and Pa+cpu through the collectives, bit for bit REFERENCE's losses, their
    data-parallel traffic 2Ψ per step and Pa's gathers counted (proof the collectives ran)."""
    name = f"ZeRO-R through the collectives ({label}: stage 2, C3, C4, C5 vs {REFERENCE})"
    expected = "losses bitwise the local copies'; DP traffic 2Ψ/step; C4 and C5: Pa's all-gathers counted"
    forced = [n for n in RUNS if n != REFERENCE]
    failure = _first_failure(outcomes, (REFERENCE, *forced))
    if failure:
        return name, failure, expected, "FAIL"
    local, parts, checks = outcomes[REFERENCE]["value"]["losses"], [], []
    for run in forced:
        r = outcomes[run]["value"]
        traffic, traffic_ok = dp_traffic(r["stats"], 2)
        gathered = r["stats"]["comm"]["last_step"]["by_purpose"].get("activations", {}).get("elements", 0)
        pa = "zero.partition_activations=true" in RUNS[run]
        diff = max((abs(a - b) for a, b in zip(r["losses"], local)), default=math.inf)
        same = r["losses"] == local
        checks += [same, traffic_ok, gathered > 0 or not pa]
        parts.append(f"{run}: {'bitwise' if same else f'DIFFER by up to {diff:.2e}'}, {traffic:.4f}Ψ"
                     + (f", Pa gathered {gathered}" if pa else "")
                     + ("" if same or not outcomes[run]["nondeterministic"]
                        else f" (nondeterministic ops: {', '.join(outcomes[run]['nondeterministic'])})"))
    return name, "; ".join(parts), expected, verdict(*checks)


def _first_failure(outcomes: dict[str, dict], runs: tuple[str, ...]) -> str | None:
    """The first of `runs` that failed, and why, as a row's measured cell; None if all trained."""
    failed = [n for n in runs if not outcomes[n]["ok"]]
    return f"{failed[0]}: {error_line(outcomes[failed[0]]['error'])}" if failed else None


def _allocator(outcome: dict, result: dict) -> str:
    """CUDA's peaks of one run, or the tensor peak where there is no allocator (CPU rehearsal)."""
    a = outcome.get("allocator")
    if not a:
        return f"no allocator on CPU (peak {_size(result['stats']['memory']['peak_bytes'])} of tensors)"
    allocated, reserved = a["allocated_bytes.all.peak"], a["reserved_bytes.all.peak"]
    return (f"fragments {_size(a['inactive_split_bytes.all.peak'])}, reserved {_size(reserved)} - "
            f"allocated {_size(allocated)} = {_size(reserved - allocated)} (peaks)")
