"""make gpu-check's allocator rows (experiments/gpu_check/memory_rows.py) on CPU: the runs are
valid train.py points, a recorded trace is replayed to the trace's own peaks, and the rows say
PASS only when replay and trace agree exactly."""
from __future__ import annotations

from experiments.gpu_check import memory_rows as memory
from experiments.gpu_check.common import make_point
from test_allocator import HAND_WORKED, snapshot_dict, trace_entries

MiB = 1 << 20


def test_runs_are_points_md_off_and_on():
    runs = memory.memory_runs("tiny_m", "gpt_1.3b", 4, "bf16")
    assert list(runs) == ["tiny_m MD off", "tiny_m MD on", "gpt_1.3b MD off", "gpt_1.3b MD on"]
    points = {name: make_point(*overrides) for name, overrides in runs.items()}
    assert [p.zero["contiguous_memory_optimization"] for p in points.values()] == [False, True, False, True]
    assert all(p.stage == 2 and p.train["recompute"] and p.train["steps"] == 3 for p in points.values())


def test_a_trace_replays_to_its_own_peaks_and_the_rows_judge_exactness():
    m = memory.replayed(snapshot_dict(trace_entries(HAND_WORKED["eight_16mib_freed_then_four_32mib"].log,
                                                    with_segments=True)), 0)
    assert (m["replay_reserved"], m["trace_reserved"], m["replay_segments"], m["trace_segments"]) == \
        (256 * MiB, 256 * MiB, 12, 12)
    run = {**m, "ok": True, "error": None, "reserved_at_start": 0, "stats_reserved_peak": 256 * MiB}
    assert memory.replay_row({"a": run})[3] == "PASS"
    assert memory.replay_row({"a": {**run, "trace_segments": 11}})[3] == "FAIL"
    assert memory.replay_row({"a": {**run, "reserved_at_start": 2 * MiB}})[3] == "FAIL"
    predicted = {"a": {"ok": True, "memory": {"reserved_peak_bytes": 128 * MiB, "peak_bytes": 100 * MiB}}}
    name, text, _, verdict = memory.prediction_row({"a": run}, predicted)
    assert verdict == "PASS" and "ratio 0.500" in text
    assert memory.prediction_row({"a": run}, {"a": {"ok": False, "error": "boom"}})[3] == "FAIL"
