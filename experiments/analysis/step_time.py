"""Step-time model: seconds per training step, and TFLOPs per GPU, composed kernel by kernel and
collective by collective on a Hardware profile (hardware.py), for a system as it ran
(systems.py). Nothing here is fitted to the ZeRO paper's throughput: every constant is a
datasheet value, a source in hardware.SOURCES or systems.py, or a measurement (`make calibrate`).

Per GPU and per step, with g micro-batches accumulated:

- compute (kernels.py; torch_block.py for a pre-norm block in plain PyTorch, with a fused
  attention kernel at its measured rate, attention.py): the kernels of a micro-batch's forward, recomputed forward and
  backward, each max(FLOP time at the GEMM model's efficiency, bytes at HBM x the achievable
  fraction, x the system's torch fp16 rate for torch's fp16 kernels) + a per-kernel floor;
  split into GEMM, memory-bound and floor seconds; x g.
- TP comm: Megatron's all-reduces of the layer's T·h output, 2 in forward, 2 in the recomputed
  forward, 2 in backward per layer, plus the embedding's and the logits' input gradient (T·h)
  and the cross entropy's three T-float all-reduces; each costed by the CollectiveModel over the
  TP group (NCCL 2.7.8 on the GPU profiles, nccl.py), blocking (on the critical path); x g.
- DP comm exposed (systems.py): the system's gradient collectives, all exposed unless it
  overlaps them with backward, where exposed = max(the last collective, their sum - the
  recomputed forward and backward of the micro-batch that produces them); the post-step
  parameter all-gathers (stages 1-2) exposed, except where the system waits for them in the next
  forward (System.param_gather_overlap, zero_repro with overlap_comm): then exposed = max(the
  first gather, their sum - that forward's compute), the first layer waiting for its bucket;
  stage 3's per-layer gathers (the root's once where the system keeps it) prefetched under the
  compute of their phase: gathers and reductions run in issue order on one stream, so the
  forward's gathers hide under the forward only (the first two, the root's and the first
  layer's, not), the backward's gathers and the reductions under the recomputed forward and the
  backward (the last reduction, for FSDP's per-unit plan the last two, not). FSDP (systems.
  fsdp_plan) gathers and reduce-scatters one unit per block and the root, every micro-batch.
  Only the part of a collective its CollectiveModel says compute can hide is hidden (a
  calibrated CPU host measures it: gloo shares the ranks' cores; NCCL: all). The gradient
  copies around them (flatten, divide, bucket copies) are memory-bound passes, counted in
  compute_memory_bound and kernel_floors.
- overlap contention: compute under an overlapped collective runs on the SMs NCCL's channels
  leave it (sm_share), so a phase takes max(its compute + the share x the overlapped seconds +
  its exposed edges, its collectives); the term is what that adds (overlapped).
- Pa: each layer's checkpoint all-gathered over the TP group before its recomputation; Pa+cpu:
  its partition to the host in forward and back in backward over PCIe; exposed.
- optimizer: Adam with fp32 masters, memory bound: per parameter updated (Ψ at stage 0, Ψ/N at
  1-3) the passes of the system's optimizer step (systems.py: Megatron-LM 2019's FP16_Optimizer,
  DeepSpeed 2020's ZeRO-2 step, this engine's fused AdamW as `make proxies` counts it), plus its
  kernels per parameter tensor and per step at the floor; with no system, a fused Adam's (systems.optimizer_bytes_per_param).

A system with a host model (System.host_s_per_kernel: every system but zero_repro) is priced
differently for its micro-batches (host_windows): the host issues each kernel and collective call
at a measured cost while the GPU runs ahead, until a host sync (System.host_syncs), so each
window between syncs takes about max(host, device). Megatron-DeepSpeed's layer syncs twice in
every forward (kernels.FUSED_LAYER_FORWARD_SYNCS): windows of a layer's forward, of its
recomputed forward with its backward, of the head's forward and of its backward. Megatron-LM 2019
on torch 1.1 copies the RNG state around every attention dropout and at every checkpoint
(systems.PAPER_STACK_HOST_SYNCS): a layer's forward is three windows, its backward one more, and
the copies add their PCIe time. DeepSpeed 2020's Megatron syncs around the forward and the
backward: two windows. Then kernel_floors is the host time the GPU waits for, sum max(0, host -
device), and the device terms are as above; the per-kernel floor goes.

TFLOPs/GPU use the suite's FLOP convention (Narayanan et al. 2021 Eq. 3, flops.py), not the
kernel FLOPs, so numbers compare with Megatron's and the paper's.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import ceil

from experiments.analysis.flops import layer_weights, model_flops_per_iteration
from experiments.analysis.hardware import Hardware, from_cluster, profile
from experiments.analysis.kernels import ATTENTION_DROPOUT, ComputeTime, LayerShape, compute_time
from experiments.analysis.layers import LAYERS, step_kernels
from experiments.analysis.nccl import Nccl, concurrent_groups, nodes_of
from experiments.analysis.systems import (RNG_STATE_BYTES, RNG_STATE_COPIES, SYSTEMS, DpPlan, System, dp_plan,
                                          optimizer_bytes_per_param, parameter_tensors, record_plan)

TERMS = ("compute_gemm", "compute_memory_bound", "kernel_floors", "tp_comm", "dp_comm_exposed", "overlap_contention",
         "pa", "offload", "optimizer")
PRECISION_BYTES = {"fp32": 4, "fp64": 8, "bf16": 2, "fp16": 2, "auto": 2}  # auto: half precision on GPUs
TP_ALLREDUCES_PER_LAYER = {True: 6, False: 4}  # with / without recomputation (Megatron's f and g)
LOSS_FLOATS_ALLREDUCED = 3                     # vocab-parallel cross entropy: max, sum of exp, target logit


@dataclass(frozen=True)
class StepInputs:
    """What the model needs of one training point."""

    layers: int
    hidden: int
    heads: int
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
    overlap: bool | None = None  # gradient collectives during backward; None: the system's default
    reduce_bucket: float = 4e7   # zero_repro's buckets (elements); the other systems have their own
    allgather_bucket: float = 4e7
    pa: bool = False            # ZeRO-R partitioned activation checkpoints
    pa_cpu: bool = False        # ... offloaded to the host
    engine_counts: dict | None = None  # a record's comm.by_purpose: replaces the system's DP formula
    # the block's shape options (kernels.LayerShape; a system with the torch_block layer reads them)
    ffn_hidden: int = 0         # 0: 4 x hidden
    kv_heads: int = 0           # 0: heads
    bias: bool = True
    swiglu: bool = False
    rmsnorm: bool = False
    rotary: bool = False
    tied: bool = True
    attention: str | None = None     # "unfused" or a kernel of attention.MEASURED; None: the system's
    reduce_bytes: int | None = None  # bytes per gradient element reduced (FSDP's reduce dtype); None: element_bytes

    @property
    def gpus(self) -> int:
        return self.tp * self.dp

    def shape(self, attention: str = "unfused", fused_loss: bool = False) -> LayerShape:
        """The per-GPU shape; `attention` and `fused_loss`: the system's kernels (the point's
        attention where it names one)."""
        return LayerShape(self.micro_batch, self.seq_len, self.hidden, self.heads, self.tp, self.vocab,
                          self.element_bytes, self.ffn_hidden, self.kv_heads, self.bias, self.swiglu, self.rmsnorm,
                          self.rotary, self.tied, self.attention or attention, fused_loss)


@dataclass(frozen=True)
class StepTime:
    """A predicted step: seconds by term (TERMS), the throughput they give, and how."""

    terms: dict[str, float]
    flops_per_gpu: float
    hardware: str
    system: str
    details: dict = field(default_factory=dict)

    @property
    def step_s(self) -> float:
        return sum(self.terms.values())

    @property
    def tflops_per_gpu(self) -> float:
        return self.flops_per_gpu / self.step_s / 1e12

    def dominant(self) -> str:
        return max(self.terms, key=self.terms.get)

    def as_dict(self) -> dict:
        return {"step_s": self.step_s, "tflops_per_gpu_predicted": self.tflops_per_gpu,
                "terms": dict(self.terms), "dominant": self.dominant(), "hardware": self.hardware,
                "system": self.system, **self.details}


# -- groups on nodes (Megatron's layout: TP groups consecutive ranks, DP groups stride by MP) ---
def tp_group(x: StepInputs, hw: Hardware) -> tuple[int, int, int]:
    """(ranks, ranks per node, concurrent groups sharing a node's NICs) of a TP group."""
    return x.tp, min(x.tp, hw.gpus_per_node), concurrent_groups(x.tp, 1, x.gpus, hw.gpus_per_node)


def dp_group(x: StepInputs, hw: Hardware) -> tuple[int, int, int]:
    per_node = max(1, min(x.dp, hw.gpus_per_node // x.tp)) if x.tp < hw.gpus_per_node else 1
    return x.dp, per_node, concurrent_groups(x.dp, x.tp, x.gpus, hw.gpus_per_node)


def _collective(hw: Hardware, kind: str, nbytes: float, group: tuple[int, int, int]) -> float:
    ranks, per_node, concurrent = group
    return 0.0 if ranks <= 1 else hw.collectives.time_s(kind, nbytes, ranks, per_node, max(1, concurrent))


# -- terms ------------------------------------------------------------------------------------
def flops_per_gpu(x: StepInputs) -> float:
    """Model FLOPs one GPU executes per optimizer step, Eq. 3 (its replica's, split over TP)."""
    weights = layer_weights(x.hidden, x.heads, x.kv_heads or None, x.ffn_hidden or None, x.swiglu)
    return model_flops_per_iteration(batch=x.micro_batch * x.grad_accum, seq_len=x.seq_len, layers=x.layers,
                                     hidden=x.hidden, vocab=x.vocab, recompute=x.recompute,
                                     weights_per_layer=weights) / x.tp


def resolve_system(system: str | System) -> System:
    """A system by name (systems.SYSTEMS), or a System as given (a variant: the sensitivity
    table moves its constants)."""
    if isinstance(system, System):
        return system
    if system not in SYSTEMS:
        raise ValueError(f"system={system!r}: one of {', '.join(SYSTEMS)}")
    return SYSTEMS[system]


def half_load_fraction(x: StepInputs, system: str | System | None) -> float:
    """The fraction of the streaming rate the system's torch fp16 kernels reach at x's precision."""
    return resolve_system(system).scalar_half_load_fraction if system is not None and x.element_bytes == 2 else 1.0


def micro_batch_compute(x: StepInputs, hw: Hardware, system: str | System | None = None) -> dict[str, ComputeTime]:
    """One micro-batch's kernels by phase (forward, recompute, backward), as `system` runs them."""
    fraction = half_load_fraction(x, system)
    layer, shape = layer_shape(x, system)
    return {phase: compute_time(kernels, hw, fraction)
            for phase, kernels in step_kernels(shape, x.layers, x.recompute, layer).items()}


def layer_shape(x: StepInputs, system: str | System | None) -> tuple[str, LayerShape]:
    """Whose layer `system` runs (layers.LAYERS; Megatron-LM 2019's with no system) and x's
    per-GPU shape with the attention kernel the point or else the system names."""
    if system is None:
        layer, shape = "megatron2019", x.shape()
    else:
        sys = resolve_system(system)
        layer, shape = sys.layer, x.shape(sys.attention, sys.fused_loss)
    if layer != "torch_block" and not gpt2_block(shape):   # Megatron's lists are GPT-2's block only
        layer = "torch_block"
    return layer, shape


def gpt2_block(shape: LayerShape) -> bool:
    """Whether the shape is GPT-2's block (Megatron's kernel lists); another (no biases, a gated
    MLP, GQA, RMSNorm, rotary positions, an untied output layer, an MLP other than 4h) is priced
    with torch_block's list."""
    return (shape.bias and not shape.swiglu and not shape.rmsnorm and not shape.rotary and shape.tied
            and shape.ffn == 4 * shape.hidden and shape.kv == shape.heads)


def tp_allreduce_s(x: StepInputs, hw: Hardware) -> float:
    """One of Megatron's TP all-reduces of a layer's T·h output."""
    if x.tp <= 1:
        return 0.0
    return _collective(hw, "all_reduce", x.seq_len * x.micro_batch * x.hidden * x.element_bytes, tp_group(x, hw))


def tp_head_s(x: StepInputs, hw: Hardware) -> float:
    """The head's TP all-reduces: the embedding's output and the logits' input gradient (T·h),
    and the cross entropy's three of T floats."""
    if x.tp <= 1:
        return 0.0
    return 2 * tp_allreduce_s(x, hw) \
        + LOSS_FLOATS_ALLREDUCED * _collective(hw, "all_reduce", x.seq_len * x.micro_batch * 4, tp_group(x, hw))


def tp_comm_s(x: StepInputs, hw: Hardware) -> float:
    """One micro-batch's Megatron all-reduces (module docstring)."""
    return x.layers * TP_ALLREDUCES_PER_LAYER[x.recompute] * tp_allreduce_s(x, hw) + tp_head_s(x, hw)


def window_s(launches: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(wall, host, device) seconds of one window between host syncs: launches in issue order,
    each (host seconds to issue it, device seconds to run it). The host issues launch i when its
    cost has elapsed; the GPU starts it at max(that moment, the end of launch i - 1); the window
    ends when both are done (the sync)."""
    host = device_end = device = 0.0
    for host_cost, run in launches:
        host += host_cost
        device_end = max(host, device_end) + run
        device += run
    return max(host, device_end), host, device


def host_windows(x: StepInputs, hw: Hardware, system: System) -> dict[str, float]:
    """One micro-batch under a system's host model (module docstring): each window's launches
    (every kernel at host_s_per_kernel, every TP all-reduce call at host_s_per_collective and its
    NCCL time) through window_s; returns the host, device and wall seconds, and `exposed_s`,
    wall - device: the time the GPU waits for the host."""
    layer, shape = layer_shape(x, system)
    forward, backward, head_fwd, head_bwd = LAYERS[layer]
    fraction = half_load_fraction(x, system)
    group = tp_group(x, hw)

    def launches(kernels: list) -> list[tuple[float, float]]:
        out = []
        for k in kernels:
            if k.all_reduce_bytes:
                out.append((system.host_s_per_collective, _collective(hw, "all_reduce", k.all_reduce_bytes, group)))
            elif k.count:
                device, _ = k.times(hw, fraction)
                out += [(system.host_s_per_kernel, device / k.count)] * k.count
        return out
    layer_fwd = forward(shape)
    fwd, bwd = launches(layer_fwd), launches(backward(shape))
    head_f, head_b = launches(head_fwd(shape)), launches(head_bwd(shape))
    syncs = "layer" if x.pa_cpu and system.host_syncs == "forward_backward" else system.host_syncs
    copies_s = 0.0
    if syncs == "forward_backward":   # the training loop's timers: the forward, then the backward
        layers_backward = (fwd + bwd) * x.layers if x.recompute else bwd * x.layers
        windows = [(window_s(fwd * x.layers + head_f), 1), (window_s(head_b + layers_backward), 1)]
    else:
        if syncs == "layer":   # the layer's syncs close a window per layer's forward
            forward_windows = [(window_s(fwd), x.layers)]
        else:   # the RNG tracker's fork syncs before and after the attention dropout: three windows
            cut = next(i for i, k in enumerate(layer_fwd) if k.name == ATTENTION_DROPOUT)
            forward_windows = [(window_s(launches(part)), x.layers)
                               for part in (layer_fwd[:cut], layer_fwd[cut:cut + 1], layer_fwd[cut + 1:])]
            copies_s = x.layers * RNG_STATE_COPIES[x.recompute] * RNG_STATE_BYTES / hw.pcie_bytes_per_s
        # with recomputation each layer's recomputed forward syncs as its forward does, and its
        # backward shares the last window ("layer") or, where the checkpoint sets the RNG state
        # between them, has its own ("rng_state"); without, the backward has no sync: one window
        windows = list(forward_windows)
        if not x.recompute:
            windows += [(window_s(bwd * x.layers), 1)]
        elif syncs == "layer":
            windows += [(window_s(fwd + bwd), x.layers)]
        else:
            windows += forward_windows + [(window_s(bwd), x.layers)]
        windows += [(window_s(head_f), 1), (window_s(head_b), 1)]
    wall, host, device = (sum(w[i] * n for w, n in windows) for i in range(3))
    wall += copies_s   # each copy blocks the host on a drained GPU
    return {"host_s": host, "device_s": device, "wall_s": wall, "exposed_s": wall - device, "rng_copies_s": copies_s}


def pa_s(x: StepInputs, hw: Hardware) -> float:
    """Pa: each layer's checkpoint (T·h, 1/t per MP rank) all-gathered once per backward."""
    if not x.pa or x.tp <= 1:
        return 0.0
    return x.layers * _collective(hw, "all_gather", x.seq_len * x.micro_batch * x.hidden * x.element_bytes,
                                  tp_group(x, hw))


def offload_s(x: StepInputs, hw: Hardware) -> float:
    """Pa+cpu: each layer's checkpoint partition to the host in forward and back in backward."""
    if not x.pa_cpu:
        return 0.0
    partition = x.seq_len * x.micro_batch * x.hidden * x.element_bytes / (x.tp if x.pa else 1)
    return x.layers * 2 * partition / hw.pcie_bytes_per_s


def optimizer_s(x: StepInputs, hw: Hardware, system: str | System | None = None) -> float:
    partitioned = not (x.stage == 0 or x.dp <= 1)
    updated = x.psi / x.dp if partitioned else x.psi
    sys = None if system is None else resolve_system(system)
    if sys is None or sys.optimizer is None:
        return updated * optimizer_bytes_per_param(x.element_bytes) / hw.stream_bytes_per_s
    step = sys.optimizer(x.element_bytes, x.stage)
    tensors = parameter_tensors(x.layers)
    # FSDP shards every tensor over every rank: each holds a piece of each
    updated_tensors = ceil(tensors / x.dp) if partitioned and not sys.fsdp else tensors
    half = half_load_fraction(x, sys)

    def seconds(passes: dict[str, int], elements: float) -> float:
        return sum(b * elements / (hw.stream_bytes_per_s * (half if name in step.half_passes else 1.0))
                   for name, b in passes.items())
    kernels = (tensors * step.kernels_per_local_tensor + updated_tensors * step.kernels_per_updated_tensor
               + step.kernels_per_step)
    return seconds(step.local_passes, x.psi) + seconds(step.updated_passes, updated) + kernels * hw.kernel_floor_s


def root_elements(x: StepInputs) -> float:
    """The parameters one TP rank holds outside the layers (stage 3's root unit): its 1/t of the
    word embeddings (and of an untied output layer), the learned position embeddings and the
    final norm."""
    words = x.vocab * x.hidden / x.tp * (1 if x.tied else 2)
    return words + (0 if x.rotary else x.seq_len * x.hidden) + (1 if x.rmsnorm else 2) * x.hidden   # megatron's LayerNorm keeps its bias


def plan(x: StepInputs, system: str | System) -> DpPlan:
    sys = resolve_system(system)
    if x.engine_counts is not None:
        return record_plan(sys, x.engine_counts, x.stage, x.grad_accum, x.element_bytes, x.psi, x.layers)
    return dp_plan(sys, psi=x.psi, dp=x.dp, stage=x.stage, layers=x.layers, element_bytes=x.element_bytes,
                   grad_accum=x.grad_accum, reduce_bucket=x.reduce_bucket, allgather_bucket=x.allgather_bucket,
                   root=min(root_elements(x), x.psi), reduce_bytes=x.reduce_bytes)


def hideable(hw: Hardware, calls: tuple[tuple[str, float], ...], seconds: list[float],
             group: tuple[int, int, int]) -> tuple[list[float], float]:
    """calls' `seconds` split by what concurrent compute can hide: (each call's hideable seconds,
    the seconds no compute hides). The collective model's measured fraction where it has one
    (a calibrated CPU host: gloo works on the cores the ranks compute on, calibrated.py), else
    all of it (a GPU: NCCL moves bytes beside the SMs' compute)."""
    fraction = getattr(hw.collectives, "hidden_fraction", None)
    hidden, core = [], 0.0
    for (kind, _), t in zip(calls, seconds):
        h = 1.0 if fraction is None or group[0] <= 1 else fraction(kind, group[0])
        hidden.append(h * t)
        core += (1.0 - h) * t
    return hidden, core


def sm_share(hw: Hardware, group: tuple[int, int, int]) -> float:
    """The fraction of the GPU's SMs a collective over `group` occupies while it runs: NCCL runs
    one CUDA block per channel ("reducing the number of channels also reduces the number of CUDA
    blocks used for communication, hence the impact on GPU computing resources": NCCL user guide,
    NCCL_MAX_NCHANNELS), each taken to hold one SM [assumption: NCCL's blocks may share an SM with
    compute], over the channels NCCL's tuner model counts (nccl.Nccl.bus: a GPU's NVLinks on one
    node, the node's NICs across nodes) [assumption: NCCL's graph search may open more, e.g. 24 on
    an NVSwitch A100 node, NVIDIA/nccl-tests#100]; 0 where the collectives are not NCCL's (a
    calibrated CPU host measures its own overlap)."""
    ranks, per_node, _ = group
    sms = getattr(hw.gemm, "sms", None)
    if ranks <= 1 or sms is None or not isinstance(hw.collectives, Nccl):
        return 0.0
    # the channels of one group alone on its NICs: groups sharing them share bandwidth, but each
    # communicator still runs its own blocks on every member GPU
    return min(1.0, hw.collectives.bus(ranks, nodes_of(ranks, per_node), 1)[1] / sms)


def overlapped(compute: float, comm: float, edge: float, share: float) -> tuple[float, float]:
    """(exposed, contention) seconds of collectives taking `comm` seconds in all, issued under
    `compute` seconds of kernels on one stream's order: `edge` of them (the first gather, the last
    reduction) have nothing to hide under, the rest hides where the compute lasts long enough:
    exposed = max(edge, comm - compute). While they overlap, the compute runs on the SMs NCCL
    leaves it (sm_share): the phase takes max(compute + share x the overlapped seconds + edge,
    comm), and contention is what that adds (0 where the collectives are the longer: the slowed
    compute still ends under them)."""
    if comm <= 0:
        return 0.0, 0.0
    exposed = max(edge, comm - compute)
    slowed = max(compute + share * min(comm - edge, compute) + edge, comm)
    return exposed, max(0.0, slowed - (compute + exposed))


def dp_comm(x: StepInputs, hw: Hardware, system: str | System, phases: dict[str, ComputeTime]) -> dict[str, float]:
    """Raw and exposed DP seconds per step under the system's overlap (module docstring), and the
    contention overlapped collectives add to their compute (overlapped). Of a collective issued
    under compute only its hideable part (hideable) can hide; the rest adds. Gathers and
    reductions run in issue order on one stream: the forward's gathers hide under the forward's
    compute only, the backward's gathers and the reductions under the recomputed forward and the
    backward."""
    p, group, sys = plan(x, system), dp_group(x, hw), resolve_system(system)
    share = sm_share(hw, group)
    overlap = sys.overlap if x.overlap is None else x.overlap
    grads = [_collective(hw, kind, nbytes, group) for kind, nbytes in p.grad_calls]
    after_calls = [_collective(hw, kind, nbytes, group) for kind, nbytes in p.param_calls_after_step]
    after = sum(after_calls)
    hid_grads, core_grads = hideable(hw, p.grad_calls, grads, group)
    hid_after, core_after = hideable(hw, p.param_calls_after_step, after_calls, group)
    forward = phases["forward"].total_s
    backward = phases["recompute"].total_s + phases["backward"].total_s
    # waited on by the next forward's modules: hidden behind its compute but the first bucket's (the embeddings')
    exposed_after, contention_after = after, 0.0
    if after_calls and sys.param_gather_overlap and overlap:
        exposed_after, contention_after = overlapped(forward, sum(hid_after), hid_after[0], share)
        exposed_after += core_after
    gathers = [_collective(hw, kind, nbytes, group) for kind, nbytes in p.param_calls_per_micro_batch]
    hid_gathers, core_gathers = hideable(hw, p.param_calls_per_micro_batch, gathers, group)
    # a reduction's last call cannot hide; a unit per call (FSDP): the first unit's too, the root's
    # reduced after it with only the embedding's backward between
    last_grads = (hid_grads[-2:] if sys.fsdp else hid_grads[-1:]) if overlap and grads else []
    if gathers:   # stage 3: each phase's gathers prefetched under its compute, the first two not
        nf = p.forward_gathers
        if overlap:
            exp_f, con_f = overlapped(forward, sum(hid_gathers[:nf]), sum(hid_gathers[:min(2, nf)]), share)
            exp_b, con_b = overlapped(backward, sum(hid_gathers[nf:]) + sum(hid_grads), sum(last_grads), share)
        else:   # every gather waited on where it is issued (async_op=False), gradients reduced after backward
            exp_f, con_f = sum(hid_gathers[:nf]), 0.0
            exp_b, con_b = sum(hid_gathers[nf:]) + sum(hid_grads), 0.0
        per_micro, contention = core_gathers + core_grads + exp_f + exp_b, con_f + con_b
    elif grads and overlap:
        exposed, contention = overlapped(backward, sum(hid_grads), sum(last_grads), share)
        per_micro = core_grads + exposed
    else:
        per_micro, contention = sum(grads), 0.0
    reductions = p.grad_reductions if (grads or gathers) else 0
    return {"grad_s": sum(grads) * p.grad_reductions, "param_s": after + sum(gathers) * x.grad_accum,
            "exposed_s": per_micro * reductions + exposed_after, "after_step_s": after,
            "after_step_exposed_s": exposed_after, "contention_s": contention * reductions + contention_after,
            "sm_share": share,
            "copy": ComputeTime(memory_bound_s=p.copy_bytes / (hw.stream_bytes_per_s * half_load_fraction(x, system))
                                * p.grad_reductions,
                                floors_s=p.copy_kernels * hw.kernel_floor_s * p.grad_reductions)}


def system_hardware(hw: Hardware, system: str | System) -> Hardware:
    """hw as `system`'s stack sees it: NCCL's cost model of its release, and where the system
    charges its step's kernels (the optimizer's and the gradient copies') at its host cost per
    kernel, that cost in place of the profile's kernel floor."""
    sys = resolve_system(system)
    if isinstance(hw.collectives, Nccl) and hw.collectives.version != sys.nccl:
        hw = replace(hw, collectives=replace(hw.collectives, version=sys.nccl))
    if sys.host_s_per_kernel is not None and sys.step_kernels_at_host_cost:
        hw = replace(hw, kernel_floor_s=sys.host_s_per_kernel)
    return hw


def predict(inputs: StepInputs, hardware: Hardware, system: str | System = "zero_repro") -> StepTime:
    """The step time of `inputs` on `hardware` run by `system` (a name of systems.SYSTEMS, or a
    System)."""
    x, hw, g = inputs, system_hardware(hardware, system), inputs.grad_accum
    sys = resolve_system(system)
    if x.stage not in sys.stages:
        raise ValueError(f"stage={x.stage} does not exist in system={sys.name} (stages {sys.stages})")
    phases = micro_batch_compute(x, hw, sys)
    micro = phases["forward"] + phases["recompute"] + phases["backward"]
    dp = dp_comm(x, hw, sys, phases)
    floors = g * micro.floors_s
    details = {}
    if sys.host_s_per_kernel is not None:
        host = host_windows(x, hw, sys)
        floors = g * host["exposed_s"]
        details = {"host_s": g * host["host_s"], "device_s": g * host["device_s"], "rng_copies_s": g * host["rng_copies_s"],
                   "host_s_per_kernel": sys.host_s_per_kernel, "host_s_per_collective": sys.host_s_per_collective}
    terms = {"compute_gemm": g * micro.gemm_s, "compute_memory_bound": g * micro.memory_bound_s + dp["copy"].memory_bound_s,
             "kernel_floors": floors + dp["copy"].floors_s, "tp_comm": g * tp_comm_s(x, hw),
             "dp_comm_exposed": dp["exposed_s"], "overlap_contention": dp["contention_s"],
             "pa": g * pa_s(x, hw), "offload": g * offload_s(x, hw),
             "optimizer": optimizer_s(x, hw, sys)}
    details |= {"dp_grad_s": dp["grad_s"], "dp_param_s": dp["param_s"],
                "dp_param_after_step_s": dp["after_step_s"], "dp_param_after_step_exposed_s": dp["after_step_exposed_s"],
                "dp_sm_share": dp["sm_share"],
                "recompute": x.recompute,
                "kernel_flops_per_gpu": g * micro.flops, "tp_group": tp_group(x, hw), "dp_group": dp_group(x, hw)}
    return StepTime(terms=terms, flops_per_gpu=flops_per_gpu(x), hardware=hw.name, system=sys.name, details=details)


# -- from the suite's points and records ------------------------------------------------------
def shape_inputs(model: dict, tp: int) -> dict:
    """A model config's shape fields (the GPT-2 defaults where it has no key: an older record):
    padded vocab and parameters per TP rank as megatron builds them, and the block's options."""
    from experiments.models.gpt_shape import GPTShape, padded_vocab_size, parameters_per_tp_rank
    options = {k: model[k] for k in ("ffn_hidden", "kv_heads", "bias", "position", "mlp", "norm", "tie_embeddings")
               if model.get(k) is not None}
    shape = GPTShape(model["layers"], model["hidden"], model["heads"], model["seq_len"], model["vocab_size"], **options)
    return {"layers": shape.layers, "hidden": shape.hidden, "heads": shape.heads, "seq_len": shape.seq_len,
            "vocab": padded_vocab_size(shape.vocab_size, tp), "psi": float(parameters_per_tp_rank(shape, tp)),
            "ffn_hidden": shape.ffn, "kv_heads": shape.query_groups, "bias": shape.bias, "swiglu": shape.mlp == "swiglu",
            "rmsnorm": shape.norm == "rmsnorm", "rotary": shape.position != "learned", "tied": shape.tie_embeddings}


def inputs_from_point(point, *, overlap: bool | None = None, pa: bool = False, pa_cpu: bool = False) -> StepInputs:
    """A Point (experiments/points.py) with ZeRO-R's flags; overlap None: the system's default,
    except that zero_repro takes the point's zero.overlap_comm (see point_inputs)."""
    zero = point.zero
    return StepInputs(**shape_inputs(point.model, point.tp), micro_batch=point.micro_batch, tp=point.tp,
                      dp=point.dp, stage=point.stage, recompute=point.train["recompute"],
                      grad_accum=point.train["grad_accum_steps"],
                      element_bytes=PRECISION_BYTES[point.train["precision"]], overlap=overlap,
                      reduce_bucket=float(zero.get("reduce_bucket_size", 4e7)),
                      allgather_bucket=float(zero.get("allgather_bucket_size", 4e7)), pa=pa, pa_cpu=pa_cpu)


def point_inputs(point, system: str = "zero_repro") -> StepInputs:
    """A Point as `system` would run it: this engine (zero_repro) with the point's own
    zero.overlap_comm and ZeRO-R switches (Pa, Pa+cpu); another system with its own overlap
    (predict.py and plan.py predict a point through this, so they agree)."""
    zero = point.zero
    return inputs_from_point(point, overlap=zero.get("overlap_comm", True) if system == "zero_repro" else None,
                             pa=bool(zero.get("partition_activations")), pa_cpu=bool(zero.get("cpu_checkpointing")))


def inputs_from_record(record: dict) -> StepInputs:
    """A result record (measured, CPU or GPU, or simulated): its config, precision, engine
    settings (overlap_comm, buckets, ZeRO-R's Pa and Pa+cpu) and its engine's DP counts
    (comm.by_purpose) when it has them; predicted with system zero_repro."""
    config = record["config"]
    zero = config.get("zero", {})
    precision = record.get("precision") or config.get("precision_resolved") or config["train"].get("precision", "auto")
    x = StepInputs(**shape_inputs(config["model"], record["tp"]), micro_batch=record["micro_batch"],
                   tp=record["tp"], dp=record["dp"], stage=record["stage"], recompute=config["train"]["recompute"],
                   grad_accum=config["train"]["grad_accum_steps"], element_bytes=PRECISION_BYTES.get(precision, 2),
                   overlap=bool(zero.get("overlap_comm", True)),
                   reduce_bucket=float(zero.get("reduce_bucket_size", 4e7)),
                   allgather_bucket=float(zero.get("allgather_bucket_size", 4e7)),
                   pa=bool(zero.get("partition_activations", False)), pa_cpu=bool(zero.get("cpu_checkpointing", False)))
    if record.get("params_per_gpu"):
        x = replace(x, psi=float(record["params_per_gpu"]))
    purposes = record.get("comm", {}).get("by_purpose")
    if purposes:
        x = replace(x, engine_counts=purposes)
    return x


def record_hardware(record: dict) -> Hardware | None:
    """The record's GPU profile: today's conf/cluster/<name>.yaml (older records predate some
    keys), else what the record carries; None for `local` (a calibrated profile is passed in)."""
    cluster = record.get("config", {}).get("cluster", {})
    return profile(cluster.get("name", "")) or from_cluster(cluster)


def predict_record(record: dict, hw: Hardware | None = None) -> StepTime | None:
    """The prediction for a record's point with this engine (zero_repro) on `hw`, or its
    cluster's profile (None when there is none, e.g. `local` CPU runs without calibration)."""
    hw = hw or record_hardware(record)
    return None if hw is None else predict(inputs_from_record(record), hw, "zero_repro")


def kernel_table(x: StepInputs, hw: Hardware, system: str | System | None = None) -> list[dict]:
    """One layer's and the head's kernels at x's per-GPU shape, with FLOPs, bytes and times on hw
    as `system` runs them (a TP all-reduce call: its buffer and NCCL's time over the TP group)."""
    rows, fraction = [], half_load_fraction(x, system)
    layer, shape = layer_shape(x, system)
    if system is not None:
        hw = system_hardware(hw, system)
    for phase, kernels in step_kernels(shape, 1, x.recompute, layer).items():
        for kernel, _ in kernels:
            device, floor = kernel.times(hw, fraction)
            if kernel.all_reduce_bytes:
                device = _collective(hw, "all_reduce", kernel.all_reduce_bytes, tp_group(x, hw))
            rows.append({"phase": phase, "kernel": kernel.name, "gflops": kernel.flops / 1e9,
                         "mb": (kernel.bytes or kernel.all_reduce_bytes) / 1e6,
                         "gemm_efficiency": hw.gemm.efficiency(*kernel.gemm) if kernel.gemm else None,
                         "us": (device + floor) * 1e6})
    return rows

