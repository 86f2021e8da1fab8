"""The step-time model (experiments/analysis/step_time.py): each term against a hand calculation
on round numbers, the constants against their sources, and the paper-point plumbing."""
from __future__ import annotations

import pytest

from experiments.analysis import step_time as st

# A made-up cluster with round numbers: 100 TFLOPs at 50%, 1000 GB/s HBM, 100 GB/s NVLink per
# direction, 4 GPUs per node sharing 320 Gb/s of InfiniBand (40 GB/s per node, 10 per GPU), 10 GB/s PCIe.
HW = st.Hardware(name="round", gpus_per_node=4, peak_tflops=100, achieved_efficiency=0.5, hbm_gb_per_s=1000,
                 intra_node_gb_per_s=100, inter_node_gbps=320, pcie_gb_per_s=10)


def inputs(**kw) -> st.StepInputs:
    base = dict(layers=10, hidden=1000, seq_len=1000, vocab=16000, micro_batch=2, tp=2, dp=4, stage=2,
                psi=1e9, recompute=True, element_bytes=2)
    return st.StepInputs(**{**base, **kw})


def test_ring_collectives_have_their_n_minus_1_over_n_factors():
    assert st.ring_allreduce_s(1e9, 4, 1e9) == pytest.approx(2 * 3 / 4)
    assert st.ring_reduce_scatter_s(1e9, 4, 1e9) == pytest.approx(3 / 4)
    assert st.ring_allgather_s(1e9, 5, 2e9) == pytest.approx(4 / 5 / 2)
    assert st.ring_allreduce_s(1e9, 1, 1e9) == 0.0


def test_links_nvlink_inside_a_node_node_infiniband_over_concurrent_rings_across():
    assert HW.inter_node_gb_per_s == pytest.approx(40.0)          # 320 Gb/s / 8
    assert HW.inter_node_gb_per_s_per_gpu == pytest.approx(10.0)  # ... / 4 GPUs
    assert st.tp_link(inputs(tp=4, dp=1), HW) == (100e9, "NVLink/NVSwitch")
    # TP 8 = ranks 0-7 on 2 whole nodes: one ring leaves each node, all 40 GB/s of it
    assert st.tp_link(inputs(tp=8, dp=1), HW) == (40e9, "InfiniBand, 1 ring/node")
    assert st.dp_link(inputs(tp=2, dp=2), HW)[1] == "NVLink/NVSwitch"   # 4 GPUs: one node
    # TP 2 x DP 4: node 0 = ranks 0-3 = TP positions 0, 1 of DP ranks 0, 1: two DP rings leave it
    assert st.dp_link(inputs(tp=2, dp=4), HW) == (20e9, "InfiniBand, 2 rings/node")
    assert st.dp_link(inputs(tp=1, dp=8), HW) == (40e9, "InfiniBand, 1 ring/node")
    assert st.dp_link(inputs(tp=8, dp=2), HW) == (10e9, "InfiniBand, 4 rings/node")  # every GPU its own ring
    # NVLink caps a ring alone on a fat node
    fat = st.Hardware(**{**HW.__dict__, "inter_node_gbps": 8000})
    assert st.dp_link(inputs(tp=1, dp=8), fat) == (100e9, "InfiniBand, 1 ring/node")


def test_node_rings_follow_megatrons_layout():
    # TP groups are consecutive ranks (stride 1), DP groups stride by MP; nodes of 16
    assert st.node_rings(16, 1, 400, 16) == 0          # MP 16: each TP group is one node
    assert st.node_rings(128, 1, 384, 16) == 1         # MP 128: 8 whole nodes per TP group
    assert st.node_rings(25, 16, 400, 16) == 16        # MP 16 x DP 25: 16 DP rings per node
    assert st.node_rings(128, 1, 128, 16) == 1         # MP 1 x DP 128: the one DP ring
    assert st.node_rings(100, 4, 400, 16) == 4         # MP 4 x DP 100
    assert st.node_rings(3, 128, 384, 16) == 16        # MP 128 x DP 3: one DP ring per GPU
    assert st.node_rings(8, 2, 16, 16) == 0            # the whole job in one node
    assert st.node_rings(24, 1, 48, 16) == 2           # MP 24: node 1 holds parts of two TP groups
    assert st.node_rings(1, 1, 400, 16) == 0


def test_dgx2_bandwidths_by_hand():
    v100 = st.hardware("dgx2_v100")   # 16 GPUs, 800 Gb/s = 100 GB/s per node, NVSwitch 150 GB/s
    mp1 = inputs(tp=1, dp=128, stage=2, psi=13e9, overlap_grad_reduce=False)
    # MP 1 x DP 128: one DP ring crosses each of 8 node boundaries through all 8 NICs: 100 GB/s
    assert st.dp_link(mp1, v100) == (100e9, "InfiniBand, 1 ring/node")
    # 13B, stage 2: reduce-scatter + all-gather of Ψe = 26 GB, 127/128 of each at 100 GB/s
    assert st.dp_comm(mp1, v100)["exposed_s"] == pytest.approx(2 * 127 / 128 * 26e9 / 100e9)  # 0.516 s
    mp16 = inputs(tp=16, dp=25, stage=2, psi=100e9 / 16, overlap_grad_reduce=False)
    # MP 16 x DP 25: 16 DP rings leave each node (one per TP position): 100 / 16 = 6.25 GB/s each
    assert st.tp_link(mp16, v100) == (150e9, "NVLink/NVSwitch")
    assert st.dp_link(mp16, v100) == (6.25e9, "InfiniBand, 16 rings/node")
    assert st.dp_comm(mp16, v100)["exposed_s"] == pytest.approx(2 * 24 / 25 * 12.5e9 / 6.25e9)  # 3.84 s
    # MP 128 (Megatron baseline, 8 nodes per TP group): one TP ring per node, 100 GB/s
    base = inputs(tp=128, dp=3, layers=1, hidden=8192, seq_len=1024, micro_batch=2)
    assert st.tp_link(base, v100) == (100e9, "InfiniBand, 1 ring/node")
    msg = 1024 * 2 * 8192 * 2                          # s·b·h·2 = 33.5 MB
    assert st.tp_comm_s(base, v100) == pytest.approx(6 * 2 * 127 / 128 * msg / 100e9)   # 4.0 ms per layer
    # its DP groups (stride 128): each of a node's 16 GPUs in its own DP ring: 6.25 GB/s
    assert st.dp_link(base, v100) == (6.25e9, "InfiniBand, 16 rings/node")


def test_compute_is_model_flops_per_gpu_over_peak_times_efficiency():
    x = inputs()
    # Eq. 3, c = 4: 24·4·b·s·l·h²·(1 + s/6h + V/16lh) = 96·2·1000·10·1e6·(1 + 1/6 + 0.1), over TP 2
    flops = 96 * 2 * 1000 * 10 * 1e6 * (1 + 1 / 6 + 16000 / (16 * 10 * 1000)) / 2
    assert st.flops_per_gpu(x) == pytest.approx(flops)
    assert st.compute_s(x, HW) == pytest.approx(flops / 50e12)
    assert st.backward_s(x, HW) == pytest.approx(flops / 50e12 * 3 / 4)
    assert st.backward_s(inputs(recompute=False), HW) == pytest.approx(st.compute_s(inputs(recompute=False), HW) * 2 / 3)


def test_tp_comm_is_six_ring_allreduces_of_sbh_per_layer():
    x = inputs(tp=2, dp=4)
    msg = 1000 * 2 * 1000 * 2                      # s·b·h·2 bytes = 4 MB
    one = 2 * (2 - 1) / 2 * msg / 100e9           # ring all-reduce over 2 ranks at 100 GB/s
    assert st.tp_comm_s(x, HW) == pytest.approx(10 * 6 * one)
    assert st.tp_comm_s(inputs(recompute=False), HW) == pytest.approx(10 * 4 * one)
    wide = inputs(tp=8, dp=1)                      # across 2 nodes, one ring each: the node's 40 GB/s
    assert st.tp_comm_s(wide, HW) == pytest.approx(10 * 6 * 2 * 7 / 8 * msg / 40e9)
    assert st.tp_comm_s(inputs(tp=1), HW) == 0.0
    assert st.tp_comm_s(inputs(grad_accum=3), HW) == pytest.approx(3 * 10 * 6 * one)


def test_dp_traffic_per_stage_is_2psi_or_3psi():
    e, psi = 2, 1e9
    assert st.dp_traffic_bytes(inputs(stage=0)) == (2 * psi * e, 0.0)
    assert st.dp_traffic_bytes(inputs(stage=1)) == (psi * e, psi * e)
    assert st.dp_traffic_bytes(inputs(stage=2)) == (psi * e, psi * e)
    assert st.dp_traffic_bytes(inputs(stage=3)) == (psi * e, 2 * psi * e)
    assert st.dp_traffic_bytes(inputs(stage=2, grad_accum=4)) == (4 * psi * e, psi * e)  # (g + 1)Ψ
    assert st.dp_traffic_bytes(inputs(dp=1)) == (0.0, 0.0)
    assert st.dp_traffic_bytes(inputs(dp_grad_bytes=5.0, dp_param_bytes=7.0)) == (5.0, 7.0)  # engine counts win


def test_dp_overlap_rule():
    # TP 2 x DP 4 over 2 nodes: 2 DP rings per node, 20 GB/s each; Ψe = 2 GB; (N-1)/N = 3/4
    # -> 0.075 s per 2 GB collective
    x = inputs(stage=2, overlap_grad_reduce=False)
    out = st.dp_comm(x, HW)
    assert out["grad_s"] == pytest.approx(3 / 4 * 2e9 / 20e9)
    assert out["param_s"] == pytest.approx(3 / 4 * 2e9 / 20e9)
    assert out["exposed_s"] == pytest.approx(out["grad_s"] + out["param_s"])   # nothing hidden
    hidden = st.dp_comm(inputs(stage=2, overlap_grad_reduce=True), HW)
    backward = st.backward_s(x, HW)
    assert hidden["exposed_s"] == pytest.approx(max(0.0, out["grad_s"] - backward) + out["param_s"])
    # a tiny backward leaves most of the reduction exposed
    tiny = inputs(stage=0, micro_batch=1, layers=1, hidden=100, overlap_grad_reduce=True)
    t = st.dp_comm(tiny, HW)
    assert t["exposed_s"] == pytest.approx(t["grad_s"] - st.backward_s(tiny, HW))
    assert t["grad_s"] == pytest.approx(2 * 3 / 4 * 2e9 / 20e9)                # all-reduce of 2 GB
    # stage 3: gathers prefetched under the whole compute
    s3 = inputs(stage=3, overlap_grad_reduce=True)
    r = st.dp_comm(s3, HW)
    assert r["exposed_s"] == pytest.approx(max(0.0, r["grad_s"] + r["param_s"] - st.compute_s(s3, HW)))


def test_pa_allgather_and_pa_cpu_offload():
    msg = 1000 * 2 * 1000 * 2
    x = inputs(tp=2, pa=True)
    assert st.pa_allgather_s(x, HW) == pytest.approx(10 * (1 / 2) * msg / 100e9)  # L ring all-gathers
    assert st.pa_allgather_s(inputs(tp=2), HW) == 0.0
    assert st.pa_allgather_s(inputs(tp=1, pa=True), HW) == 0.0
    y = inputs(tp=2, pa=True, pa_cpu=True)
    assert st.offload_s(y, HW) == pytest.approx(10 * 2 * (msg / 2) / 10e9)       # out and back, 1/t each
    assert st.offload_s(x, HW) == 0.0


def test_optimizer_is_hbm_bound_adam():
    assert st.adam_bytes_per_param(2) == 28 and st.adam_bytes_per_param(4) == 28
    assert st.optimizer_s(inputs(stage=2), HW) == pytest.approx(1e9 / 4 * 28 / 1000e9)
    assert st.optimizer_s(inputs(stage=0), HW) == pytest.approx(1e9 * 28 / 1000e9)


def test_predict_sums_the_terms_and_gives_tflops():
    x = inputs(pa=True, pa_cpu=True)
    p = st.predict(x, HW)
    total = (st.compute_s(x, HW) + st.tp_comm_s(x, HW) + st.dp_comm(x, HW)["exposed_s"] + st.pa_allgather_s(x, HW)
             + st.offload_s(x, HW) + st.optimizer_s(x, HW))
    assert p.step_s == pytest.approx(total)
    assert p.tflops_per_gpu == pytest.approx(st.flops_per_gpu(x) / total / 1e12)
    assert p.tflops_per_gpu < 50  # never above peak x efficiency
    d = p.as_dict()
    assert d["tflops_per_gpu_predicted"] == pytest.approx(p.tflops_per_gpu) and d["step_s"] == pytest.approx(total)


def test_cluster_constants_are_the_sourced_ones():
    v100, h100 = st.hardware("dgx2_v100"), st.hardware("dgx_h100")
    assert (v100.peak_tflops, v100.hbm_gb_per_s, v100.intra_node_gb_per_s, v100.inter_node_gbps,
            v100.gpus_per_node, v100.pcie_gb_per_s) == (125, 900, 150, 800, 16, 12)
    assert v100.achieved_efficiency == pytest.approx(39 / 125, abs=1e-3)   # Megatron-LM's one-V100 39 TFLOPs
    assert v100.inter_node_gb_per_s_per_gpu == pytest.approx(6.25)
    assert (h100.peak_tflops, h100.hbm_gb_per_s, h100.intra_node_gb_per_s, h100.inter_node_gbps,
            h100.gpus_per_node) == (989, 3350, 450, 3200, 8)
    assert st.hardware("local") is None
    for name in ("dgx2_v100", "dgx_h100"):
        for key in st.Hardware.FIELDS:
            if key != "gpus_per_node":
                assert f"{name}.{key}" in st.SOURCES, f"{name}.{key} has no source"


def test_record_inputs_take_the_engine_counts():
    record = {"config": {"model": {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 32, "vocab_size": 1000},
                         "train": {"recompute": True, "grad_accum_steps": 1}, "zero": {"overlap_comm": True},
                         "cluster": {"name": "dgx2_v100"}},
              "tp": 1, "dp": 2, "stage": 2, "micro_batch": 4, "precision": "bf16", "params_per_gpu": 12345,
              "comm": {"by_purpose": {"grads": {"bytes": 111}, "params": {"bytes": 222}, "norm": {"bytes": 16}}}}
    x = st.inputs_from_record(record)
    assert (x.psi, x.dp_grad_bytes, x.dp_param_bytes, x.overlap_grad_reduce) == (12345, 111, 222, True)
    assert st.predict_record(record).hardware == "dgx2_v100"
    assert (x.pa, x.pa_cpu) == (False, False)
    record["config"]["zero"].update(partition_activations=True, cpu_checkpointing=True)
    assert (st.inputs_from_record(record).pa, st.inputs_from_record(record).pa_cpu) == (True, True)
    record["config"]["cluster"] = {"name": "local"}
    assert st.predict_record(record) is None


# -- the paper's points, predicted, beside the paper ------------------------------------------
def test_no_paper_throughput_enters_the_model():
    source = (st.CONF_CLUSTER.parents[1] / "experiments" / "analysis" / "step_time.py").read_text()
    assert "results/paper" not in source and "APPROX" not in source


def test_throughput_table_covers_every_paper_point_with_paper_predicted_and_ratio():
    from experiments.reports import predictions
    rows = predictions.predicted_rows()
    counts = {f: sum(r["figure"] == f for r in rows) for f in predictions.FIGURES}
    assert counts == {"fig2": 18, "fig3": 4, "fig4": 11, "fig8": 6}
    z100 = next(r for r in rows if r["figure"] == "fig2" and r["series"] == "ZeRO" and r["model"] == "100B")
    assert (z100["paper_text"], z100["ds_figure_APPROX"], z100["zero_r"]) == (">38", 38.6, "C4")
    assert z100["pred_over_text"] == pytest.approx(z100["predicted"] / 38.0)
    assert z100["pred_over_ds_figure"] == pytest.approx(z100["predicted"] / 38.6)
    assert z100["tp_link"] == "NVLink/NVSwitch" and z100["dp_link"] == "InfiniBand, 16 rings/node"
    b100 = next(r for r in rows if r["figure"] == "fig2" and r["series"] == "Baseline" and r["model"] == "100B")
    assert z100["speedup_predicted"] == pytest.approx(z100["predicted"] / b100["predicted"])
    assert z100["speedup_ds_figure_APPROX"] == 10.1
    # the baseline's MP 128 ring spans 8 whole nodes: one ring per node, its TP all-reduces the largest term
    assert b100["tp_link"] == "InfiniBand, 1 ring/node"
    assert b100["tp_comm_s"] > max(b100["compute_s"], b100["dp_comm_s"])
    # the breakdown adds up to the step
    for r in rows:
        parts = r["compute_s"] + r["tp_comm_s"] + r["dp_comm_s"] + r["pa_s"] + r["offload_s"] + r["optimizer_s"]
        assert parts == pytest.approx(r["step_s"])
        assert 0 < r["predicted"] < 125 * 0.312 + 1e-9 and r["predicted_h100"] > 0
    c4, c5 = (next(r for r in rows if r["figure"] == "fig8" and r["zero_r"] == c and r["gpus"] == 128) for c in ("C4", "C5"))
    assert c5["offload_s"] > 0 == c4["offload_s"] and c5["predicted"] < c4["predicted"]
    table = predictions.throughput_predicted()
    assert {"paper text (TFLOPs/GPU)", "DeepSpeed figure, APPROX", "predicted", "pred/text", "pred/figure",
            "same recipe on DGX H100"} <= set(table.columns)


def test_measured_records_of_a_paper_point_land_beside_its_prediction():
    from experiments.reports import predictions
    point = next(p for p in predictions.paper_points("fig4") if p.model["name"] == "fig4_13b")
    record = {"experiment": "fig4", "status": "ok", "tflops_per_gpu": 20.5, "stage": 2, "world_size": 128, "tp": 1,
              "micro_batch": 2, "config": {"model": point.model, "note": "ZeRO"}}
    rows = predictions.predicted_rows([record])
    row = next(r for r in rows if r["figure"] == "fig4" and r["model"] == "13B")
    assert row["measured"] == 20.5
    assert all(r["measured"] is None for r in rows if r is not row)


def test_claims_table_has_every_text_claim_marked():
    import csv
    from experiments.reports import predictions
    with open(predictions.PAPER_DIR / "text_claims.csv") as f:
        ids = [r["id"] for r in csv.DictReader(f)]
    claims = predictions.paper_claims()
    assert list(claims["id"]) == ids
    assert set(claims["kind"]) <= {"formula", "measured (CPU)", "simulated", "predicted", "config", "not checked"}
    by_id = claims.set_index("id")
    assert by_id.loc["S5-1", "ours"] == "31.4 GB" and by_id.loc["S1-8", "kind"] == "predicted"
    assert (claims["kind"] == "not checked").sum() < len(claims) / 4
