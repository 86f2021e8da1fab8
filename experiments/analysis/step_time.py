"""Step-time model: seconds per training step, and TFLOPs per GPU, from model FLOPs, the traffic
of each collective and the hardware's constants. Nothing here is fitted to the ZeRO paper's
throughput: every constant comes from a datasheet or an independent measurement (SOURCES), and
lives in the cluster config (conf/cluster/*.yaml).

Per GPU and per optimizer step, with s sequence length, b micro-batch, h hidden, L layers,
t tensor-parallel (MP) degree, N data-parallel degree, Ψ the parameters one TP rank holds,
e bytes per element (2 in fp16/bf16), g micro-batches accumulated per step:

- compute: model FLOPs per GPU (experiments/analysis/flops.py, Narayanan Eq. 3 with the
  recompute factor c = 4 when activations are recomputed) / (peak x achieved efficiency).
  The efficiency is Megatron-LM's single-V100 measurement (39 TFLOPs of 125, recompute
  counted), taken as constant over GEMM sizes (no size-dependent curve: none is sourced).
- tensor-parallel all-reduces (Megatron: 2 in forward, 2 in backward per layer, 2 more for the
  recomputed forward; 6 with recomputation, 4 without), each of s·b·h elements, as ring
  all-reduces over the TP group: 2(t-1)/t · s·b·h·e / bandwidth. The bandwidth is the GPU's
  NVLink/NVSwitch bandwidth per direction when the TP group fits in one node, else the node's
  InfiniBand divided among the rings leaving a node at once (links, below: with t > G a node
  holds one TP group's ring, so it gets the node's whole InfiniBand, capped by NVLink). Never
  overlapped: Megatron's all-reduces sit on the critical path.
  The embedding's and the loss's TP all-reduces (2 per step, and a few scalars) are omitted.
- data-parallel traffic per step, in the suite's counting convention (a reduce-scatter counts
  its full input, an all-gather its full output, an all-reduce twice its size, so every ring
  collective takes (N-1)/N · counted bytes / bandwidth): gradients 2Ψe (stage 0 all-reduce) or
  Ψe (stages 1-3 reduce-scatter; x g at stages 2-3), parameters Ψe (stages 1-2 all-gather after
  the step) or 2Ψe (stage 3, forward and backward gathers; x g). A record's engine counts
  (`comm.by_purpose`) replace the formula when present. The DP group uses NVLink/NVSwitch when
  it fits in one node, else the node's InfiniBand divided among the min(t, G) DP rings leaving
  each node at once (links, below: 100 GB/s for MP 1 on DGX-2 nodes, 6.25 GB/s at MP >= 16).
- overlap rule (stated, per system): the gradient reduction overlaps the backward pass (the
  recomputed forward and the backward, (c-1)/c of compute) only when the system launches it
  asynchronously during backward (PyTorch DDP, this suite's engine with overlap_comm);
  exposed = max(0, reduction - backward). Otherwise (Megatron-LM 2019's all-reduce after
  backward; DeepSpeed 2020's ZeRO, overlap_comm off by default) it is exposed in full. The
  parameter all-gather of stages 1-2 runs between the optimizer step and the next forward:
  always exposed. Stage 3's gathers are prefetched: exposed only beyond the step's compute.
- ZeRO-R, optional: Pa all-gathers each layer's checkpoint (s·b·h elements, partitioned over
  the t MP ranks) before it is recomputed, once per backward: L ring all-gathers over the TP
  group, exposed. Pa+cpu copies each rank's partition (s·b·h·e/t bytes) to the host in forward
  and back in backward: 2·L copies over PCIe, exposed (an upper bound: DeepSpeed can overlap
  part of it).
- optimizer: Adam with fp32 masters is memory-bandwidth bound. Per parameter it updates it reads
  the gradient (e), the fp32 master, momentum and variance (12) and writes them (12) and the
  model-precision copy (e, none in fp32 where the master is the parameter): 28 bytes at e = 2
  or e = 4. Parameters updated: Ψ at stage 0, Ψ/N at stages 1-3; time = bytes / HBM bandwidth.

step = compute + TP comm + Pa + offload + exposed DP comm + optimizer; TFLOPs/GPU = model FLOPs
per GPU / step. Latencies (per-hop α), kernel launches, data loading and allocator stalls are
not modelled; the efficiency carries whatever Megatron's one-GPU step already contained.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

import yaml

from experiments.analysis.flops import model_flops_per_iteration, recompute_factor

CONF_CLUSTER = Path(__file__).resolve().parents[2] / "conf" / "cluster"

SOURCES = {
    "dgx2_v100.peak_tflops": "125: NVIDIA Tesla V100 datasheet (SXM2/SXM3, fp16 tensor core, dense)",
    "dgx2_v100.achieved_efficiency": "0.312 = 39/125: Shoeybi et al. 2019 (Megatron-LM, arXiv 1909.08053), "
                                     "'a strong single GPU baseline that sustains 39 TeraFLOPs, which is 30% of "
                                     "peak FLOPs' (1.2B GPT on one V100, FLOPs counted with recomputation, "
                                     "their Appendix: 96·B·s·l·h²·(1 + s/6h + V/16lh))",
    "dgx2_v100.hbm_gb_per_s": "900: NVIDIA Tesla V100 datasheet (HBM2)",
    "dgx2_v100.intra_node_gb_per_s": "150 per direction per GPU: 6 NVLink2 links x 25 GB/s into the NVSwitch "
                                     "fabric (NVIDIA DGX-2 datasheet: 300 GB/s bidirectional per GPU; the ZeRO "
                                     "paper Sec 10.2: '300GB/sec per link (NVSwitch)')",
    "dgx2_v100.inter_node_gbps": "800 per node: 8 x 100 Gb/s EDR InfiniBand (ZeRO paper Sec 10.1 '800 Gbps "
                                 "internode'; DGX-2 datasheet): 100 GB/s per direction, shared by the rings "
                                 "leaving the node (6.25 GB/s each when all 16 GPUs send their own ring)",
    "dgx2_v100.pcie_gb_per_s": "12: PCIe gen3 x16 achievable host<->device copy rate (15.75 GB/s theoretical: "
                               "8 GT/s x 16 lanes x 128b/130b; the project's design notes take 12 as achievable)",
    "dgx_h100.peak_tflops": "989: NVIDIA H100 SXM datasheet (bf16/fp16 tensor core, dense; 1979 with sparsity)",
    "dgx_h100.achieved_efficiency": "0.47: NVIDIA Megatron-LM README, 'up to 47% Model FLOP Utilization (MFU) "
                                    "on H100 clusters' (GPT models 2B-462B)",
    "dgx_h100.hbm_gb_per_s": "3350: NVIDIA H100 SXM datasheet (HBM3, 3.35 TB/s)",
    "dgx_h100.intra_node_gb_per_s": "450 per direction: NVLink 4, 900 GB/s total per GPU (H100 datasheet)",
    "dgx_h100.inter_node_gbps": "3200 per node: 8 x 400 Gb/s NDR InfiniBand (DGX H100 datasheet): "
                                "400 GB/s per direction, 50 GB/s per ring when all 8 GPUs send their own",
    "dgx_h100.pcie_gb_per_s": "48: PCIe gen5 x16 (63 GB/s theoretical) x the same achievable ratio as gen3 (12/15.75)",
    "tp_allreduces_per_layer": "Megatron-LM (Shoeybi et al. 2019, Sec 3 and Fig. 4): f and g operators, 2 "
                               "all-reduces in forward and 2 in backward per layer; recomputation repeats the "
                               "forward's 2 (ZeRO paper Sec 8: '12 × seq length × hidden dim' per block)",
    "adam_bytes_per_param": "read gradient (e) + fp32 master, momentum, variance (12), write the three (12) + "
                            "the model-precision copy (e): 28 bytes at e = 2",
    "overlap.megatron": "Megatron-LM 2019 pretrain_gpt2.py backward_step: model.allreduce_params(...) after "
                        "backward (local DDP): not overlapped",
    "overlap.deepspeed_zero": "DeepSpeed 2020 ZeRO: overlap_comm default False "
                              "(deepspeed/runtime/zero/constants.py ZERO_OPTIMIZATION_OVERLAP_COMM_DEFAULT); the "
                              "paper's sweep configs (DeepSpeedExamples Megatron-LM/scripts/ds_zero2_config.json) "
                              "do not set it: not overlapped",
    "overlap.torch_ddp": "PyTorch DDP: bucketed all-reduce launched during backward (Li et al., VLDB 2020): "
                         "overlapped",
}

TP_ALLREDUCES_PER_LAYER = {True: 6, False: 4}  # with / without activation recomputation
IB_GBIT_PER_GBYTE = 8


@dataclass(frozen=True)
class Hardware:
    """One GPU's view of its cluster: the constants of conf/cluster/<name>.yaml."""

    name: str
    gpus_per_node: int
    peak_tflops: float          # dense half precision, per GPU
    achieved_efficiency: float  # fraction of peak a training step's FLOPs achieve
    hbm_gb_per_s: float
    intra_node_gb_per_s: float  # per GPU per direction
    inter_node_gbps: float      # per node, all NICs (Gbit/s)
    pcie_gb_per_s: float        # per GPU per direction, achievable

    FIELDS = ("gpus_per_node", "peak_tflops", "achieved_efficiency", "hbm_gb_per_s", "intra_node_gb_per_s",
              "inter_node_gbps", "pcie_gb_per_s")

    @property
    def inter_node_gb_per_s(self) -> float:
        """The node's InfiniBand, all NICs, per direction (GB/s)."""
        return self.inter_node_gbps / IB_GBIT_PER_GBYTE

    @property
    def inter_node_gb_per_s_per_gpu(self) -> float:
        """The GPU's share of its node's InfiniBand (GB/s): a ring's when every GPU of the node
        sends its own ring across nodes (DP at MP >= gpus_per_node)."""
        return self.inter_node_gb_per_s / self.gpus_per_node

    @classmethod
    def from_cluster(cls, cluster: dict | None) -> "Hardware | None":
        """From a cluster config (dict); None when it lacks a constant (the `local` cluster)."""
        if not cluster or any(cluster.get(k) is None for k in cls.FIELDS):
            return None
        return cls(name=cluster.get("name", "?"), **{k: cluster[k] for k in cls.FIELDS})


def load_cluster(name: str) -> dict | None:
    path = CONF_CLUSTER / f"{name}.yaml"
    if not path.exists():
        return None
    with open(path) as f:
        return yaml.safe_load(f)


def hardware(name: str) -> Hardware | None:
    """The constants of conf/cluster/<name>.yaml (None if it has none)."""
    return Hardware.from_cluster(load_cluster(name))


@dataclass(frozen=True)
class StepInputs:
    """What the model needs of one training point."""

    layers: int
    hidden: int
    seq_len: int
    vocab: int                  # padded, as the logit GEMM computes it
    micro_batch: int            # sequences per DP rank per micro-batch
    tp: int
    dp: int
    stage: int
    psi: float                  # parameters one TP rank holds (the DP collectives' Ψ)
    recompute: bool = True
    grad_accum: int = 1
    element_bytes: int = 2      # parameters, gradients, activations (2: fp16/bf16)
    overlap_grad_reduce: bool = False
    pa: bool = False            # ZeRO-R partitioned activation checkpoints
    pa_cpu: bool = False        # ... offloaded to the host
    dp_grad_bytes: float | None = None   # per step, engine counts (suite's convention); None: formula
    dp_param_bytes: float | None = None

    @property
    def gpus(self) -> int:
        return self.tp * self.dp


# -- collectives: ring algorithms, bandwidth terms only --------------------------------------
def ring_allreduce_s(nbytes: float, n: int, bytes_per_s: float) -> float:
    """Ring all-reduce of an nbytes tensor over n ranks: each sends 2(n-1)/n of it."""
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / bytes_per_s


def ring_reduce_scatter_s(nbytes: float, n: int, bytes_per_s: float) -> float:
    """Ring reduce-scatter of an nbytes input: each rank sends (n-1)/n of it."""
    return 0.0 if n <= 1 else (n - 1) / n * nbytes / bytes_per_s


def ring_allgather_s(nbytes: float, n: int, bytes_per_s: float) -> float:
    """Ring all-gather to an nbytes output: each rank sends (n-1)/n of it."""
    return 0.0 if n <= 1 else (n - 1) / n * nbytes / bytes_per_s


# -- links ------------------------------------------------------------------------------------
# A ring collective over n ranks (all-reduce, reduce-scatter, all-gather) moves the same bytes over
# every hop of its ring, so its bandwidth is its slowest hop's. Inside a node a hop is GPU to GPU
# over NVLink/NVSwitch (intra_node_gb_per_s, each GPU sending to one neighbour). Across nodes,
# NCCL orders a ring topology-first: a group's members on one node are visited one after
# another, so the ring leaves each node once (and enters once; InfiniBand is full duplex), and
# NCCL splits the ring into channels that go out through different NICs, so a ring alone on a
# node's NICs gets the node's whole InfiniBand (inter_node_gbps / 8, 100 GB/s on a DGX-2).
# Groups of one kind run their collectives at the same time (every TP group all-reduces the same
# layer; every DP group reduces the same gradients), so k rings leaving the same node share its
# NICs: each gets inter_node_gbps / 8 / k. Per ring: min(NVLink, node InfiniBand / k), with k
# the most rings of that kind leaving any one node (node_rings). In Megatron's layout (TP groups
# are consecutive ranks, DP groups stride by the MP degree t; a node holds G consecutive ranks):
# - DP groups: a node holds ranks of min(t, G) TP positions, each the member of its own DP
#   group, so k = min(t, G) once the DP group spans nodes. MP 1 x DP 128: one ring, 100 GB/s on a
#   DGX-2 (NVSwitch is 150); MP 16 x DP 25: 16 rings, 6.25 GB/s each; MP 128: 16 rings (each GPU
#   of a node in its own DP group), 6.25 GB/s.
# - TP groups with t > G: a TP group is t/G whole nodes, so k = 1: MP 128 over 8 DGX-2 nodes
#   runs its ring at 100 GB/s (the ring crosses 8 node boundaries, each through all 8 NICs).
# Since the G GPUs of a node split evenly among the k rings, the bound agrees with one that gives
# each GPU only its nearest NICs (1/G of the node's). Latency (α per hop, 2(n-1) hops per ring)
# and NCCL's achieved fraction of the links are not modelled: both are bounds from above.
def node_rings(group_size: int, stride: int, gpus: int, gpus_per_node: int) -> int:
    """The most rings of one kind leaving any one node: groups of `group_size` ranks, members
    `stride` apart (TP: consecutive, stride 1; DP: stride = the MP degree), `gpus` ranks on nodes
    of `gpus_per_node` consecutive ranks. 0 when every group fits in one node."""
    if group_size <= 1:
        return 0
    step = group_size * stride           # a block of `step` ranks holds `stride` whole groups
    groups_of = {}
    for rank in range(gpus):
        block, pos = divmod(rank, step)
        groups_of.setdefault(rank // gpus_per_node, set()).add((block, pos % stride))
    nodes_of: dict = {}
    for node, groups in groups_of.items():
        for grp in groups:
            nodes_of.setdefault(grp, set()).add(node)
    return max((sum(len(nodes_of[grp]) > 1 for grp in groups) for groups in groups_of.values()), default=0)


def _link(rings: int, hw: Hardware) -> tuple[float, str]:
    if rings == 0:
        return hw.intra_node_gb_per_s * 1e9, "NVLink/NVSwitch"
    per_ring = min(hw.intra_node_gb_per_s, hw.inter_node_gb_per_s / rings)
    return per_ring * 1e9, f"InfiniBand, {rings} ring{'s' if rings > 1 else ''}/node"


def tp_link(x: StepInputs, hw: Hardware) -> tuple[float, str]:
    """Bytes/s of one TP group's ring, and which link bounds it (see above)."""
    return _link(node_rings(x.tp, 1, x.gpus, hw.gpus_per_node), hw)


def dp_link(x: StepInputs, hw: Hardware) -> tuple[float, str]:
    """Bytes/s of one DP group's ring, and which link bounds it (see above)."""
    return _link(node_rings(x.dp, x.tp, x.gpus, hw.gpus_per_node), hw)


# -- terms ------------------------------------------------------------------------------------
def flops_per_gpu(x: StepInputs) -> float:
    """Model FLOPs one GPU executes per optimizer step (its replica's, split over TP)."""
    per_replica = model_flops_per_iteration(batch=x.micro_batch * x.grad_accum, seq_len=x.seq_len,
                                            layers=x.layers, hidden=x.hidden, vocab=x.vocab,
                                            recompute=x.recompute)
    return per_replica / x.tp


def compute_s(x: StepInputs, hw: Hardware) -> float:
    return flops_per_gpu(x) / (hw.peak_tflops * 1e12 * hw.achieved_efficiency)


def backward_s(x: StepInputs, hw: Hardware) -> float:
    """The part of compute during which gradients appear: recomputed forward + backward."""
    c = recompute_factor(x.recompute)
    return compute_s(x, hw) * (c - 1) / c


def tp_message_bytes(x: StepInputs) -> float:
    """One Megatron all-reduce: the layer's s·b·h output (or its gradient)."""
    return x.seq_len * x.micro_batch * x.hidden * x.element_bytes


def tp_comm_s(x: StepInputs, hw: Hardware) -> float:
    bw, _ = tp_link(x, hw)
    per_layer = TP_ALLREDUCES_PER_LAYER[x.recompute] * ring_allreduce_s(tp_message_bytes(x), x.tp, bw)
    return x.layers * per_layer * x.grad_accum


def pa_allgather_s(x: StepInputs, hw: Hardware) -> float:
    """Pa: each layer's checkpoint (s·b·h, 1/t per MP rank) all-gathered once per backward."""
    if not x.pa or x.tp <= 1:
        return 0.0
    bw, _ = tp_link(x, hw)
    return x.layers * ring_allgather_s(tp_message_bytes(x), x.tp, bw) * x.grad_accum


def offload_s(x: StepInputs, hw: Hardware) -> float:
    """Pa+cpu: each rank's checkpoint partition to the host in forward and back in backward."""
    if not x.pa_cpu:
        return 0.0
    partition = tp_message_bytes(x) / (x.tp if x.pa else 1)
    return x.layers * 2 * partition / (hw.pcie_gb_per_s * 1e9) * x.grad_accum


def dp_traffic_bytes(x: StepInputs) -> tuple[float, float]:
    """(gradient bytes, parameter bytes) per step in the suite's convention; the engine's counts
    when given."""
    if x.dp_grad_bytes is not None and x.dp_param_bytes is not None:
        return float(x.dp_grad_bytes), float(x.dp_param_bytes)
    if x.dp <= 1:
        return 0.0, 0.0
    e, psi, g = x.element_bytes, x.psi, x.grad_accum
    if x.stage == 0:
        return 2 * psi * e, 0.0           # all-reduce, counted twice its size
    if x.stage == 1:
        return psi * e, psi * e           # reduce-scatter once (full gradient buffer), all-gather
    if x.stage == 2:
        return g * psi * e, psi * e       # reduce-scatter every micro-batch, all-gather after the step
    return g * psi * e, 2 * g * psi * e   # stage 3: gathers in forward and backward


def dp_comm(x: StepInputs, hw: Hardware) -> dict[str, float]:
    """Raw and exposed DP seconds under the overlap rule (module docstring)."""
    bw, _ = dp_link(x, hw)
    grad_bytes, param_bytes = dp_traffic_bytes(x)
    grad_s = ring_reduce_scatter_s(grad_bytes, x.dp, bw)   # (N-1)/N · counted bytes, any ring collective
    param_s = ring_allgather_s(param_bytes, x.dp, bw)
    if x.stage == 3:
        exposed_params = max(0.0, param_s - compute_s(x, hw))  # prefetched under compute
        exposed = (max(0.0, grad_s + param_s - compute_s(x, hw)) if x.overlap_grad_reduce
                   else grad_s + exposed_params)
    else:
        exposed = (max(0.0, grad_s - backward_s(x, hw)) if x.overlap_grad_reduce else grad_s) + param_s
    return {"grad_s": grad_s, "param_s": param_s, "exposed_s": exposed}


def adam_bytes_per_param(element_bytes: int) -> int:
    """Gradient read + master/momentum/variance read and written + the model-precision copy."""
    return element_bytes + 24 + (element_bytes if element_bytes < 4 else 0)


def optimizer_s(x: StepInputs, hw: Hardware) -> float:
    updated = x.psi if x.stage == 0 or x.dp <= 1 else x.psi / x.dp
    return updated * adam_bytes_per_param(x.element_bytes) / (hw.hbm_gb_per_s * 1e9)


@dataclass(frozen=True)
class StepTime:
    """A predicted step: seconds by term, and the throughput they give."""

    compute_s: float
    tp_comm_s: float       # exposed (never overlapped)
    dp_comm_s: float       # exposed under the overlap rule
    pa_s: float
    offload_s: float
    optimizer_s: float
    dp_grad_s: float       # raw, before the overlap rule
    dp_param_s: float
    flops_per_gpu: float
    tp_link: str
    dp_link: str
    hardware: str

    @property
    def step_s(self) -> float:
        return self.compute_s + self.tp_comm_s + self.dp_comm_s + self.pa_s + self.offload_s + self.optimizer_s

    @property
    def tflops_per_gpu(self) -> float:
        return self.flops_per_gpu / self.step_s / 1e12

    def as_dict(self) -> dict:
        return {**asdict(self), "step_s": self.step_s, "tflops_per_gpu_predicted": self.tflops_per_gpu}


def predict(x: StepInputs, hw: Hardware) -> StepTime:
    dp = dp_comm(x, hw)
    return StepTime(compute_s=compute_s(x, hw), tp_comm_s=tp_comm_s(x, hw), dp_comm_s=dp["exposed_s"],
                    pa_s=pa_allgather_s(x, hw), offload_s=offload_s(x, hw), optimizer_s=optimizer_s(x, hw),
                    dp_grad_s=dp["grad_s"], dp_param_s=dp["param_s"], flops_per_gpu=flops_per_gpu(x),
                    tp_link=tp_link(x, hw)[1] if x.tp > 1 else "-",
                    dp_link=dp_link(x, hw)[1] if x.dp > 1 else "-", hardware=hw.name)


# -- from the suite's points and records ------------------------------------------------------
PRECISION_BYTES = {"fp32": 4, "fp64": 8, "bf16": 2, "fp16": 2, "auto": 2}  # auto: half precision on GPUs


def _shape_inputs(model: dict, tp: int) -> dict:
    from experiments.models.megatron_gpt import GPTShape, padded_vocab_size, parameters_per_tp_rank
    shape = GPTShape(model["layers"], model["hidden"], model["heads"], model["seq_len"], model["vocab_size"])
    return {"layers": shape.layers, "hidden": shape.hidden, "seq_len": shape.seq_len,
            "vocab": padded_vocab_size(shape.vocab_size, tp), "psi": float(parameters_per_tp_rank(shape, tp))}


def inputs_from_point(point, *, overlap_grad_reduce: bool | None = None, pa: bool = False,
                      pa_cpu: bool = False) -> StepInputs:
    """A Point (experiments/points.py) with the system's overlap and ZeRO-R flags; overlap
    defaults to the point's engine setting (zero.overlap_comm)."""
    overlap = point.zero.get("overlap_comm", True) if overlap_grad_reduce is None else overlap_grad_reduce
    return StepInputs(**_shape_inputs(point.model, point.tp), micro_batch=point.micro_batch, tp=point.tp,
                      dp=point.dp, stage=point.stage, recompute=point.train["recompute"],
                      grad_accum=point.train["grad_accum_steps"],
                      element_bytes=PRECISION_BYTES[point.train["precision"]], overlap_grad_reduce=overlap,
                      pa=pa, pa_cpu=pa_cpu)


def inputs_from_record(record: dict) -> StepInputs:
    """A result record (measured or simulated): its config (ZeRO-R's Pa and Pa+cpu from the engine
    knobs zero.partition_activations / zero.cpu_checkpointing when present), and its engine's DP
    traffic per step (comm.by_purpose: 'grads' and 'params') when the record has them."""
    config = record["config"]
    zero = config.get("zero", {})
    x = StepInputs(**_shape_inputs(config["model"], record["tp"]), micro_batch=record["micro_batch"],
                   tp=record["tp"], dp=record["dp"], stage=record["stage"], recompute=config["train"]["recompute"],
                   grad_accum=config["train"]["grad_accum_steps"],
                   element_bytes=PRECISION_BYTES.get(record.get("precision"), 2),
                   overlap_grad_reduce=zero.get("overlap_comm", True),
                   pa=bool(zero.get("partition_activations", False)), pa_cpu=bool(zero.get("cpu_checkpointing", False)))
    if record.get("params_per_gpu"):
        x = replace(x, psi=float(record["params_per_gpu"]))
    purposes = record.get("comm", {}).get("by_purpose")
    if purposes is not None:
        x = replace(x, dp_grad_bytes=float(purposes.get("grads", {}).get("bytes", 0)),
                    dp_param_bytes=float(purposes.get("params", {}).get("bytes", 0)))
    return x


def record_hardware(record: dict) -> Hardware | None:
    """The record's cluster constants: today's conf/cluster/<name>.yaml (older records predate
    some keys), else what the record carries."""
    cluster = record.get("config", {}).get("cluster", {})
    return hardware(cluster.get("name", "")) or Hardware.from_cluster(cluster)


def predict_record(record: dict, hw: Hardware | None = None) -> StepTime | None:
    """The prediction for a record's point on its cluster (None when the cluster has no constants,
    e.g. `local` CPU runs)."""
    hw = hw or record_hardware(record)
    return None if hw is None else predict(inputs_from_record(record), hw)
