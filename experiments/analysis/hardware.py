"""What the step-time model knows of a machine: a Hardware profile.

A profile is the device's peak, memory bandwidth and per-kernel floor, its node size and host
link, and two models behind small protocols, so that a datasheet profile and a measured one plug
into the same step-time composition (experiments/analysis/step_time.py):

- a GemmModel: the fraction of `peak_flops` a GEMM (m x k) @ (k x n) reaches. The GPU profiles
  use tile and wave quantization over the SMs under a large-GEMM ceiling (gemm.py); a calibrated
  profile interpolates its measured table (calibrated.py, written by `make calibrate`).
- a CollectiveModel: seconds for one collective. The GPU profiles use NCCL 2.7.8's own cost
  model (nccl.py); a calibrated profile its measured gloo latency and bandwidth.

The GPU profiles' constants live in conf/cluster/<name>.yaml (one source of truth: the same
file the sweeps' `cluster=` reads); each is sourced in SOURCES below, keyed "<cluster>.<key>".
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import yaml

from experiments.analysis.gemm import K_PIPELINE_BY_COMPUTE_CAPABILITY, TILES_BY_COMPUTE_CAPABILITY, TileWaveGemm
from experiments.analysis.nccl import Nccl

COLLECTIVE_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "reduce", "broadcast")


class GemmModel(Protocol):
    def efficiency(self, m: int, n: int, k: int) -> float:
        """Fraction of Hardware.peak_flops a GEMM (m x k) @ (k x n) reaches. A batched GEMM of
        `batch` independent (m x k) @ (k x n) products is asked as (batch·m, n, k): its tiles
        fill the SMs the same way."""
        ...


class CollectiveModel(Protocol):
    def time_s(self, kind: str, nbytes: float, ranks: int, ranks_per_node: int, concurrent: int = 1) -> float:
        """Seconds of one collective of `kind` (COLLECTIVE_KINDS) over `ranks` ranks,
        `ranks_per_node` of them on each node. nbytes is the collective's full buffer: the tensor
        of an all_reduce / reduce / broadcast, the full input of a reduce_scatter, the full output
        of an all_gather. `concurrent`: how many groups of the same kind run the same collective
        at once through each node's NICs (they share them); 1 when the group is alone. 0 s for
        one rank."""
        ...


@dataclass(frozen=True)
class Hardware:
    """One device's view of its machine, as the step-time model uses it."""

    name: str
    peak_flops: float            # per device, at the training dtype (GEMMs)
    hbm_bytes_per_s: float       # memory bandwidth, per device
    hbm_fraction: float          # achievable fraction of hbm_bytes_per_s for streaming elementwise kernels
    kernel_floor_s: float        # per kernel: launch + framework host overhead
    gpus_per_node: int
    pcie_bytes_per_s: float      # host <-> device (Pa+cpu, offload)
    gemm: GemmModel
    collectives: CollectiveModel
    sources: dict[str, str]      # constant -> its source (datasheet, SOURCES row, or "measured by make calibrate on <host>, <date>")
    compute_capability: int | None = None   # the GPU generation (70, 80, 90; attention.py's measured rates); None: a CPU

    @property
    def stream_bytes_per_s(self) -> float:
        """What a memory-bound kernel streams per second."""
        return self.hbm_bytes_per_s * self.hbm_fraction


# -- the GPU profiles: conf/cluster/<name>.yaml, each constant sourced -------------------------
PROFILE_KEYS = ("peak_tflops", "sms", "gemm_ceiling", "hbm_gb_per_s", "hbm_fraction", "kernel_floor_us",
                "gpus_per_node", "nvlink_links", "nvlink_link_gb_per_s", "inter_node_gbps", "nics_per_node",
                "pcie_gb_per_s")
PROFILES = ("dgx2_v100", "dgx2h_v100", "dgx_h100", "dgx_a100", "dgx_a100_800g", "dgx_a100_40gb")
# which GPU generation (NCCL's per-architecture refinements, the GEMM tiles): conf key
# compute_capability, else by name
COMPUTE_CAPABILITY = {"dgx2_v100": 70, "dgx2h_v100": 70, "dgx_h100": 90, "dgx_a100": 80, "dgx_a100_800g": 80,
                      "dgx_a100_40gb": 80}
CONF_CLUSTER = Path(__file__).resolve().parents[2] / "conf" / "cluster"

_V100 = {
    "sms": "80 SMs: NVIDIA Tesla V100 GPU Architecture whitepaper (GV100 with 80 of 84 SMs enabled)",
    "gemm_ceiling": "0.816: the median, over DeepBench's 74 large fp16 GEMMs on a DGX-1 V100 with CUDA 10.1.243 "
                    "(2019; results/external/deepbench_v100_fp16_gemm.csv), of the measured fraction of peak over "
                    "gemm.py's tile and wave quantization of the shape (0.727-0.903; experiments/reports/gemm_check.py "
                    "derives it, gemm_check.md sets every row beside the model)",
    "hbm_gb_per_s": "900: NVIDIA Tesla V100 datasheet (HBM2)",
    "hbm_fraction": "0.833 = 750/900: V100 global-memory bandwidth measured by microbenchmark, Jia, Maggioni, "
                    "Staiger, Scarpazza 2018, 'Dissecting the NVIDIA Volta GPU Architecture via "
                    "Microbenchmarking' (arXiv 1804.06826) §3",
    "kernel_floor_us": "5: PyTorch per-op host overhead with autograd, 5-7 us in 2020 (pytorch/pytorch#41383; "
                       "an empty kernel's launch alone ~3 us, NVIDIA developer forum): the low end",
    "gpus_per_node": "16: NVIDIA DGX-2 datasheet",
    "nvlink_links": "6 NVLink2 links per V100 into the NVSwitch planes: NVIDIA DGX-2 datasheet",
    "nvlink_link_gb_per_s": "21: the width NCCL 2.5-2.7 assigns a Volta NVLink (src/graph/topo.h); datasheet "
                            "25 per direction",
    "inter_node_gbps": "800 per node: 8 x 100 Gb/s EDR InfiniBand (ZeRO paper Sec 10.1; DGX-2 datasheet); NCCL "
                       "counts a NIC at its speed / 8000 = 12.5 GB/s; 'about 12.2 GB/s is as good as you can get' "
                       "(nccl-tests#29)",
    "nics_per_node": "8 EDR NICs per DGX-2 node: NVIDIA DGX-2 datasheet",
    "pcie_gb_per_s": "12: PCIe gen3 x16 achievable host<->device copies (15.75 GB/s theoretical: 8 GT/s x 16 "
                     "lanes x 128b/130b); NCCL's PCI width 12 (src/graph/topo.h)",
}
SOURCES = {
    **{f"dgx2_v100.{k}": v for k, v in _V100.items()},
    "dgx2_v100.peak_tflops": "125: NVIDIA Tesla V100 datasheet (SXM2/SXM3, fp16 tensor core, dense); DGX-2 "
                             "datasheet 2 PFLOPs / 16 GPUs",
    **{f"dgx2h_v100.{k}": v for k, v in _V100.items()},
    "dgx2h_v100.peak_tflops": "131: DGX-2H, 2.1 PFLOPs / 16 GPUs (450 W V100s at higher clocks; Tom's Hardware, "
                              "'Nvidia's DGX-2 ... Just Got Faster'); Megatron-LM's 39 TFLOPs were measured on one "
                              "(Shoeybi et al. 2019, arXiv 1909.08053 §5.1.1)",
    "dgx_h100.peak_tflops": "989: NVIDIA H100 SXM datasheet (bf16/fp16 tensor core, dense; 1979 with sparsity)",
    "dgx_h100.sms": "132: NVIDIA H100 SXM5 datasheet / Hopper architecture whitepaper",
    "dgx_h100.gemm_ceiling": "0.828 [derived]: the Maximum Achievable Matmul FLOPS measured on an H100 SXM, 794.5 of "
                             "989 TFLOPs at its best shape 2048 x 2048 x 13312 (bf16, torch 2.7.0 + CUDA 12.6; "
                             "stas00/ml-engineering, compute/accelerator/README.md), over gemm.py's tile and wave "
                             "losses at that shape (0.970), as dgx_a100's; a best-of-shapes figure, so an upper "
                             "reading (on the A100 the same reading predicts the development set's compute-heavy "
                             "steps fast); no headline target uses this profile",
    "dgx_h100.hbm_gb_per_s": "3350: NVIDIA H100 SXM datasheet (HBM3, 3.35 TB/s)",
    "dgx_h100.hbm_fraction": "0.833 [assumption]: V100's measured fraction (Jia et al. 2018) carried over",
    "dgx_h100.kernel_floor_us": "5: PyTorch per-op host overhead with autograd (pytorch/pytorch#41383)",
    "dgx_h100.gpus_per_node": "8: NVIDIA DGX H100 datasheet",
    "dgx_h100.nvlink_links": "18 NVLink 4 links per H100: NVIDIA H100 datasheet",
    "dgx_h100.nvlink_link_gb_per_s": "20 [derived]: 900 GB/s / 18 links / 2 directions = 25, at the 21/25 ratio "
                                     "NCCL 2.7 assigns Volta's links (NCCL 2.7.8 predates Hopper)",
    "dgx_h100.inter_node_gbps": "3200 per node: 8 x 400 Gb/s NDR InfiniBand (DGX H100 datasheet)",
    "dgx_h100.nics_per_node": "8 ConnectX-7 NDR NICs per node: NVIDIA DGX H100 datasheet",
    "dgx_h100.pcie_gb_per_s": "48 [derived]: PCIe gen5 x16, 63 GB/s theoretical x the gen3 achievable ratio 12/15.75",
    "dgx_a100.peak_tflops": "312: NVIDIA A100 Tensor Core GPU datasheet (SXM, fp16/bf16 tensor core, dense; 624 with "
                            "sparsity)",
    "dgx_a100.sms": "108: NVIDIA A100 Tensor Core GPU Architecture whitepaper (GA100 with 108 of 128 SMs enabled; the "
                    "number NVIDIA's 'Matrix Multiplication Background User's Guide' uses for wave quantization)",
    "dgx_a100.gemm_ceiling": "0.902 [derived]: the Maximum Achievable Matmul FLOPS measured on an A100 SXM, 271.2 of "
                             "312 TFLOPs at its best shape 1024 x 10240 x 5120 (bf16, torch 2.6 + CUDA 12.6; "
                             "stas00/ml-engineering, compute/accelerator/README.md), over gemm.py's tile, wave and "
                             "pipeline losses at that shape (0.964); a newer cuBLAS than the development set's CUDA "
                             "11.8, and a best-of-shapes figure, so an upper reading",
    "dgx_a100.hbm_gb_per_s": "2039: NVIDIA A100 80 GB SXM datasheet (HBM2e, 2,039 GB/s)",
    "dgx_a100.hbm_fraction": "0.9 [unverified]: a streaming kernel's fraction of the HBM peak on A100, as STREAM-like "
                             "GPU benchmarks (BabelStream) report it (about 1.4 of 1.555 TB/s on the 40 GB part)",
    "dgx_a100.kernel_floor_us": "5: PyTorch per-op host overhead with autograd (pytorch/pytorch#41383); a host "
                                "model's layers (systems.py) cost its own per-kernel time instead, and "
                                "megatron_ds2023's step kernels too",
    "dgx_a100.gpus_per_node": "8: NVIDIA DGX A100 datasheet",
    "dgx_a100.nvlink_links": "12 NVLink 3 links per A100 into six NVSwitches: NVIDIA A100 datasheet / DGX A100 "
                             "datasheet (600 GB/s per GPU, both directions)",
    "dgx_a100.nvlink_link_gb_per_s": "22: the width NCCL 2.14 assigns an sm80 NVLink (src/graph/topo.h SM80_NVLINK_BW); "
                                     "datasheet 25 per direction; NCCL 2.14's tuner caps an Ampere bus at 235 GB/s "
                                     "(tuning.cc), which vTrain's nccl-tests on its A100 node reach: 229 GB/s busbw at "
                                     "1 GiB over 8 GPUs (results/external/vtrain_a100_allreduce.csv)",
    "dgx_a100.inter_node_gbps": "1600 per node: 8 x 200 Gb/s HDR InfiniBand (NVIDIA DGX A100 datasheet); NCCL counts "
                                "a NIC at its speed / 8000 = 25 GB/s (src/graph/topo.cc)",
    "dgx_a100.nics_per_node": "8 ConnectX-6 HDR NICs for the compute fabric: NVIDIA DGX A100 datasheet",
    "dgx_a100.pcie_gb_per_s": "24: PCIe gen4 x16, the width NCCL 2.14 assigns it (src/graph/topo.cc: 16 lanes x "
                              "16 GT/s -> 16 x 120 / 80 GB/s)",
    # vTrain's multi-node cluster (results/external/vtrain_a100_multi_node.csv): dgx_a100's node
    # (its constants' sources below), its own network
    "dgx_a100_800g.inter_node_gbps": "800 per node: vTrain's config/validation/multi/*.json (VIA-Research/vTrain @ "
                                     "f8dda847), inter_node_bandwidth: 800, 'Total bandwidth of inter-node "
                                     "communication in Gbps' (src/config.py); the configs of its multi-node file's runs",
    "dgx_a100_800g.nics_per_node": "4 [derived]: not stated; vTrain's simulator sends a point-to-point transfer at a "
                                   "quarter of the node's bandwidth (src/predictor.py _compute_p2p_latency), one of four "
                                   "200 Gb/s HDR NICs. 8 x 100 Gb/s leaves every row with TP <= 8 of the multi-node file "
                                   "as it is (NCCL's bus is the node's bandwidth either way) and moves TP 16's small "
                                   "micro-batches by up to 7.6% (cross-node TP all-reduces under NCCL's per-channel "
                                   "caps); the median error is 0.156 with either",
    "nccl": "NCCL 2.7.8 (2020-07) cost model and constants, src/graph/tuning.cc (ncclTopoTuneModel, "
            "ncclTopoGetAlgoTime): experiments/analysis/nccl.py",
}
# dgx_a100_800g is dgx_a100's node (GPU, NVLink, PCIe) on vTrain's network
SOURCES |= {f"dgx_a100_800g.{k}": SOURCES[f"dgx_a100.{k}"]
            for k in PROFILE_KEYS if k not in ("inter_node_gbps", "nics_per_node")}
# dgx_a100_40gb is dgx_a100 with the 40 GB part's memory (llm-foundry's A100 40GB rows)
SOURCES |= {f"dgx_a100_40gb.{k}": SOURCES[f"dgx_a100.{k}"] for k in PROFILE_KEYS if k != "hbm_gb_per_s"}
SOURCES["dgx_a100_40gb.hbm_gb_per_s"] = "1555: NVIDIA A100 40 GB SXM datasheet (HBM2, 1,555 GB/s)"
SOURCES["dgx_a100_40gb.inter_node_gbps"] = ("1600 per node: llm-foundry's benchmark table's section title, 'A100 40GB "
                                            "with 1600 Gbps node-node interconnect (RoCE)'")
SOURCES["dgx_a100_40gb.nics_per_node"] = ("8 [assumption]: not stated (RoCE, not a DGX's InfiniBand); 8 x 200 Gb/s as a "
                                          "DGX A100's")


def load_cluster(name: str) -> dict | None:
    """conf/cluster/<name>.yaml as a dict (None if there is no such file)."""
    path = CONF_CLUSTER / f"{name}.yaml"
    if not path.exists():
        return None
    with open(path) as f:
        return yaml.safe_load(f)


def from_cluster(cluster: dict | None) -> Hardware | None:
    """The GPU profile of a cluster config (a conf/cluster dict, or a record's copy of one); None
    when it lacks a constant (the `local` cluster: `make calibrate` measures this machine)."""
    if not cluster or any(cluster.get(k) is None for k in PROFILE_KEYS):
        return None
    name = cluster.get("name", "?")
    cc = int(cluster.get("compute_capability") or COMPUTE_CAPABILITY.get(name, 70))
    return Hardware(
        name=name, peak_flops=cluster["peak_tflops"] * 1e12, hbm_bytes_per_s=cluster["hbm_gb_per_s"] * 1e9,
        hbm_fraction=cluster["hbm_fraction"], kernel_floor_s=cluster["kernel_floor_us"] * 1e-6,
        gpus_per_node=cluster["gpus_per_node"], pcie_bytes_per_s=cluster["pcie_gb_per_s"] * 1e9,
        gemm=TileWaveGemm(sms=cluster["sms"], ceiling=cluster["gemm_ceiling"], tiles=TILES_BY_COMPUTE_CAPABILITY[cc],
                          **dict(zip(("k_tile", "stages"), K_PIPELINE_BY_COMPUTE_CAPABILITY.get(cc, (None, 1))))),
        # NCCL turns LL128 on only for Volta and Ampere with NVLink; the NCCL release is the
        # system's (step_time.predict sets it; 2.7.8 until then)
        collectives=Nccl(nvlink_links=cluster["nvlink_links"], nvlink_gb_per_s=cluster["nvlink_link_gb_per_s"],
                         nics_per_node=cluster["nics_per_node"],
                         nic_gb_per_s=cluster["inter_node_gbps"] / 8 / cluster["nics_per_node"],
                         ll128=cc in (70, 80), compute_capability=cc),
        sources={k: SOURCES[f"{name}.{k}"] for k in PROFILE_KEYS if f"{name}.{k}" in SOURCES} | {"collectives": SOURCES["nccl"]},
        compute_capability=cc)


def profile(name: str) -> Hardware | None:
    """The GPU profile conf/cluster/<name>.yaml describes (None if it has no constants)."""
    return from_cluster(load_cluster(name))
