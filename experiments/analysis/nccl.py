"""NCCL's own cost model for a collective, with the constants of NCCL 2.7.8 (July 2020, the
release of the ZeRO paper's time) or of NCCL 2.14.3 (the release PyTorch 2.0.1's CUDA 11.8 wheels
ship, the stack of the A100 development set); src/graph/tuning.cc of each.

NCCL predicts, per collective, algorithm (ring; tree for all-reduce) and protocol (LL, LL128,
Simple), `time_us = lat + nBytes / (1000 · algBw)` and runs the smallest. This module redoes
`ncclTopoTuneModel` and `ncclTopoGetAlgoTime` for one communicator:

- bus bandwidth: nChannels x the channel speed. Inside a node a channel is an NVLink (NCCL's
  width: 21 GB/s on Volta, topo.h), nChannels = the GPU's links (6 into a DGX-2's NVSwitch
  planes: 126 GB/s). Across nodes a channel goes out through a NIC (its speed / 8 GB/s); a group
  alone on its nodes gets every NIC of the node (8 x 12.5 = 100 GB/s on a DGX-2), and `concurrent`
  groups running the same collective at once share them (the suite's rule: 100 / k per group;
  `concurrent_groups` counts k from Megatron's layout), capped by NVLink.
- protocol refinements: ring LL x 1/4 (multi-node, all-reduce, reduce; else 1/3); ring LL128
  min(x 0.92, or 0.7 with < 2 ranks per node; per-channel caps); tree min(x 0.9, 80 GB/s beyond
  2 nodes, else 110), tree LL x 1/3.8, tree LL128 min(x 0.915 multi-node, caps x 7/9). LL128 only
  on Volta/Ampere with NVLink (`ll128`).
- algorithm bandwidth: ring busBw x nRanks / nsteps (all-reduce 2(n-1) steps, reduce-scatter and
  all-gather n-1, reduce and broadcast n); tree busBw x 0.5.
- latency: ring baseLat + (nsteps - nInterSteps) x intraLat + nInterSteps x interLat; reduce and
  broadcast nsteps x hwLat (Simple: the tree's hwLat, "chunk latency"); LL on multi-node
  intraLat x 1.8; tree baseLat + 2 x ((ppn - 1) x intraLat + log2(nNodes) x interLat).
- at prediction time: tree bandwidth x its correction factor below 2^28 bytes; ring Simple
  all-reduce across nodes x 1.9 latency ("plateau effect of ring") once nBytes >= nRanks/16 x 64 KiB.

NCCL 2.14.3 (`v2.14.3-1`, tuning.cc:56-77, 128-146, 357-372) differs in: tree NET Simple latency 28 us
(was 50), tree NVLink LL128 1.25; one LL128 cap per channel, 20 GB/s, for every collective; on
Ampere (`compute_capability` 80) the bus bandwidth capped at 235 GB/s, ring LL at llMaxBw (87.7 on
one node, 22.5 on two, 19.0 beyond), trees at 24 / 23.6 / 17.8 GB/s per channel; an all-reduce's
inter-node steps 2·nNodes; trees x 0.92 (LL128 on one node x 7/9, across nodes x 120/128); and
the tree is a candidate on one node too (NVLink chain: 2·(nRanks - 1) hops). The channel count on
one node is the GPU's links (NCCL's graph search on NVSwitch: 12 x 22 GB/s on an A100, 264 GB/s,
above the 235 cap). In 2.7.8 trees run only multi-node all-reduces (its intra-node tree is a
chain the tuner never prefers on NVSwitch). NCCL's graph search, which finds nChannels and
speeds on the real topology, is replaced by the link counts above.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import ceil, log2

PROTOCOLS = ("LL", "LL128", "Simple")
VERSIONS = ("2.7.8", "2.14.3")
# tuning.cc: latencies in us, [algorithm][protocol] (the same in both releases)
BASE_LAT = {"tree": {"LL": 4.4, "LL128": 4.4, "Simple": 0.0}, "ring": {"LL": 3.6, "LL128": 10.0, "Simple": 8.4}}
HW_LAT = {"nvlink": {"tree": {"LL": .52, "LL128": 1.2, "Simple": 28.0}, "ring": {"LL": .47, "LL128": 1.9, "Simple": 3.4}},
          "net": {"tree": {"LL": 5.0, "LL128": 8.5, "Simple": 50.0}, "ring": {"LL": 2.7, "LL128": 4.0, "Simple": 9.6}}}
HW_LAT_2_14 = {"nvlink": {"tree": {"LL": .52, "LL128": 1.25, "Simple": 28.0}, "ring": HW_LAT["nvlink"]["ring"]},
               "net": {"tree": {"LL": 5.0, "LL128": 8.5, "Simple": 28.0}, "ring": HW_LAT["net"]["ring"]}}
LL128_MAX_BW_PER_CHANNEL = {"broadcast": 18.8, "reduce": 12.0, "all_gather": 18.3, "reduce_scatter": 15.2, "all_reduce": 16.7}
# NCCL 2.14.3: one LL128 cap per channel; Ampere's caps, by nodes (1, 2, more)
LL128_MAX_BW_PER_CHANNEL_2_14 = 20.0
AMPERE_BUS_BW_CAP = 235.0
LL_MAX_BW_2_14 = {80: (87.7, 22.5, 19.0), 70: (39.0, 39.0, 20.4)}           # Intel hosts beyond one node
PER_CHANNEL_MAX_TREE_BW_2_14 = {80: (24.0, 23.6, 17.8), 70: (26.5, 18.5, 10.0)}
# tree bandwidth correction by log2(nBytes / 64), 64 B .. 128 MB, per protocol (LL, LL128, Simple)
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .5, .6, .6, .7, .7, .8, .9, .9, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7, .8, .9),
}
# 2.14.3: powers of two from 64 B to 256 MB
TREE_CORRECTION_2_14 = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
}
VERSION = "NCCL 2.7.8 (src/graph/tuning.cc)"


def _steps(kind: str, ranks: int, nodes: int, version: str = "2.7.8") -> tuple[int, int]:
    if kind == "all_reduce":
        inter = (2 * nodes if nodes > 1 else 0) if version == "2.14.3" else 2 * (nodes - 1)
        return 2 * (ranks - 1), inter
    if kind in ("reduce_scatter", "all_gather"):
        return ranks - 1, nodes - 1
    return ranks, nodes   # reduce, broadcast


@dataclass(frozen=True)
class Nccl:
    """CollectiveModel of a GPU cluster under NCCL 2.7.8's tuner (module docstring)."""

    nvlink_links: int
    nvlink_gb_per_s: float      # per link per direction, NCCL's width
    nics_per_node: int
    nic_gb_per_s: float         # per NIC per direction
    ll128: bool = True          # Volta/Ampere with NVLink
    latency_scale: float = 1.0  # every latency constant x this (the sensitivity table's knob; NCCL's own: 1)
    version: str = "2.7.8"      # VERSIONS: whose tuning.cc
    compute_capability: int = 70  # 70 Volta, 80 Ampere, 90 Hopper (2.14.3's Ampere refinements)

    def bus(self, ranks: int, nodes: int, concurrent: int) -> tuple[float, float]:
        """(bus bandwidth GB/s, nChannels) of one communicator."""
        intra = self.nvlink_links * self.nvlink_gb_per_s
        if nodes == 1:
            return intra, float(self.nvlink_links)
        bw = min(intra, self.nics_per_node * self.nic_gb_per_s / max(1, concurrent))
        return bw, bw / self.nic_gb_per_s

    def candidates(self, kind: str, nbytes: float, ranks: int, ranks_per_node: int,
                   concurrent: int = 1) -> dict[tuple[str, str], float]:
        """Predicted microseconds per (algorithm, protocol) NCCL would consider."""
        if self.version not in VERSIONS:
            raise ValueError(f"NCCL version {self.version!r}: one of {', '.join(VERSIONS)}")
        new = self.version == "2.14.3"
        nodes = nodes_of(ranks, ranks_per_node)
        ppn = ranks / nodes
        bus, channels = self.bus(ranks, nodes, concurrent)
        ampere = new and self.compute_capability == 80
        if ampere:
            bus = min(bus, AMPERE_BUS_BW_CAP)
        by_nodes = min(nodes, 3) - 1
        ll_max = LL_MAX_BW_2_14[80 if ampere else 70][by_nodes] if new else float("inf")
        tree_max = PER_CHANNEL_MAX_TREE_BW_2_14[80 if ampere else 70][by_nodes] * channels if new else float("inf")
        ll128_cap = (LL128_MAX_BW_PER_CHANNEL_2_14 if new else LL128_MAX_BW_PER_CHANNEL[kind]) * channels
        nsteps, inter_steps = _steps(kind, ranks, nodes, self.version)
        hw = "net" if nodes > 1 else "nvlink"
        hw_lat = HW_LAT_2_14 if new else HW_LAT
        out = {}
        algorithms = ("ring", "tree") if kind == "all_reduce" and (nodes > 1 or new) else ("ring",)
        for algo in algorithms:
            for proto in PROTOCOLS:
                if proto == "LL128" and not self.ll128:
                    continue
                bw = bus
                if algo == "ring" and proto == "LL":
                    bw = min(ll_max, bw * (1 / 4 if (nodes > 1 or kind in ("all_reduce", "reduce")) else 1 / 3))
                if algo == "ring" and proto == "LL128":
                    bw = min(bw * (0.7 if ppn < 2 else 0.92), ll128_cap)
                if algo == "tree" and new:
                    bw = min(bw * .92, tree_max)
                    if proto == "LL":
                        bw = min(bw / 3.8, ll_max)
                    if proto == "LL128":
                        bw = min(bw * (7 / 9 if nodes == 1 else 120 / 128), ll128_cap)
                elif algo == "tree":
                    bw = min(bw * .9, 80.0 if nodes > 2 else 110.0)
                    if proto == "LL":
                        bw *= 1 / 3.8
                    if proto == "LL128":
                        bw = min(bw * (7 / 9 if nodes == 1 else 0.915), ll128_cap * 7 / 9)
                bw *= ranks / nsteps if algo == "ring" else 0.5
                intra_lat, inter_lat = hw_lat["nvlink"][algo][proto], hw_lat["net"][algo][proto]
                if nodes > 1 and proto == "LL":
                    intra_lat *= 1.8
                lat = BASE_LAT[algo][proto]
                if algo == "ring" and kind in ("reduce", "broadcast"):
                    lat += nsteps * hw_lat[hw]["tree" if proto == "Simple" else "ring"][proto]
                elif algo == "ring":
                    lat += (nsteps - inter_steps) * intra_lat + inter_steps * inter_lat
                else:
                    lat += 2 * ((ranks // nodes - 1) * intra_lat + int(log2(nodes)) * inter_lat)
                if algo == "tree":
                    log_size = int(log2(max(1.0, nbytes / 64)))
                    table = TREE_CORRECTION_2_14 if new else TREE_CORRECTION
                    if log_size < len(table[proto]):
                        bw *= table[proto][log_size]
                if algo == "ring" and proto == "Simple" and nodes > 1 and kind == "all_reduce" \
                        and nbytes >= ranks / 16 * 65536:
                    lat *= 1.9
                out[(algo, proto)] = lat * self.latency_scale + nbytes / (1000 * bw)
        return out

    def choice(self, kind: str, nbytes: float, ranks: int, ranks_per_node: int,
               concurrent: int = 1) -> tuple[str, str, float]:
        """(algorithm, protocol, seconds) NCCL's tuner picks."""
        options = self.candidates(kind, nbytes, ranks, ranks_per_node, concurrent)
        (algo, proto), us = min(options.items(), key=lambda item: item[1])
        return algo, proto, us * 1e-6

    def time_s(self, kind: str, nbytes: float, ranks: int, ranks_per_node: int, concurrent: int = 1) -> float:
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        return self.choice(kind, nbytes, ranks, ranks_per_node, concurrent)[2]


def nodes_of(ranks: int, ranks_per_node: int) -> int:
    """The nodes a group of `ranks` spans, `ranks_per_node` of them on each."""
    return ceil(ranks / max(1, min(ranks, ranks_per_node)))


def concurrent_groups(group_size: int, stride: int, gpus: int, gpus_per_node: int) -> int:
    """The most groups of one kind that cross nodes from any one node, so share its NICs: groups
    of `group_size` ranks, members `stride` apart (TP: consecutive, stride 1; DP: stride = the MP
    degree; Megatron's layout), `gpus` ranks on nodes of `gpus_per_node` consecutive ranks.
    0 when every group fits in one node. MP 16 x DP 25 on DGX-2s: 16 DP groups leave each node;
    MP 128: one TP group spans 8 whole nodes, alone on their NICs."""
    if group_size <= 1:
        return 0
    step = group_size * stride           # a block of `step` ranks holds `stride` whole groups
    groups_of: dict[int, set] = {}
    for rank in range(gpus):
        block, pos = divmod(rank, step)
        groups_of.setdefault(rank // gpus_per_node, set()).add((block, pos % stride))
    nodes_of: dict = {}
    for node, groups in groups_of.items():
        for grp in groups:
            nodes_of.setdefault(grp, set()).add(node)
    return max((sum(len(nodes_of[grp]) > 1 for grp in groups) for groups in groups_of.values()), default=0)
