"""make calibrate's profile and the CPU prediction check: the profile round-trips into a Hardware,
the measured GEMM table and gloo fits give hand-checked values, and the prediction_check table
is built from fixture records and a fixture profile. No timing is asserted: speed is measured
by `make calibrate`, never by a test; these check the plumbing and the arithmetic."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from experiments.analysis import calibrated
from experiments.calibration import collectives, compute, profile as calibration_profile
from experiments.reports import prediction_check as pc

REFERENCE = Path(__file__).resolve().parents[2] / "results" / "reference" / "runs" / "cpu_default"

# Round numbers, so every expected value below is worked by hand.
PROFILE = {
    "host": "testhost", "cpu": "Test CPU", "cpu_count": 2, "date": "2026-01-01T00:00:00Z",
    "torch": "2.x", "threads": 1, "dtype": "float32", "load_average": [0.0, 0.0, 0.0], "note": "fixture",
    "op_floor": {"forward_s": 3e-6, "backward_s": 4e-6},
    "framework": {"shape": {"hidden": 8, "heads": 1, "seq_len": 8, "vocab_size": 16}, "micro_batch": 1,
                  "recompute": True, "layers": [1, 4], "step_s": [0.004, 0.010]},
    "stream": {"array_bytes": 2 ** 28, "bytes_per_s": 10e9},
    "gemm": [{"m": 64, "n": 64, "k": 64, "batch": 1, "seconds": 0.0, "flops_per_s": 1e9},
             {"m": 256, "n": 64, "k": 64, "batch": 1, "seconds": 0.0, "flops_per_s": 3e9},
             {"m": 512, "n": 64, "k": 64, "batch": 1, "seconds": 0.0, "flops_per_s": 4e9}],
    "collectives": {2: {kind: {"latency_s": 1e-4, "bytes_per_s": 1e9, "times_s": {8: 1e-4}}
                        for kind in collectives.KINDS}},
}


def test_kernel_floor_is_the_vanishing_models_host_time_per_modelled_kernel():
    from experiments.analysis import kernels as kn
    x = kn.LayerShape(1, 8, 8, 1, 1, 16, 4)
    per_layer = sum(k.count for k in kn.layer_forward(x)) * 2 + sum(k.count for k in kn.layer_backward(x))  # recomputed
    assert calibrated.kernels_per_step(PROFILE["framework"], 4) - calibrated.kernels_per_step(PROFILE["framework"], 1) \
        == 3 * per_layer
    assert calibrated.kernel_floor_s(PROFILE["framework"]) == pytest.approx((0.010 - 0.004) / (3 * per_layer))


def test_profile_round_trips_through_yaml_into_a_hardware(tmp_path):
    path = tmp_path / "testhost.yaml"
    path.write_text(yaml.safe_dump(PROFILE, sort_keys=False))
    assert calibrated.load_profile(path) == PROFILE
    hw = calibrated.load_calibrated(path)
    assert hw.name == "calibrated:testhost"
    assert hw.peak_flops == 4e9                      # the best measured GEMM rate
    assert hw.stream_bytes_per_s == 10e9             # measured: fraction 1
    assert hw.gpus_per_node == 2
    assert all("testhost" in hw.sources[k] and "2026-01-01" in hw.sources[k]
               for k in ("peak_flops", "hbm_bytes_per_s", "kernel_floor_s", "gemm", "collectives"))


def test_measured_gemm_returns_its_own_rates_and_interpolates_between_them():
    gemm = calibrated.MeasuredGemm(((64, 64, 64, 1e9), (256, 64, 64, 3e9)), peak_flops=4e9)
    assert gemm.efficiency(256, 64, 64) == 3e9 / 4e9
    # (128, 64, 64) is one log2 step from each: equal weights, the mean rate
    assert gemm.rate(128, 64, 64) == pytest.approx(2e9)
    # ... and from (64, 64, 64) 1 step, from (512, 64, 64) 2 steps: weights 1 and 1/4
    far = calibrated.MeasuredGemm(((64, 64, 64, 1e9), (512, 64, 64, 4e9)), peak_flops=4e9)
    assert far.rate(128, 64, 64) == pytest.approx((1e9 + 4e9 / 4) / 1.25)
    assert far.efficiency(128, 64, 64) == pytest.approx(1.6e9 / 4e9)


def test_measured_collectives_are_latency_plus_bytes_over_bandwidth():
    c = calibrated.MeasuredCollectives({2: {"all_reduce": (1e-4, 1e9), "all_gather": (2e-4, 5e8)}})
    assert c.time_s("all_reduce", 1e6, 2, 2) == pytest.approx(1e-4 + 1e-3)
    assert c.time_s("all_gather", 1e6, 2, 2) == pytest.approx(2e-4 + 2e-3)
    assert c.time_s("all_gather", 1e6, 2, 2, concurrent=2) == pytest.approx(2e-4 + 4e-3)  # sharing the loopback
    assert c.time_s("all_reduce", 1e6, 1, 1) == 0.0
    with pytest.raises(ValueError, match="world 4"):
        c.time_s("all_reduce", 1e6, 4, 4)
    with pytest.raises(ValueError, match="allowed"):
        c.time_s("gather", 1e6, 2, 2)


def _timed_as() -> bool:
    return collectives._communicator().point_to_point


def test_collectives_are_timed_as_the_cpu_default_records_ran_them():
    """The prediction check compares the cpu_default records with times predicted from this
    calibration: its reduce-scatters and all-gathers must be what those records ran."""
    from experiments.launch import spawn
    conf = yaml.safe_load((REFERENCE.parents[3] / "conf" / "experiment" / "cpu_default.yaml").read_text())
    assert spawn(_timed_as, 2, timeout=60) == [conf["zero"]["gloo_point_to_point"]] * 2


def test_gloo_fit_latency_from_small_sizes_bandwidth_from_large():
    times = {8: 1e-4, 128: 1.2e-4, 2048: 1e-4, 2 ** 15: 5e-4,  # 32 KiB: neither latency nor bandwidth
             2 ** 19: 1e-4 + 2 ** 19 / 1e9, 2 ** 21: 1e-4 + 2 ** 21 / 1e9, 2 ** 23: 1e-4 + 2 ** 23 / 2e9}
    fit = collectives.fit(times)
    assert fit["latency_s"] == pytest.approx(1e-4)             # median of 1e-4, 1.2e-4, 1e-4
    assert fit["bytes_per_s"] == pytest.approx(1e9)            # median of 1e9, 1e9, 2e9


def test_gloo_fit_takes_the_bandwidth_only_from_sizes_whose_bytes_outlast_the_latency():
    """Timed beside compute, a call's latency is a wait for the scheduler's tick (2 ms here), as
    long as a 2 MiB call's bytes: those sizes say nothing of the bandwidth."""
    times = {8: 2e-3, 128: 2.2e-3, 2048: 1.8e-3,                # latency: the median, 2 ms
             2 ** 19: 1.5e-3,                                   # under the latency: a rate of any size
             2 ** 21: 2.5e-3,                                   # < 2 x latency: mostly the wait
             2 ** 23: 2e-3 + 2 ** 23 / 1e9, 2 ** 24: 2e-3 + 2 ** 24 / 1e9}   # bytes-bound: 1 GB/s
    fit = collectives.fit(times)
    assert fit["latency_s"] == pytest.approx(2e-3)
    assert fit["bytes_per_s"] == pytest.approx(1e9)            # not (2**21 / 0.5e-3 + 1e9) / 2, nor 2**19 / 1e-12
    # no size twice the latency: the largest alone, its time less the latency
    flat = {8: 2e-3, 2048: 2e-3, 2 ** 19: 2.1e-3, 2 ** 21: 2.6e-3}
    assert collectives.fit(flat)["bytes_per_s"] == pytest.approx(2 ** 21 / 0.6e-3)


def test_collectives_are_timed_after_compute_over_one_tick_of_phases():
    """The repeats' compute before each call: the span's midpoints, evenly spaced, from a layer's
    forward (1.5 ms) over one 4 ms tick (HZ=250), so the mean covers every phase of the tick."""
    assert collectives.BUSY_S == (0.0015, 0.0055)
    assert [collectives.busy_seconds(i, 4) for i in range(4)] == pytest.approx([0.002, 0.003, 0.004, 0.005])
    assert collectives.busy_seconds(0, 1, (0.0, 0.004)) == pytest.approx(0.002)


def test_sweep_gemm_shapes_are_the_tiny_models_layers():
    shapes = compute.sweep_gemm_shapes(["tiny_s"], micro_batch=4)  # h 64, 4 heads, seq 64, vocab 1000 -> 1024
    assert (1, 256, 192, 64) in shapes   # QKV forward: 256 tokens x 64 @ 64 x 192
    assert (1, 192, 64, 256) in shapes   # its weight gradient
    assert (1, 256, 1024, 64) in shapes  # logits
    assert (16, 64, 64, 16) in shapes    # scores: 4 x 4 heads of 64 x 16 @ 16 x 64
    assert (16, 64, 16, 64) in shapes    # context


def test_worlds_measured_only_where_the_cores_run_them(monkeypatch):
    for cores, worlds in ((1, []), (2, [2]), (3, [2]), (8, [2, 4])):
        monkeypatch.setattr(calibration_profile.os, "cpu_count", lambda c=cores: c)
        assert calibration_profile.runnable_worlds() == worlds


def _record(prefix: str, host: str = "testhost") -> dict:
    """The committed reference record of a point, by its readable axes (its id's hash follows the config)."""
    (path,) = REFERENCE.glob(f"{prefix}-*.json")
    r = json.loads(path.read_text())
    r["hardware"] = {**r["hardware"], "host": host}
    return r


def test_prediction_check_table_from_fixture_records_and_profile(monkeypatch):
    g1, g2, g4 = (_record(f"tiny_s-s2-g{g}-tp1-mb4") for g in (1, 2, 4))
    other_host = _record("tiny_m-s2-g1-tp1-mb4", host="elsewhere")
    simulated = {**copy.deepcopy(g1), "measured_by": "simulated"}
    g1["step_time_s"], g2["step_time_s"] = 0.02, 0.04
    predicted = {1: 0.03, 2: 0.02}  # per world: ratios 1.5 and 0.5
    seen = []

    def fake_predict(inputs, hw, system):
        seen.append((inputs.dp, hw.name, system))
        return SimpleNamespace(step_s=predicted[inputs.dp], terms={"compute_gemm": 1.0, "kernel_floors": 2.0})
    monkeypatch.setattr(pc.st, "predict", fake_predict)
    g1_again, g1_third = {**copy.deepcopy(g1), "step_time_s": 0.03}, {**copy.deepcopy(g1), "step_time_s": 1.0}
    table = pc.prediction_check([g4, g2, other_host, simulated, g1, g1_again, g1_third], PROFILE)
    rows = table.iloc[:-3]
    precision = g1["precision"]
    assert list(rows["point"]) == [f"tiny_s-s2-g1-tp1-mb4-{precision}", f"tiny_s-s2-g2-tp1-mb4-{precision}"]  # g4: 4 ranks > 2 cores
    assert list(rows["runs"]) == [3, 1] and list(rows["measured s"]) == [0.02, 0.04]  # world 1: the fastest of 3 runs
    assert list(rows["ratio"]) == pytest.approx([1.5, 0.5])
    assert list(rows["largest term"]) == ["kernel_floors"] * 2
    assert sorted(seen) == [(1, "calibrated:testhost", "zero_repro"), (2, "calibrated:testhost", "zero_repro")]
    fp16 = {**copy.deepcopy(g1), "precision": "fp16", "step_time_s": 0.01}  # one shape in two precisions: two points
    assert [label for label, _ in sorted(pc.runs_by_point([g1, g1_again, fp16]).items())] == \
        [f"tiny_s-s2-g1-tp1-mb4-{p}" for p in sorted({precision, "fp16"})]
    summary = dict(zip(table["point"].iloc[-3:], table["ratio"].iloc[-3:]))
    assert summary == pytest.approx({"median abs(ratio - 1)": 0.5, "max abs(ratio - 1)": 0.5, "worst factor": 2.0})


def test_prediction_check_says_how_to_make_a_profile_when_none_exists(tmp_path):
    table, line = pc.from_default_profile([], tmp_path / "none.yaml")
    assert table is None and "make calibrate" in line


def test_gpu_check_gemm_row_sets_the_measured_curve_beside_the_profiles(tmp_path):
    from experiments.gpu_check import prediction_rows
    path = tmp_path / "testhost.yaml"
    path.write_text(yaml.safe_dump(PROFILE))
    hw = calibrated.load_calibrated(path)
    name, measured, expected, verdict = prediction_rows.gemm_row({"ok": True, "value": [(64, 2e9), (256, 5e9)]}, hw, "fp32")
    assert measured == "TFLOP/s by size 64: 0.002, 256: 0.005"
    # 64^3: the table's own 1e9. 256^3 = (8, 8, 8) in log2 lies at squared distances 12, 8, 9 from
    # (64, 64, 64), (256, 64, 64), (512, 64, 64): (1e9/12 + 3e9/8 + 4e9/9) / (1/12 + 1/8 + 1/9) = 2.826e9
    assert expected == "calibrated:testhost predicts 64: 0.001, 256: 0.00283" and verdict == "PASS"
    assert prediction_rows.gemm_row({"ok": True, "value": [(64, 2e9)]}, None, "fp32")[2] == "no profile for this device"


def test_the_profile_keeps_the_median_of_its_rounds_and_reports_their_spread():
    from experiments.calibration.profile import median_of_rounds, spread
    from experiments.reports.prediction_check import spread_note
    gemm = lambda rate, s: [{"m": 8, "n": 8, "k": 8, "batch": 1, "seconds": s, "flops_per_s": rate}]  # noqa: E731
    rounds = [{"op_floor": {"forward_s": f, "backward_s": 1e-6}, "stream": b, "gemm": gemm(r, s)}
              for f, b, r, s in ((4e-6, 10e9, 100e9, 3e-3), (5e-6, 8e9, 90e9, 2e-3), (9e-6, 12e9, 120e9, 1e-3))]
    measured, spreads = median_of_rounds(rounds)
    assert measured["op_floor"]["forward_s"] == 5e-6 and measured["stream"] == 10e9
    assert measured["gemm"][0]["flops_per_s"] == 100e9 and measured["gemm"][0]["seconds"] == 2e-3
    assert spread([4e-6, 5e-6, 9e-6]) == pytest.approx(1.0)                 # (9 - 4) / 5
    assert spreads == {"rounds": 3, "op_floor_forward": 1.0, "stream": 0.4, "gemm_median": 0.3, "gemm_max": 0.3}
    note = spread_note({"spread": {**spreads, "framework_step": 0.05}})
    assert note == "; the profile's spread over 3 rounds: GEMM rates 30% (largest 30%), stream 40%, framework step 5%"
    assert spread_note({}) == ""


def test_hidden_fraction_is_what_compute_saves_of_the_collective():
    # compute 10 ms, collective 4 ms: together 10 ms hides all of it, 14 ms none, 12 ms half
    assert collectives.hidden_fraction(0.010, 0.004, 0.010) == pytest.approx(1.0)
    assert collectives.hidden_fraction(0.010, 0.004, 0.014) == pytest.approx(0.0)
    assert collectives.hidden_fraction(0.010, 0.004, 0.012) == pytest.approx(0.5)
    assert collectives.hidden_fraction(0.010, 0.004, 0.016) == 0.0   # slower together than apart: none hidden
    assert collectives.hidden_fraction(0.010, 0.004, 0.009) == 1.0   # faster than compute alone: all


def test_measured_hidden_fraction_exposes_the_part_compute_cannot_hide():
    from dataclasses import replace as dc_replace
    from experiments.analysis import step_time as st
    profile = {**PROFILE, "collective_overlap": {2: {k: {"hidden_fraction": 0.25, "range": [0.2, 0.3]}
                                                     for k in collectives.OVERLAP_KINDS}}}
    hw = calibrated.hardware_from_profile(profile)
    assert hw.collectives.hidden_fraction("all_gather", 2) == 0.25
    assert hw.collectives.hidden_fraction("all_gather", 4) == 1.0      # not measured: the GPU's assumption
    assert calibrated.hardware_from_profile(PROFILE).collectives.hidden_fraction("all_gather", 2) == 1.0
    # two all-gathers of 1 MB at world 2: 1e-4 + 1e6 / 1e9 = 1.1 ms each; a quarter hideable
    assert hw.collectives.time_s("all_gather", 1e6, 2, hw.gpus_per_node) == pytest.approx(1.1e-3)
    hidden, core = st.hideable(hw, (("all_gather", 1e6), ("all_gather", 1e6)), [1.1e-3, 1.1e-3], (2, 2, 1))
    assert hidden == pytest.approx([0.275e-3, 0.275e-3]) and core == pytest.approx(2 * 0.825e-3)
    # stage 3 at world 2 (a tiny_s-like shape): the forward's gathers under the forward, the
    # backward's and the reduce-scatters under the backward, each covering every hideable second,
    # so exposed = what cannot hide + the first two gathers' and the last reduce-scatter's
    # hideable part (step_time.dp_comm)
    x = st.StepInputs(layers=2, hidden=64, heads=4, seq_len=64, vocab=1024, micro_batch=4, tp=1, dp=2, stage=3,
                      psi=169728.0, element_bytes=4, overlap=True)
    phases = st.micro_batch_compute(x, hw, "zero_repro")
    p = st.plan(x, "zero_repro")
    gathers = [hw.collectives.time_s(k, n, 2, 2) for k, n in p.param_calls_per_micro_batch]
    grads = [hw.collectives.time_s(k, n, 2, 2) for k, n in p.grad_calls]
    nf = p.forward_gathers
    forward, backward = phases["forward"].total_s, phases["recompute"].total_s + phases["backward"].total_s
    assert 0.25 * sum(gathers[:nf]) < forward and 0.25 * (sum(gathers[nf:]) + sum(grads)) < backward
    edges = gathers[0] + gathers[1] + grads[-1]
    expected = 0.75 * (sum(gathers) + sum(grads)) + 0.25 * edges
    assert st.dp_comm(x, hw, "zero_repro", phases)["exposed_s"] == pytest.approx(expected * p.grad_reductions)
    # with the fraction 1 (no measurement) the same point hides everything but those three calls
    everything = st.dp_comm(x, calibrated.hardware_from_profile(PROFILE), "zero_repro", phases)["exposed_s"]
    assert everything == pytest.approx(edges * p.grad_reductions)
