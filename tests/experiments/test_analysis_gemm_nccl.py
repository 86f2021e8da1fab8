"""The step-time model's two sub-models against hand calculations: a GEMM's tile and wave
quantization (analysis/gemm.py) and NCCL 2.7.8's cost of a collective (analysis/nccl.py)."""
from __future__ import annotations

import pytest

from experiments.analysis.gemm import TileWaveGemm, tile_efficiency, tile_reuse
from experiments.analysis.hardware import profile
from experiments.analysis.nccl import Nccl, concurrent_groups

GEMM = TileWaveGemm(sms=80, ceiling=0.7)
DGX2 = Nccl(nvlink_links=6, nvlink_gb_per_s=21, nics_per_node=8, nic_gb_per_s=12.5)


def test_tile_reuse_halves_for_64x64_and_caps_at_one():
    assert tile_reuse(128, 128) == 1.0 and tile_reuse(256, 128) == 1.0
    assert tile_reuse(64, 64) == pytest.approx(0.5)        # 32 FLOPs per load vs 64
    assert tile_reuse(128, 64) == pytest.approx(2 / 3)


def test_gemm_efficiency_worked_by_hand():
    # MP 128's QKV slice: m = 2048 tokens, n = 3·8192/128 = 192 columns, k = 8192, 80 SMs.
    # 128x128: 16 x 2 = 32 tiles, 192/256 of the tiles useful, 32 of 80 SMs busy -> 0.75 x 0.4 = 0.3
    assert tile_efficiency(2048, 192, 128, 128, 80) == pytest.approx(0.3)
    # 128x64: 16 x 3 = 48 tiles, no padding, one wave of 48/80, reuse 2/3 -> 0.4
    assert tile_efficiency(2048, 192, 128, 64, 80) == pytest.approx(0.4)
    # 64x64: 32 x 3 = 96 tiles, two waves of 80 (96/160), reuse 1/2 -> 0.3
    assert tile_efficiency(2048, 192, 64, 64, 80) == pytest.approx(0.3)
    assert GEMM.efficiency(2048, 192, 8192) == pytest.approx(0.7 * 0.4)      # the best tile, under the ceiling
    # exactly one full wave of 128x128 tiles reaches the ceiling; one tile more needs a second wave
    assert GEMM.efficiency(128 * 80, 128, 4096) == pytest.approx(0.7)
    assert tile_efficiency(128 * 81, 128, 128, 128, 80) == pytest.approx(81 / 160)


def test_gemm_model_follows_the_measured_v100_curve_where_k_is_large():
    # zzc0721/torch-performance-test-data#140 (V100-SXM2, cuBLAS 12.8): square fp16 GEMMs reach
    # 78.2 / 95.7 / 97.4 TFLOPs at n = 2048 / 4096 / 8192. With that stack's ceiling (97.4/125) the
    # quantization alone gives 2048: 0.8 (256 tiles in 4 waves), 4096: 1024/1040, 8192: 4096/4160.
    modern = TileWaveGemm(sms=80, ceiling=97.4 / 125)
    for n, measured in ((2048, 78.2), (4096, 95.7)):
        assert modern.efficiency(n, n, n) * 125 == pytest.approx(measured, rel=0.05)  # within 5% of the curve


def test_nccl_ring_latency_and_bandwidth_worked_by_hand():
    # Megatron's MP 128 all-reduce of s·b·h·2 = 1024·2·8192·2 bytes over 8 DGX-2 nodes, ring LL128:
    # lat = baseLat 10.0 + (2·127 - 2·7) intra steps x 1.9 + 2·7 inter steps x 4.0 = 522 us;
    # busBw = min(8 NICs x 12.5 x 0.92, 16.7 x 8 channels) = 92 GB/s, algBw = 92 x 128/254
    nbytes = 1024 * 2 * 8192 * 2
    ring = DGX2.candidates("all_reduce", nbytes, 128, 16)
    lat = 10.0 + 240 * 1.9 + 14 * 4.0
    assert lat == pytest.approx(522.0)
    assert ring[("ring", "LL128")] == pytest.approx(lat + nbytes / (1000 * 92 * 128 / 254))   # 1246.7 us
    # tree LL128: 4.4 + 2·(15 x 1.2 + log2(8) x 8.5) = 91.4 us; busBw min(min(100 x .9, 80) x .915,
    # 16.7 x 8 x 7/9) = 73.2, x 0.5, x the correction 0.9 at log2(nbytes/64) = 19
    tree_lat = 4.4 + 2 * (15 * 1.2 + 3 * 8.5)
    assert ring[("tree", "LL128")] == pytest.approx(tree_lat + nbytes / (1000 * 80 * .915 * .5 * .9))
    algo, proto, seconds = DGX2.choice("all_reduce", nbytes, 128, 16)
    assert (algo, proto) == ("tree", "LL128") and seconds == pytest.approx(ring[("tree", "LL128")] * 1e-6)
    assert DGX2.time_s("all_reduce", nbytes, 128, 16) == pytest.approx(1110.1e-6, rel=1e-4)   # 1.11 ms


def test_nccl_inside_a_node_and_small_messages():
    # MP 16 in one DGX-2: 6 NVLinks x 21 = 126 GB/s; a 537 MB all-reduce picks Simple:
    # 8.4 + 30 x 3.4 us + 537e6 / (126 x 16/30 GB/s)
    big = 1024 * 32 * 8192 * 2
    assert DGX2.time_s("all_reduce", big, 16, 16) == pytest.approx((8.4 + 30 * 3.4 + big / (1000 * 126 * 16 / 30)) * 1e-6)
    # 4 bytes over 16 ranks: LL's latency 3.6 + 30 x 0.47 us, bandwidth negligible
    assert DGX2.time_s("all_reduce", 4, 16, 16) == pytest.approx((3.6 + 30 * .47) * 1e-6, rel=1e-3)
    assert DGX2.time_s("all_reduce", 1e6, 1, 1) == 0.0


def test_nccl_reduce_pays_a_hop_latency_per_rank_and_shares_nics():
    # DeepSpeed 2020's reduce over DP 25 (MP 16: one rank per node, 16 groups per node share 8 NICs):
    # busBw 100/16 = 6.25 GB/s; Simple: 8.4 + 25 x 50 (the tree's NET chunk latency) us
    simple = DGX2.candidates("reduce", 500e6, 25, 1, concurrent=16)[("ring", "Simple")]
    assert simple == pytest.approx(8.4 + 25 * 50 + 500e6 / (1000 * 6.25))
    ll128 = DGX2.candidates("reduce", 1e3, 25, 1, concurrent=16)[("ring", "LL128")]
    assert ll128 == pytest.approx(10.0 + 25 * 4.0 + 1e3 / (1000 * min(6.25 * 0.7, 12.0 * 0.5)))   # ppn 1: x 0.7


def test_concurrent_groups_follow_megatrons_layout():
    assert concurrent_groups(16, 1, 400, 16) == 0          # MP 16: each TP group is one node
    assert concurrent_groups(128, 1, 384, 16) == 1         # MP 128: 8 whole nodes per TP group
    assert concurrent_groups(25, 16, 400, 16) == 16        # MP 16 x DP 25: 16 DP groups per node
    assert concurrent_groups(128, 1, 128, 16) == 1         # MP 1 x DP 128: the one DP group
    assert concurrent_groups(3, 128, 384, 16) == 16        # MP 128 x DP 3: one DP group per GPU
    assert concurrent_groups(24, 1, 48, 16) == 2           # MP 24: node 1 holds parts of two TP groups


def test_profiles_read_conf_cluster_and_every_constant_is_sourced():
    from experiments.analysis import hardware
    v100, v100h, h100, a100 = (profile(n) for n in ("dgx2_v100", "dgx2h_v100", "dgx_h100", "dgx_a100"))
    assert (v100.peak_flops, v100h.peak_flops, h100.peak_flops) == (125e12, 131e12, 989e12)
    assert v100.stream_bytes_per_s == pytest.approx(750e9, rel=1e-3)       # 900 x 0.833
    assert v100.collectives.nic_gb_per_s == 12.5 and v100.gemm.sms == 80
    assert not h100.collectives.ll128                                       # 2.7.8: Volta/Ampere only
    assert profile("local") is None
    for name in hardware.PROFILES:
        for key in hardware.PROFILE_KEYS:
            assert f"{name}.{key}" in hardware.SOURCES, f"{name}.{key} has no source"
