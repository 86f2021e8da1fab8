"""The simulated rank's event log (run/storage_tracker.py) and what the caching allocator's
replay of it reserves (run/reserved.py): the log agrees with the tracker's own peak, logs a
resize as the CUDA backend runs it and cuBLAS's workspace once per stream; records carry the
reserved peak and decide `fits` on it; the 13B ZeRO-2 point on 128 V100s reports both."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from experiments.allocator import Event
from experiments.run import fake as simulate
from experiments.run import record as simulated_records
from experiments.run.reserved import CUBLAS_WORKSPACE_BYTES, CUBLAS_WORKSPACE_BYTES_SM90, cublas_workspace_bytes
from experiments.run.storage_tracker import KINDS, StorageTracker
from test_simulate import make_point

MiB = 1 << 20


def test_resize_is_a_new_block_then_the_old_one_freed():
    """resize_bytes_cuda allocates the new size, copies, frees the old: stage 3's release
    (resize_(0)) is a free, its re-gather (resize_(n)) an allocation."""
    tracker = StorageTracker()
    with FakeTensorMode(), tracker:
        tracker.begin("forward")
        t = torch.empty(1000, dtype=torch.float16)
        st = t.untyped_storage()
        st.resize_(0)
        st.resize_(3000)
        st.resize_(4000)
        del t, st
    assert [(e.action, e.key, e.nbytes) for e in tracker.events] == [
        ("alloc", 0, 2000), ("free", 0, 0), ("alloc", 1, 3000), ("alloc", 2, 4000), ("free", 1, 0), ("free", 2, 0)]


def test_cublas_workspace_once_per_stream():
    """The first GEMM on a stream takes cuBLAS's workspace after its output; later GEMMs reuse it."""
    tracker = StorageTracker(cublas_workspace_bytes=CUBLAS_WORKSPACE_BYTES)
    with FakeTensorMode(), tracker:
        tracker.begin("forward")
        a = torch.empty(64, 64)
        b = a @ a
        c = b @ a
        tracker.stream = 1
        d = torch.addmm(a, a, a)
        del b, c, d
    log = [(e.action, e.nbytes, e.stream) for e in tracker.events if e.action == "alloc"]
    assert log == [("alloc", 16384, 0), ("alloc", 16384, 0), ("alloc", CUBLAS_WORKSPACE_BYTES, 0), ("alloc", 16384, 0),
                   ("alloc", 16384, 1), ("alloc", CUBLAS_WORKSPACE_BYTES, 1)]
    assert CUBLAS_WORKSPACE_BYTES == 8_519_680  # ":4096:2:16:8" = 2 x 4096 + 8 x 16 KiB
    assert cublas_workspace_bytes(make_point("tiny_s", 2, 8, 1, 2, cluster="dgx_h100")) == CUBLAS_WORKSPACE_BYTES_SM90
    assert cublas_workspace_bytes(make_point("tiny_s", 2, 8, 1, 2, cluster="dgx2_v100")) == CUBLAS_WORKSPACE_BYTES
    assert cublas_workspace_bytes(make_point("tiny_s", 2, 8, 1, 2)) == 0


@pytest.mark.parametrize("stage", [2, 3])
def test_replayed_log_has_the_trackers_peak(stage):
    """The log's requests, each rounded as the allocator rounds it, peak exactly where the
    tracker's 512-byte ledger peaks (no workspace on the local cluster), for a stage that frees
    gradients as it goes (2) and one that resizes gathered units (3); the allocator holds at
    least that, and reserves at least what it holds."""
    point = make_point("tiny_m", stage, 4, 1, 2, reduce_bucket_size=30000, stage3_prefetch_bucket_size=30000)
    result = simulate.simulate_in_child(point.as_dict(), "fp16", 0)
    res, peak = result["reserved"], result["memory"]["peak_bytes"]
    assert res["rounded_peak_bytes"] == peak
    assert res["reserved_peak_bytes"] >= res["allocated_peak_bytes"] >= peak
    assert res["capacity_bytes"] is None and res["oom"] is False
    assert res["unbounded"]["reserved_peak_bytes"] == res["reserved_peak_bytes"]  # no device: one and the same


def test_fits_is_decided_on_reserved_bytes():
    """A point whose tensors fit but whose reserved segments do not is oom, caused by fragmentation."""
    point = make_point("tiny_s", 2, 8, 1, 2, cluster="dgx2_v100")  # 32 GB, 1 GB CUDA reserve
    gb = 10 ** 9
    mem = {"peak_bytes": 29 * gb, "peak_by_kind": dict.fromkeys(KINDS, 0)}
    reserved = {"reserved_peak_bytes": 31 * gb, "oom": True, "expandable": {"oom": False}}
    v = simulated_records.verdict(point, mem["peak_bytes"], reserved)
    assert (v["fits"], v["decided_on"], v["needed_bytes"]) == (False, "reserved", 32 * gb)
    assert simulated_records.oom_cause(mem, v) == "fragmentation"
    ok = simulated_records.verdict(point, mem["peak_bytes"], {**reserved, "reserved_peak_bytes": 30 * gb, "oom": False})
    assert ok["fits"] is True


@pytest.mark.slow
def test_13b_zero2_on_128_v100s_reports_reserved_and_fragmentation(capsys):
    """Figure 4's 13B ZeRO-2 point (128 V100 32 GB, micro-batch 2): its record has the
    allocator's reserved peak beside the tensor peak, the fragmentation between them and the
    options replayed; fits is decided on it."""
    point = make_point("fig4_13b", 2, 128, 1, 2, cluster="dgx2_v100")
    point.experiment = "fig4"
    precision = simulate.simulated_precision(point)
    result = simulate.simulate_in_child(point.as_dict(), precision, 0, foreach=True)
    mem = simulated_records.simulated_record(point, precision, result, None, "now")["memory"]
    assert mem["reserved_peak_bytes"] >= mem["allocated_peak_bytes"] >= mem["peak_bytes"] > 20e9
    assert 0 <= mem["fragmentation"] < 0.5 and mem["decided_on"] == "reserved"
    assert mem["allocator"]["unbounded"]["reserved_peak_bytes"] >= mem["reserved_peak_bytes"]  # no retry caps it
    assert mem["allocator"]["allocator"]["PYTORCH_CUDA_ALLOC_CONF"] == ""  # torch's defaults, recorded
    assert mem["allocator"]["cublas_workspace_bytes"] == CUBLAS_WORKSPACE_BYTES
    with capsys.disabled():
        print(f"\n13B ZeRO-2, 128 V100s: tensors {mem['peak_bytes'] / 1e9:.2f} GB, reserved "
              f"{mem['reserved_peak_bytes'] / 1e9:.2f} GB, fragmentation {mem['fragmentation']:.3f}, "
              f"retries {mem['alloc_retries']}, expandable {mem['allocator']['expandable']['reserved_peak_bytes'] / 1e9:.2f} GB")


def test_plan_row_fits_with_expandable_segments_where_only_they_fit():
    """plan.py: a simulated candidate whose default allocator runs out of memory but whose
    expandable-segments replay fits is a fit, with PYTORCH_CUDA_ALLOC_CONF in its commands;
    reserved_gb and fragmentation are the replay's under that option."""
    from experiments.sweeps import plan
    from test_plan import _priced

    c = _priced("micro_batches=[1]", "stages=[2]")[0]
    limit = c.limit
    c.simulated_peak = limit * 0.9
    c.reserved = {"reserved_peak_bytes": limit, "oom": True, "conf": "", "fragmentation": 0.1,
                  "expandable": {"reserved_peak_bytes": limit * 0.95, "oom": False, "conf": "expandable_segments:True",
                                 "fragmentation": 0.05}}
    assert c.fits and c.alloc_conf == "expandable_segments:True" and c.peak == limit * 0.95
    [row] = plan.rows([c], base_model="tiny_s")
    assert row["command"].startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ")
    assert row["sbatch"].startswith("sbatch --export=ALL,PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ")
    assert (row["reserved_gb"], row["fragmentation"], row["peak_gb"]) == (
        round(limit * 0.95 / 1e9, 2), 0.05, round(limit * 0.9 / 1e9, 2))
    c.reserved["expandable"]["oom"] = True
    assert not c.fits and c.alloc_conf == ""
    c.reserved.update(oom=False, reserved_peak_bytes=limit * 0.99)
    assert c.fits and c.alloc_conf == "" and plan.rows([c], base_model="tiny_s")[0]["command"].startswith(("torchrun", "python", ".venv", "/"))
