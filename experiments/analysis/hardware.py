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
from typing import Protocol

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

    @property
    def stream_bytes_per_s(self) -> float:
        """What a memory-bound kernel streams per second."""
        return self.hbm_bytes_per_s * self.hbm_fraction
