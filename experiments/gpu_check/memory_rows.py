"""`make gpu-check`'s allocator rows: the caching allocator's replay (experiments/allocator)
against what the GPU's own allocator records, and the simulated rank's prediction against it.

For `tiny_m` and the 1.3B point (stage 2, recomputation, three steps), MD off and on:

1. replay = trace, exactly: each run starts in a fresh spawned process, from an empty
   allocator (nothing reserved; cuBLAS's workspaces cleared, the cache emptied), with
   torch.cuda.memory._record_memory_history on; its snapshot (the trace's alloc / free_completed entries) is replayed under the
   snapshot's own PYTORCH_CUDA_ALLOC_CONF, cudaMalloc's addresses taken from the trace's
   segment_alloc entries (they only break ties between equal-size blocks). The replay's
   reserved peak and segment peak must equal the trace's own (segment_alloc / segment_free /
   segment_map / segment_unmap summed) to the byte; the trace's reserved peak is shown beside
   torch.cuda.memory_stats()'s reserved_bytes.all.peak (reset by train_rank after the build);
2. prediction vs measured: the same point simulated on fake tensors (train.py simulate=true in
   a child that sees no CUDA, with this GPU's memory and name as its cluster, so cuBLAS's
   workspace is this GPU's), its replayed reserved peak beside the measured one and the ratio:
   measured, not judged (what the fake trace cannot see: docs/simulation.md).
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from experiments.allocator import parse_conf, replay
from experiments.allocator import snapshot as snapshots
from experiments.gpu_check.common import attempt, error_line
from experiments.records import REPO
from experiments.run.real import train_rank

TRACE_ENTRIES = 20_000_000  # the trace's ring buffer: far above three steps of the 1.3B point


def memory_runs(small_model: str, big_model: str, micro_batch: int, precision: str) -> dict[str, list[str]]:
    """name -> Hydra overrides of experiments/train.py, MD off and on for each model."""
    return {f"{model} MD {'on' if md else 'off'}": [
        f"model={model}", "stage=2", f"micro_batch={micro_batch}", f"train.precision={precision}",
        "train.recompute=true", "train.warmup_steps=1", "train.steps=3", f"zero.contiguous_memory_optimization={str(md).lower()}"]
        for model in (small_model, big_model) for md in (False, True)}


def replayed(snap: dict, device: int) -> dict:
    """A snapshot's trace on `device` replayed: the replay's peaks beside the trace's own."""
    trace = snapshots.trace(snap, device)
    result = replay(trace.events, parse_conf(trace.alloc_conf), None, trace.segment_addresses)
    return {"replay_reserved": result.reserved_peak_bytes, "replay_segments": result.segments_peak,
            "trace_reserved": trace.reserved_peak_bytes, "trace_segments": trace.segments_peak,
            "allocated_peak": result.allocated_peak_bytes, "events": result.events,
            "fragmentation": result.fragmentation, "conf": trace.alloc_conf or ""}


def memory_rank(points: dict[str, dict], precision: str) -> dict[str, dict]:
    """Runs inside the spawned rank: each point trained under the allocator's history, from an
    empty allocator, and its snapshot replayed here (the snapshot stays in this process)."""
    out = {}
    for name, point in points.items():
        gc.collect()
        torch._C._cuda_clearCublasWorkspaces()  # held per handle and stream for the process's life
        torch.cuda.empty_cache()
        start = torch.cuda.memory_reserved()
        torch.cuda.memory._record_memory_history(enabled=None)  # off: the previous run's trace goes
        torch.cuda.memory._record_memory_history(enabled="all", context=None, max_entries=TRACE_ENTRIES)
        try:
            run = attempt(train_rank, point, precision)
            snap = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        res = {"ok": run["ok"], "error": run.get("error"), "reserved_at_start": start,
               "stats_reserved_peak": torch.cuda.memory_stats().get("reserved_bytes.all.peak", 0)}
        if run["ok"]:
            done = attempt(replayed, snap, torch.cuda.current_device())
            res.update(done["value"] if done["ok"] else {"ok": False, "error": done["error"]})
        del snap, run
        out[name] = res
    return out


def predictions(runs: dict[str, list[str]], timeout: float) -> dict[str, dict]:
    """Each run simulated by train.py simulate=true in a child without CUDA, on a cluster of
    this GPU's memory and name: its record's memory (or the error)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    cluster = [f"cluster.device_memory_gb={props.total_memory / 1e9:.3f}", f"cluster.description='{props.name}'"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in runs.items():
            folder = Path(tmp) / name.replace(" ", "_")
            cmd = [sys.executable, "experiments/train.py", "experiment_name=gpu_check", "gpus=1", *overrides, *cluster,
                   "simulate=true", f"results_dir={folder}"]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
            except subprocess.TimeoutExpired:
                out[name] = {"ok": False, "error": f"simulation timed out after {timeout:.0f} s"}
                continue
            found = sorted(folder.rglob("simulated/*.json"))
            if done.returncode != 0 or not found:
                out[name] = {"ok": False, "error": done.stderr or done.stdout or "no record"}
                continue
            out[name] = {"ok": True, "memory": json.loads(found[0].read_text())["memory"]}
    return out


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB"


def replay_row(measured: dict[str, dict]) -> tuple[str, str, str, str]:
    name = "allocator replay = GPU trace (" + ", ".join(measured) + ")"
    expected = "replay's reserved peak and segment peak equal the trace's exactly, from an empty allocator"
    parts, exact = [], True
    for run, m in measured.items():
        if not m["ok"]:
            return name, f"{run}: {error_line(m['error'] or 'failed')}", expected, "FAIL"
        same = m["replay_reserved"] == m["trace_reserved"] and m["replay_segments"] == m["trace_segments"] \
            and m["reserved_at_start"] == 0
        exact &= same
        parts.append(f"{run}: replay {m['replay_reserved']} B / {m['replay_segments']} segments, trace "
                     f"{m['trace_reserved']} B / {m['trace_segments']} (stats peak {m['stats_reserved_peak']} B), "
                     f"fragmentation {m['fragmentation']:.3f}" + ("" if same else " MISMATCH"))
    return name, "; ".join(parts), expected, "PASS" if exact else "FAIL"


def prediction_row(measured: dict[str, dict], predicted: dict[str, dict]) -> tuple[str, str, str, str]:
    name = "fake-trace reserved prediction vs measured"
    expected = "the simulated rank's replayed reserved peak beside the GPU's; ratio measured, not judged"
    parts = []
    for run, m in measured.items():
        p = predicted.get(run, {"ok": False, "error": "not simulated"})
        if not m["ok"] or not p["ok"]:
            return name, f"{run}: {error_line((m if not m['ok'] else p).get('error') or 'failed')}", expected, "FAIL"
        mem = p["memory"]
        parts.append(f"{run}: predicted {_gb(mem['reserved_peak_bytes'])} (tensors {_gb(mem['peak_bytes'])}), measured "
                     f"{_gb(m['trace_reserved'])} (allocated {_gb(m['allocated_peak'])}), ratio "
                     f"{mem['reserved_peak_bytes'] / m['trace_reserved']:.3f}")
    return name, "; ".join(parts), expected, "PASS"
