"""`make gpu-check`'s ZeRO-R rows: what only CUDA can show of MD and Pa+cpu (paper Section 6).

- MD (contiguous_memory_optimization): the caching allocator's slack at the peak, reserved minus
  allocated, for stage 2 without and with MD (C3). On the CPU there is no allocator to fragment;
  the arena's mechanics are tested in tests/test_zero_r.py.
- Pa+cpu (cpu_checkpointing): the checkpoints go to pinned host memory on a side stream and come
  back one layer ahead of their recomputation. The row checks every checkpoint was prefetched
  (none fetched on demand), that training is bitwise that of C4 (the same run kept on the
  device), and reports the step time against C4: near 1 when the copies overlap the compute.

All four runs share one spawned rank (one CUDA context), one after another, the same model,
seed and tokens. At world 1 the model-parallel group has one rank, so Pa's slice is the whole
checkpoint: what is measured is the host round trip and the arena, not the partitioning.
"""
from __future__ import annotations

import math

import torch

from experiments.gpu_check import attempt, error_line

RUNS = {  # name -> Hydra overrides of experiments/train.py
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
                             "train.steps=3", *overrides)
            for name, overrides in RUNS.items()}


def zero_r_rank(points: dict[str, dict], precision: str) -> dict[str, dict]:
    """Runs inside the spawned rank: each point through train_rank, the allocator emptied between."""
    from experiments.train import train_rank
    out = {}
    for name, point in points.items():
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # each run's reserved bytes are its own
        out[name] = attempt(train_rank, point, precision)
    return out


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _median_ms(result: dict) -> float:
    times = sorted(result["step_times_s"])
    return 1e3 * times[len(times) // 2]


def md_row(outcomes: dict[str, dict], label: str) -> tuple[str, str, str, str]:
    """MD: reserved minus allocated at the peak, without and with the arena."""
    name = f"MD fragmentation ({label}, stage 2 vs C3)"
    expected = "both train; reserved - allocated at the peak, measured (the paper: MD avoids OOM from fragmentation)"
    failed = [n for n in ("stage 2", "C3 (MD)") if not outcomes[n]["ok"]]
    if failed:
        return name, f"{failed[0]}: {error_line(outcomes[failed[0]]['error'])}", expected, "FAIL"
    parts, finite = [], True
    for run in ("stage 2", "C3 (MD)"):
        r = outcomes[run]["value"]
        m = r["stats"]["memory"]
        finite &= all(map(math.isfinite, r["losses"]))
        if "cuda_max_reserved" in m:
            slack = m["cuda_max_reserved"] - m["cuda_max_allocated"]
            parts.append(f"{run}: {_size(slack)} (reserved {_size(m['cuda_max_reserved'])}, "
                         f"allocated {_size(m['cuda_max_allocated'])})")
        else:
            parts.append(f"{run}: no allocator on CPU (peak {_size(m['peak_bytes'])} of tensors)")
    arena = outcomes["C3 (MD)"]["value"]["stats"]["buffers"].get("md_arena_device", 0)
    parts.append(f"arena {_size(arena)}")
    return name, "; ".join(parts), expected, "PASS" if finite and arena > 0 else "FAIL"


def overlap_row(outcomes: dict[str, dict], label: str) -> tuple[str, str, str, str]:
    """Pa+cpu: every checkpoint prefetched, training unchanged, step time against C4."""
    name = f"Pa+cpu overlap ({label}, C5 vs C4)"
    expected = "all checkpoints prefetched, none on demand, losses bitwise C4's; step time ratio measured"
    failed = [n for n in ("C4 (Pa, MD)", "C5 (Pa+cpu, MD)") if not outcomes[n]["ok"]]
    if failed:
        return name, f"{failed[0]}: {error_line(outcomes[failed[0]]['error'])}", expected, "FAIL"
    c4, c5 = outcomes["C4 (Pa, MD)"]["value"], outcomes["C5 (Pa+cpu, MD)"]["value"]
    acts = c5["stats"]["activations"]
    host = c5["stats"]["buffers"].get("md_arena_host", 0)
    same = c4["losses"] == c5["losses"]
    ratio = _median_ms(c5) / _median_ms(c4)
    measured = (f"prefetched {acts['prefetched']}/{acts['checkpoints']}, on demand {acts['on_demand']}, "
                f"host arena {_size(host)}, losses {'bitwise equal' if same else 'DIFFER'}; "
                f"step {_median_ms(c5):.0f} ms vs {_median_ms(c4):.0f} ms ({ratio:.2f}x)")
    ok = same and acts["on_demand"] == 0 and acts["prefetched"] == acts["checkpoints"] > 0 and host > 0
    return name, measured, expected, "PASS" if ok else "FAIL"

