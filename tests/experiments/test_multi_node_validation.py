"""vTrain's multi-node file is validated on the cluster its runs had (issue 36, item 5): nodes of
8 A100s with 800 Gb/s between them (vTrain's config/validation/multi/*.json), the profile
dgx_a100_800g, chosen by the file's parameter-count column. The DP all-reduce of one row worked
by hand from NCCL 2.14.3's cost model."""
from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

import pytest

from experiments.analysis import measured
from experiments.analysis.hardware import PROFILE_KEYS, SOURCES, load_cluster, profile

REPO = Path(__file__).resolve().parents[2]
MULTI = REPO / "results" / "external" / "vtrain_a100_multi_node.csv"
HEADER = ["# GPUs", "global batch", "micro batch", "hidden size", "attention heads", "# layers", "sequence length",
          "tensor parallelism", "data parallelism", "pipeline parallelism", "iteration time (ms)"]


def test_the_profile_is_dgx_a100s_node_with_800_gbps_between_nodes():
    a100, vtrain = load_cluster("dgx_a100"), load_cluster("dgx_a100_800g")
    differ = {k for k in PROFILE_KEYS if a100[k] != vtrain[k]}
    assert differ == {"inter_node_gbps", "nics_per_node"}
    assert (vtrain["inter_node_gbps"], vtrain["nics_per_node"]) == (800, 4)
    assert "inter_node_bandwidth: 800" in SOURCES["dgx_a100_800g.inter_node_gbps"]
    nccl = profile("dgx_a100_800g").collectives
    assert nccl.nic_gb_per_s == 25.0                       # 800 / 8 bits / 4 NICs, NCCL's speed / 8000
    assert nccl.bus(64, 8, 1) == (100.0, 4.0)              # the node's NICs, below 12 NVLinks x 22 GB/s
    assert nccl.bus(32, 4, 2) == (50.0, 2.0)               # two DP groups (TP 2) share them


def test_the_dp_all_reduce_of_the_3_6b_tp1_row_by_hand():
    """Row 0: 3.6B, TP 1 x DP 64 on 8 nodes. Parameters per rank: 30 x (12 h^2 + 13 h) + the
    vocabulary padded to 50,304 x h + 2,048 positions x h + the final layernorm's 2h, h = 3072:
    3,559,415,808; fp16 gradients. NCCL 2.14.3 picks ring Simple: bus 100 GB/s (4 x 25), algorithm
    bandwidth 100 x 64 / 126; latency (8.4 + 110 x 3.4 + 16 x 9.6) us x 1.9 (the ring plateau)."""
    psi = 30 * (12 * 3072**2 + 13 * 3072) + 50304 * 3072 + 2048 * 3072 + 2 * 3072
    assert psi == 3_559_415_808
    latency = 1.9 * (8.4 + 110 * 3.4 + 16 * 9.6) * 1e-6
    by_hand = latency + 2 * psi / (100e9 * 64 / 126)
    assert by_hand == pytest.approx(0.14117, abs=1e-5)
    nccl = replace(profile("dgx_a100_800g").collectives, version="2.14.3")
    assert nccl.choice("all_reduce", 2 * psi, 64, 8) == ("ring", "Simple", pytest.approx(by_hand))
    # dgx_a100's 1,600 Gb/s halves it: the 0.07 s the file was validated with before
    a100 = replace(profile("dgx_a100").collectives, version="2.14.3")
    assert a100.time_s("all_reduce", 2 * psi, 64, 8) == pytest.approx(latency + 2 * psi / (200e9 * 64 / 126))
    row = measured.predict_file(MULTI)[1][0]
    assert (row.row["tp"], row.row["dp"], row.cluster) == (1, 64, "dgx_a100_800g")
    assert measured.vtrain_inputs(row.row).psi == psi
    assert row.prediction.terms["dp_comm_exposed"] == pytest.approx(by_hand)   # not overlapped: all exposed


def write(path: Path, with_params: bool) -> Path:
    row = [64, 512, 8, 3072, 32, 2, 2048, 8, 8, 1, 900.0]
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([["Parameters (billion)", *HEADER], [3.6, *row]] if with_params else [HEADER, row])
    return path


def test_the_parameter_column_chooses_the_800_gbps_cluster_and_cluster_overrides_it(tmp_path):
    multi, single = write(tmp_path / "multi.csv", True), write(tmp_path / "single.csv", False)
    assert [o.cluster for o in measured.predict_file(multi)[1]] == ["dgx_a100_800g"]
    assert [o.cluster for o in measured.predict_file(single)[1]] == ["dgx_a100"]
    assert [o.cluster for o in measured.predict_file(multi, cluster="dgx_a100")[1]] == ["dgx_a100"]
    # the same row, slower on the narrower network: its DP all-reduce (8 groups share 4 NICs)
    slow, fast = measured.predict_file(multi)[1][0], measured.predict_file(single)[1][0]
    assert slow.prediction.terms["dp_comm_exposed"] > 1.9 * fast.prediction.terms["dp_comm_exposed"]
    assert {k: v for k, v in slow.prediction.terms.items() if k not in ("dp_comm_exposed",)} == \
        {k: v for k, v in fast.prediction.terms.items() if k not in ("dp_comm_exposed",)}


def test_every_unpipelined_row_of_the_file_runs_on_the_800_gbps_cluster():
    outcomes = measured.predict_file(MULTI)[1]
    done = [o for o in outcomes if o.prediction is not None]
    assert len(done) == 28 and {o.cluster for o in done} == {"dgx_a100_800g"}
