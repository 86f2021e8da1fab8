"""The mechanisms the A100 development set needs, each worked by hand (the host model's windows,
NCCL 2.14.3's tuner on an A100 node, the GEMM pipeline's short-k loss, Megatron's softmax
fallback), the host costs equal to their measurement, the host ops a layer dispatches (the per-op
check), and the validation's verdicts."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from experiments.analysis import kernels as kn
from experiments.analysis import step_time as st
from experiments.analysis import systems
from experiments.analysis.gemm import TILES_SM80, TileWaveGemm
from experiments.analysis.hardware import profile
from experiments.reports import host_ops, validation


def test_a_window_runs_each_launch_when_both_host_and_gpu_are_ready():
    # device-bound: the 5 s kernel issued at 1 s ends at 6; the next two queue behind it: 7, 8
    assert st.window_s([(1.0, 5.0), (1.0, 1.0), (1.0, 1.0)]) == (8.0, 3.0, 7.0)
    # host-bound: each kernel starts when issued (5, 10), the window ends with the last: 11
    assert st.window_s([(5.0, 1.0), (5.0, 1.0)]) == (11.0, 10.0, 2.0)
    assert st.window_s([]) == (0.0, 0.0, 0.0)


class Launch:
    """A kernel of known device seconds, for windows worked by hand."""

    count, all_reduce_bytes = 1, 0.0

    def __init__(self, seconds: float, name: str = "") -> None:
        self.seconds, self.name = seconds, name

    def times(self, hw, fraction=1.0) -> tuple[float, float]:
        return self.seconds, 0.0


def test_each_sync_structure_worked_by_hand(monkeypatch):
    # a layer's forward of three 1 ms kernels, the attention dropout in the middle, its backward
    # one 5 ms kernel, a head of 2 ms forward and 0.5 ms backward; every kernel issued at 2 ms of
    # host time; two layers (a window's kernel issued at t runs from max(t, the previous one's end))
    monkeypatch.setitem(st.LAYERS, "by_hand", (
        lambda s: [Launch(1e-3), Launch(1e-3, kn.ATTENTION_DROPOUT), Launch(1e-3)], lambda s: [Launch(5e-3)],
        lambda s: [Launch(2e-3)], lambda s: [Launch(0.5e-3)]))
    x = st.StepInputs(layers=2, hidden=1024, heads=16, seq_len=1024, vocab=50304, micro_batch=1, tp=1, dp=1,
                      stage=0, psi=1e8)
    hw = profile("dgx2_v100")

    def run(syncs: str, inputs=x, system="megatron2019") -> dict:
        sys = replace(systems.SYSTEMS[system], layer="by_hand", host_s_per_kernel=2e-3, host_syncs=syncs)
        return st.host_windows(inputs, hw, sys)
    by = {syncs: run(syncs) for syncs in systems.HOST_SYNCS}
    # forward_backward: the forward, issued at 2, 4, ... 14 ms, ends with the head at 16 ms; the
    # backward, head first (2-2.5), then each layer's recompute and backward (4-5, 6-7, 8-9,
    # 10-15; 15-16, 16-17, 17-18, 18-23): 23 ms (issued head last it would end at 21.5)
    assert by["forward_backward"]["wall_s"] == pytest.approx(16e-3 + 23e-3)
    # layer: a layer's forward 7 ms (2-3, 4-5, 6-7), recompute and backward 13 (then 8-13), the head's 4 and 2.5
    assert by["layer"]["wall_s"] == pytest.approx(2 * 7e-3 + 2 * 13e-3 + 4e-3 + 2.5e-3)
    # rng_state: the forward cut at the dropout, three windows of 3 ms, the recomputed forward the
    # same, the backward alone (2-7), and 12 copies of the 824,000 B RNG state a layer at 12 GB/s
    copies = 2 * 12 * 200 * 4120 / 12e9
    assert by["rng_state"]["rng_copies_s"] == pytest.approx(copies)
    assert by["rng_state"]["wall_s"] == pytest.approx(2 * 9e-3 + 2 * 9e-3 + 2 * 7e-3 + 4e-3 + 2.5e-3 + copies)
    assert {k: v["host_s"] for k, v in by.items()} == pytest.approx({k: 16 * 2e-3 for k in by})  # 16 launches
    assert {k: v["device_s"] for k, v in by.items()} == pytest.approx({k: 2 * 3e-3 + 2 * 8e-3 + 2.5e-3 for k in by})
    # without recomputation the backward has no sync (2-7, 7-12), and the dropout's four copies remain
    plain = {syncs: run(syncs, replace(x, recompute=False)) for syncs in systems.HOST_SYNCS}
    assert plain["rng_state"]["rng_copies_s"] == pytest.approx(2 * 4 * 200 * 4120 / 12e9)
    assert plain["rng_state"]["wall_s"] - plain["rng_state"]["rng_copies_s"] == pytest.approx(2 * 9e-3 + 12e-3 + 6.5e-3)
    assert plain["layer"]["wall_s"] == pytest.approx(2 * 7e-3 + 12e-3 + 6.5e-3)
    assert plain["forward_backward"]["wall_s"] == pytest.approx(16e-3 + 14e-3)  # 2-2.5, 4-9, 9-14
    # with Pa+cpu DeepSpeed copies every layer's checkpoint to the host: a window per layer
    assert run("forward_backward", replace(x, pa_cpu=True), "deepspeed2020")["wall_s"] == pytest.approx(by["layer"]["wall_s"])
    with pytest.raises(ValueError, match="host_syncs"):
        replace(systems.SYSTEMS["deepspeed2020"], host_syncs=None)


def test_the_papers_stacks_host_model():
    paper = {name: systems.SYSTEMS[name] for name in ("megatron2019", "pytorch_ddp", "deepspeed2020")}
    assert {n: (s.host_s_per_kernel, s.host_s_per_collective, s.step_kernels_at_host_cost) for n, s in paper.items()} \
        == {n: (systems.MEGATRON_DS2023_HOST_S_PER_KERNEL, 0.0, False) for n in paper}
    # torch 1.1's RNG state syncs every Megatron layer; DeepSpeed's torch 1.2.0 copies nothing
    assert {n: s.host_syncs for n, s in paper.items()} == {
        "megatron2019": "rng_state", "pytorch_ddp": "rng_state", "deepspeed2020": "forward_backward"}
    # their step's kernels stay at the profile's floor; megatron_ds2023's at its host cost
    hw = profile("dgx2_v100")
    assert all(st.system_hardware(hw, n).kernel_floor_s == hw.kernel_floor_s == pytest.approx(5e-6) for n in paper)
    assert st.system_hardware(hw, "megatron_ds2023").kernel_floor_s == systems.MEGATRON_DS2023_HOST_S_PER_KERNEL
    assert all(s.host_syncs in systems.HOST_SYNCS for s in systems.SYSTEMS.values() if s.host_s_per_kernel is not None)


def test_nccl_2_14_on_an_a100_node_worked_by_hand():
    nccl = replace(profile("dgx_a100").collectives, version="2.14.3")
    assert (nccl.nvlink_links, nccl.nvlink_gb_per_s, nccl.compute_capability) == (12, 22, 80)
    mib = 2 ** 20
    # 1 MiB over 8 GPUs, ring LL: 3.6 + 14 x 0.47 us; busBw min(llMaxBw 87.7, 235 (the Ampere cap) / 4), x 8/14
    ll = 3.6 + 14 * 0.47 + mib / (1000 * min(87.7, 235 / 4) * 8 / 14)
    # tree LL128 on one node: 4.4 + 2·7 x 1.25 us; min(235 x .92, 12 x 24) x 7/9, x 0.5, x the correction .6
    tree = 4.4 + 2 * 7 * 1.25 + mib / (1000 * 235 * .92 * 7 / 9 * .5 * .6)
    options = nccl.candidates("all_reduce", mib, 8, 8)
    assert options[("ring", "LL")] == pytest.approx(ll) and options[("tree", "LL128")] == pytest.approx(tree)
    assert nccl.choice("all_reduce", mib, 8, 8)[:2] == ("ring", "LL") and ll == pytest.approx(41.4, abs=0.1)
    # 4 MiB: ring LL128, 10 + 14 x 1.9 us at min(235 x .92, 20 x 12 channels) x 8/14
    assert nccl.time_s("all_reduce", 4 * mib, 8, 8) == pytest.approx((36.6 + 4 * mib / (1000 * 235 * .92 * 8 / 14)) * 1e-6)
    # 1 GiB: Simple at the 235 GB/s cap, 8.4 + 14 x 3.4 us
    assert nccl.time_s("all_reduce", 2 ** 30, 8, 8) == pytest.approx((56.0 + 2 ** 30 / (1000 * 235 * 8 / 14)) * 1e-6)
    # 2.7.8 never puts a tree on one node; 2.14.3 prices it
    assert ("tree", "LL128") not in replace(nccl, version="2.7.8").candidates("all_reduce", mib, 8, 8)


def test_gemm_pipeline_fill_and_drain_on_ampere():
    gemm = TileWaveGemm(sms=108, ceiling=1.0, tiles=TILES_SM80, k_tile=64, stages=3)
    assert gemm.pipeline_efficiency(64) == pytest.approx(1 / 3)      # attention's scores at head size 64
    assert gemm.pipeline_efficiency(128) == pytest.approx(1 / 2)     # TP 8's projection at h 1024
    assert gemm.pipeline_efficiency(4096) == pytest.approx(64 / 66)
    # 1024 x 10240 x 5120 (MAMF's best A100 shape): 256 x 128 tiles, 4 x 80 = 320 on 108 SMs: 320/324, x 80/82
    assert gemm.efficiency(1024, 10240, 5120) == pytest.approx(320 / 324 * 80 / 82)
    assert profile("dgx_a100").gemm.ceiling == pytest.approx(271.2 / 312 / (320 / 324 * 80 / 82), abs=5e-4)
    assert TileWaveGemm(sms=80, ceiling=1.0).pipeline_efficiency(64) == 1.0   # the V100 profiles: no such loss


def test_megatrons_softmax_falls_back_to_torch_when_b_times_heads_per_rank_is_not_a_multiple_of_4():
    shape = lambda b, tp: kn.LayerShape(b, 1024, 1024, 16, tp, 50304, 2)   # noqa: E731
    assert kn.fused_softmax_runs(shape(1, 4)) and kn.fused_softmax_runs(shape(2, 8))
    assert not kn.fused_softmax_runs(shape(1, 8))                  # 1 x 16/8 = 2 attention batches
    count = lambda ks: sum(k.count for k in ks)                    # noqa: E731
    for layer in (kn.layer_forward_fused, kn.layer_backward_fused):
        assert count(layer(shape(1, 8))) - count(layer(shape(1, 4))) == 4   # 5 torch kernels for apex's one
    fallback = {k.name: k for k in kn.layer_forward_fused(shape(1, 8))}
    S = 16 // 8 * 1024 ** 2
    assert fallback["softmax fallback: up-cast to fp32"].bytes == S * 6       # fp16 in, fp32 out


def test_the_layer_issues_what_megatron_deepspeed_2023_launches():
    x = kn.LayerShape(1, 1024, 1024, 16, 2, 50304, 2)
    fwd, bwd = kn.layer_forward_fused(x), kn.layer_backward_fused(x)
    assert sum(k.count for k in fwd) == 16 and sum(k.count for k in bwd) == 45
    assert [k.name for k in fwd + bwd if k.all_reduce_bytes] == [
        "TP all-reduce: projection output", "TP all-reduce: MLP output", "TP all-reduce: MLP input grad",
        "TP all-reduce: QKV input grad"]
    assert all(k.all_reduce_bytes == 1024 * 1024 * 2 for k in fwd + bwd if k.all_reduce_bytes)
    assert not any(k.all_reduce_bytes for k in kn.layer_forward_fused(replace(x, tp=1)))


def test_the_host_bound_step_is_its_host_time():
    # TP 1, micro-batch 1, hidden 1024, 12 layers: the host issues 77 kernels a layer while the
    # GPU waits; kernel_floors is the wait, so the micro-batch is about the host's time
    x = st.StepInputs(layers=12, hidden=1024, heads=16, seq_len=1024, vocab=50304, micro_batch=1, tp=1, dp=1,
                      stage=0, psi=1.9e8)
    hw = st.system_hardware(profile("dgx_a100"), "megatron_ds2023")
    win = st.host_windows(x, hw, systems.SYSTEMS["megatron_ds2023"])
    per_layer = 77 * systems.MEGATRON_DS2023_HOST_S_PER_KERNEL
    assert win["host_s"] == pytest.approx(12 * per_layer + (43 + 27) * systems.MEGATRON_DS2023_HOST_S_PER_KERNEL)
    assert win["device_s"] < 0.5 * win["host_s"] and win["wall_s"] >= win["host_s"]
    p = st.predict(x, profile("dgx_a100"), "megatron_ds2023")
    assert p.terms["kernel_floors"] == pytest.approx(win["exposed_s"])
    assert p.terms["compute_gemm"] + p.terms["compute_memory_bound"] + p.terms["kernel_floors"] == pytest.approx(win["wall_s"])
    # the paper's systems keep NCCL 2.7.8 and their step's kernels at the floor on the same profile
    assert st.system_hardware(profile("dgx_a100"), "megatron2019").collectives.version == "2.7.8"
    assert st.system_hardware(profile("dgx_a100"), "megatron2019").kernel_floor_s == pytest.approx(5e-6)


def test_the_host_costs_are_their_independent_measurements_not_the_development_sets():
    from experiments.reports import dev_set
    independent = {c.field: c for c in dev_set.measured_constants().values()}
    assert systems.MEGATRON_DS2023_HOST_S_PER_KERNEL == pytest.approx(independent["host_s_per_kernel"].us * 1e-6)
    assert systems.MEGATRON_DS2023_HOST_S_PER_COLLECTIVE == pytest.approx(
        independent["host_s_per_collective"].us * 1e-6)
    derived = validation.host_constants()   # the single-node file's slopes: a check, not the constants
    assert derived["kernels_per_layer"] == 77
    assert systems.MEGATRON_DS2023_HOST_S_PER_KERNEL != pytest.approx(derived["host_us_per_kernel"] * 1e-6, rel=1e-3)


def test_the_layers_host_ops_are_what_the_dispatch_mode_counts():
    # megatron-core 0.16.1's GPT layer on the CPU, TP 1, recomputation, dropout: one layer, one micro-batch
    counted = host_ops.count_layer_ops(detail=True)
    assert {p: {k: c[k] for k in host_ops.KINDS} for p, c in counted.items()} == host_ops.LAYER_HOST_OPS
    fwd, rec, bwd = (counted[p]["ops"] for p in host_ops.PHASES)
    # the forward's GEMMs: QKV, projection, MLP up and down (mm), scores (baddbmm), context (bmm)
    assert (fwd["mm.default"], fwd["baddbmm.default"], fwd["bmm.default"]) == (4, 1, 1)
    assert rec["mm.default"] == 4 and rec["bernoulli_.float"] == 3   # recomputed: its 3 dropouts redrawn too
    # backward: two GEMMs per forward GEMM (8 mm, 4 bmm), a gradient added per parameter (12)
    assert (bwd["mm.default"], bwd["bmm.default"], bwd["add_.Tensor"]) == (8, 4, 12)
    assert host_ops.layer_host_ops() == 66 + 67 + 95 == 228


def test_the_per_op_host_cost_by_hand():
    c = validation.host_constants()
    # 3.073 ms a layer a micro-batch over 228 host ops: 13.48 us; over the model's 77 kernels: 39.9 us
    assert c["layer_slope_ms_tp1"] == pytest.approx(3.073, abs=5e-4) and c["host_ops_per_layer"] == 228
    assert c["host_us_per_op"] == round(3.0728445937 / 228 * 1e3, 1) == 13.5
    assert c["host_us_per_kernel"] == round(3.0728445937 / 77 * 1e3, 1) == 39.9
    # against PyTorch's 3.8-7 us: 13.5 / 7 = 1.93, 13.5 / 3.8 = 3.55 per op
    check = validation.host_constants_table().set_index("constant").loc["host seconds per kernel (us)", "check"]
    assert "per op 13.5 us over the 228 the layer dispatches, 1.9-3.6x" in check


def test_the_host_time_check_by_hand(tmp_path, monkeypatch):
    # the committed timing, read back as the check reads it
    committed = host_ops.read_layer_host_time()
    assert committed["layer_ms"] > 0 and committed["lowest_ms"] <= committed["layer_ms"] <= committed["highest_ms"]
    # a proxy of 2.0 ms: 3.0728 / 2.0 = 1.54, outside 1.5x; of 2.5 ms: 1.23, within; of 4.7 ms:
    # 0.654, under 1 / 1.5 = 0.667, outside
    for proxy_ms, ratio, verdict in ((2.0, 1.536, "fails"), (2.5, 1.229, "passes"), (4.7, 0.654, "fails")):
        path = tmp_path / f"{proxy_ms}.csv"
        host_ops.write_layer_host_time({**committed, "layer_ms": proxy_ms}, path)
        monkeypatch.setattr(validation, "read_layer_host_time", lambda p=path: host_ops.read_layer_host_time(p))
        timed = validation.host_time_check()
        assert timed["ratio"] == pytest.approx(ratio, abs=1e-3) and timed["passes"] == (verdict == "passes")
        check = validation.host_constants_table().set_index("constant").loc["host seconds per kernel (us)", "check"]
        assert f"{proxy_ms:.3f} ms of host time a micro-batch" in check
        assert f"the derived layer time is {ratio:.2f}x that: {verdict} as a layer's host time (within 1.5x)" in check


def test_the_committed_host_timing_is_of_this_stack():
    # the check reads a committed timing: it must be of the megatron-core and torch this suite pins
    from importlib import metadata
    committed = host_ops.read_layer_host_time()
    assert committed["megatron_core"] == metadata.version("megatron-core")
    assert committed["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert committed["threads"] == 1 and committed["rounds"] >= 5


def test_the_layer_host_timing_runs_and_splits_by_phase():
    # one short round: the numbers depend on the CPU, so only their relations are asserted (the
    # recomputed forward and backward hold about twice the forward's ops: a wide margin)
    t = host_ops.time_layer_host(rounds=1, steps=10)
    assert t["forward_ms"] > 0 and t["recompute_backward_ms"] > 0
    # the backward phase holds the recomputed forward and the backward: more than the forward alone
    assert t["recompute_backward_ms"] > t["forward_ms"]
    assert t["layer_ms"] == pytest.approx(t["forward_ms"] + t["recompute_backward_ms"])
    assert t["rounds"] == 1 and t["megatron_core"] == "0.16.1"


def test_the_development_set_is_the_copied_file():
    rows = validation.dev_rows()
    assert len(rows) == 1440 and sum(validation.in_scope(r) for r in rows) == 720
    assert rows[0] == {"gpus": 2, "global_batch": 16, "micro_batch": 8, "hidden": 1024, "heads": 16, "layers": 24,
                       "seq_len": 1024, "tp": 1, "dp": 1, "pp": 2, "ms": 372.160408}


def test_the_model_meets_the_development_sets_targets():
    summary = validation.validation_summary().set_index("group")
    for group in ("all", "all but the host costs' rows"):   # the second: rows the host costs were not measured on
        overall = summary.loc[[group]].iloc[0]
        assert overall.median_error <= 0.10 and overall.p90_error <= 0.25 and overall.worst_factor < 2, group
    # TP 8 reads 0.83 (1-4: 0.99-1.00), fast where its steps wait on the host (its layer slopes,
    # validation_layer_slopes.md); the scorecard reports the miss against the issue's 0.9-1.1
    # (validation_single_node.md)
    assert summary.loc["TP"].median_ratio.between(0.80, 1.15).all()
    # TP ranking: 'the smallest TP' (no model) is right in every family of this set, so the
    # fastest-TP score cannot tell a model from that rule; the step-time ratios between TP degrees can
    ranking = summary.loc[["fastest TP right"]]
    baseline, model = ranking.iloc[0], ranking.iloc[1]
    assert baseline.value.startswith("the smallest TP (no model): 216 of 216") and model.fraction >= baseline.fraction
    pairs = summary.loc[["TP pair ratio"]].set_index("value")
    ours, engine = pairs.iloc[0], pairs.iloc[1]   # megatron_ds2023, zero_repro
    assert ours.median_error <= 0.10 and ours.p90_error <= 0.30
    assert ours.p90_error < engine.p90_error       # the development set's stack orders its TP degrees better


def test_the_ranking_check_scores_a_model_against_the_smallest_tp_rule_by_hand():
    import pandas as pd
    key = {"gpus": 8, "global_batch": 16, "micro_batch": 1, "hidden": 1024, "heads": 16, "layers": 24, "seq_len": 1024}
    # one family where TP 2 is measured fastest; the model ranks TP 1 first: wrong, as the rule is
    table = pd.DataFrame([{**key, "tp": 1, "measured_ms": 100.0, "predicted_ms": 90.0},
                          {**key, "tp": 2, "measured_ms": 80.0, "predicted_ms": 99.0},
                          {**key, "tp": 4, "measured_ms": 120.0, "predicted_ms": 120.0},
                          {**key, "heads": 32, "tp": 1, "measured_ms": 50.0, "predicted_ms": 50.0}])   # alone: no family
    r = validation.tp_ranking(table)
    assert (r["families"], r["fastest_tp_right"], r["smallest_tp_right"], r["larger_tp_fastest"]) == (1, 0, 0, 1)
    # pairs (1, 2), (1, 4), (2, 4): |(99/90) / (80/100) - 1|, |(120/90) / 1.2 - 1|, |(120/99) / 1.5 - 1|
    errors = sorted([abs(99 / 90 / 0.8 - 1), abs(120 / 90 / 1.2 - 1), abs(120 / 99 / 1.5 - 1)])
    assert r["pairs"] == 3 and r["pair_median_error"] == pytest.approx(errors[1])
    assert r["pair_p90_error"] == pytest.approx(errors[1] + 0.8 * (errors[2] - errors[1]))
