"""This machine's Hardware, from the profile `make calibrate` measured
(results/calibration/<hostname>.yaml, experiments/calibration/): a MeasuredGemm interpolating the
measured GEMM table and MeasuredCollectives with gloo's measured latency and bandwidth.

The profile describes one host at one date at the sweep's thread count; `sources` says so for
every constant. No constant here holds anywhere else.
"""
from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from experiments.analysis.hardware import COLLECTIVE_KINDS, Hardware, from_cluster
from experiments.analysis.kernels import LayerShape
from experiments.analysis.layers import step_kernels

CALIBRATION_DIR = Path(__file__).resolve().parents[2] / "results" / "calibration"
NEAREST = 4  # table entries an off-table GEMM is interpolated from


@dataclass(frozen=True)
class MeasuredGemm:
    """Efficiency = measured rate / peak. A measured shape gets its own rate; any other shape the
    inverse-square-distance mean of its NEAREST measured neighbours' rates, distance taken in
    (log2 m, log2 n, log2 k) (GEMM rates follow size ratios, not differences)."""

    table: tuple[tuple[int, int, int, float], ...]  # (m, n, k, FLOP/s)
    peak_flops: float

    def rate(self, m: int, n: int, k: int) -> float:
        near = sorted((math.dist((math.log2(m), math.log2(n), math.log2(k)),
                                 (math.log2(tm), math.log2(tn), math.log2(tk))), r) for tm, tn, tk, r in self.table)
        near = near[:NEAREST]
        if near[0][0] == 0.0:
            return near[0][1]
        weights = [1.0 / d ** 2 for d, _ in near]
        return sum(w * r for w, (_, r) in zip(weights, near)) / sum(weights)

    def efficiency(self, m: int, n: int, k: int) -> float:
        return self.rate(max(m, 1), max(n, 1), max(k, 1)) / self.peak_flops


@dataclass(frozen=True)
class MeasuredCollectives:
    """latency + nbytes / bandwidth per kind at each measured world size (gloo over loopback,
    every rank on this host: ranks_per_node changes nothing). `concurrent` groups share the
    loopback: their bytes queue behind each other. One rank: 0 s.

    `hidden`: per world and kind, the measured fraction of a collective issued async that the
    rank's concurrent compute hides (calibration/collectives.measure_overlap): gloo copies and
    reduces on the cores the ranks compute on, so on a CPU host little of it hides. A kind or
    world not measured (a profile from before the measurement): 1, the GPU's assumption."""

    fits: dict[int, dict[str, tuple[float, float]]]  # world -> kind -> (latency s, bytes/s)
    hidden: dict[int, dict[str, float]] = field(default_factory=dict)  # world -> kind -> fraction

    def hidden_fraction(self, kind: str, ranks: int) -> float:
        return self.hidden.get(ranks, {}).get(kind, 1.0)

    def time_s(self, kind: str, nbytes: float, ranks: int, ranks_per_node: int, concurrent: int = 1) -> float:
        if kind not in COLLECTIVE_KINDS:
            raise ValueError(f"collective kind {kind!r}: allowed {', '.join(COLLECTIVE_KINDS)}")
        if ranks == 1:
            return 0.0
        if ranks not in self.fits:
            raise ValueError(f"no gloo measurement at world {ranks}: this profile measured worlds "
                             f"{sorted(self.fits)} (make calibrate measures only those this machine's cores run)")
        latency, bandwidth = self.fits[ranks][kind]
        return latency + concurrent * nbytes / bandwidth


def default_path() -> Path:
    """Where `make calibrate` writes this host's profile: results/calibration/<hostname>.yaml, or
    under $ZERO_REPRO_CALIBRATION_DIR (the test suite names an empty folder there, so that a
    developer's own profile changes no test's verdict)."""
    return Path(os.environ.get("ZERO_REPRO_CALIBRATION_DIR") or CALIBRATION_DIR) / f"{socket.gethostname()}.yaml"


def load_profile(path: str | Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def kernels_per_step(framework: dict, layers: int) -> int:
    """Kernels the step-time model counts for one step of the vanishing-shape model (fp32)."""
    shape = framework["shape"]
    x = LayerShape(framework["micro_batch"], shape["seq_len"], shape["hidden"], shape["heads"], 1,
                   shape["vocab_size"], 4)
    return sum(k.count * repeats for phase in step_kernels(x, layers, framework["recompute"]).values()
               for k, repeats in phase)


def kernel_floor_s(framework: dict) -> float:
    """The per-kernel floor of a CPU rank: the host time the sweep's own model adds per layer at a
    shape where its kernels do no work (calibration/framework.py), over the kernels the model
    counts per layer (layers.step_kernels: forward, recomputed forward, backward)."""
    (l0, l1), (t0, t1) = framework["layers"], framework["step_s"]
    return (t1 - t0) / (kernels_per_step(framework, l1) - kernels_per_step(framework, l0))


def hardware_from_profile(p: dict) -> Hardware:
    """The Hardware a measured profile describes (see load_calibrated)."""
    where = f"measured by make calibrate on {p['host']} ({p['cpu']}), {p['date']}, torch {p['torch']}, {p['threads']} thread(s)"
    gemm = tuple((g["m"], g["n"], g["k"], g["flops_per_s"]) for g in p["gemm"])
    peak = max(r for *_, r in gemm)
    fits = {int(w): {kind: (v["latency_s"], v["bytes_per_s"]) for kind, v in kinds.items()}
            for w, kinds in p["collectives"].items()}
    hidden = {int(w): {kind: v["hidden_fraction"] for kind, v in kinds.items()}
              for w, kinds in (p.get("collective_overlap") or {}).items()}
    stream = p["stream"]["bytes_per_s"]
    return Hardware(
        name=f"calibrated:{p['host']}", peak_flops=peak,
        hbm_bytes_per_s=stream, hbm_fraction=1.0,  # the measured rate is what a streaming op achieves
        kernel_floor_s=kernel_floor_s(p["framework"]),
        gpus_per_node=int(p["cpu_count"]),  # ranks per host: every rank is a process here
        pcie_bytes_per_s=stream,  # "host <-> device" is a copy within the same memory
        gemm=MeasuredGemm(gemm, peak), collectives=MeasuredCollectives(fits, hidden),
        sources={"peak_flops": f"best GEMM rate of {len(gemm)} shapes, {where}",
                 "hbm_bytes_per_s": f"out = a + b over {p['stream']['array_bytes']} B arrays, {where}",
                 "hbm_fraction": "1: the streaming rate is measured, not a datasheet peak",
                 "kernel_floor_s": f"host time per layer of the sweep's model at a vanishing shape over the kernels "
                                   f"the model counts per layer (one op alone: {p['op_floor']['forward_s'] * 1e6:.1f} us), {where}",
                 "gpus_per_node": "os.cpu_count(): the ranks of one host",
                 "pcie_bytes_per_s": "the streaming rate: host and device share one memory",
                 "gemm": f"interpolated GEMM table, {where}",
                 "collectives": f"gloo loopback, worlds {sorted(fits)}, {where}; fraction hidden under compute "
                                + (", ".join(f"world {w} {k} {h:.2f}" for w, ks in hidden.items() for k, h in ks.items())
                                   or "not measured (1 assumed)")})


def load_calibrated(path: str | Path) -> Hardware:
    """This machine's Hardware from a profile written by `make calibrate`."""
    return hardware_from_profile(load_profile(path))


def cluster_hardware(cluster: dict) -> Hardware | None:
    """A cluster config's step-time profile: its GPU constants (conf/cluster/<name>.yaml), or for
    `local` this machine's calibrated profile once `make calibrate` has written it; else None."""
    hw = from_cluster(cluster)
    if hw is None and cluster.get("name") == "local" and default_path().exists():
        hw = load_calibrated(default_path())
    return hw
