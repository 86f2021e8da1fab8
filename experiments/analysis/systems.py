"""How each training system reduces gradients and gathers parameters across data parallelism,
and what of it hides under backward: the collectives of one step, as they ran.

- megatron2019: Megatron-LM Sept 2019 (`model/distributed.py` @ a1d04b79): after backward, the
  fp16 gradients are flattened into one buffer, divided by the DP size, all-reduced in one
  blocking `dist.all_reduce`, `torch.cuda.synchronize()`, and copied back. Nothing overlaps.
- deepspeed2020: DeepSpeed's ZeRO-2 of the paper (`deepspeed_zero_optimizer.py` @ 97787881,
  2020-06-29): gradients are copied into a 5e8-element bucket and divided by the DP size; each
  full bucket issues one `dist.reduce` per partition it overlaps (to that partition's owner) and
  waits on them. overlap_comm defaults to False (the paper's configs do not set it): the reduces
  block the backward. After the step the fp16 parameters come back by `dist.all_gather` over
  shards of at most 5e8 elements in all. No stage 3 in 2020.
- pytorch_ddp: PyTorch DDP (Li et al., VLDB 2020): gradients copied into 25 MB buckets, each
  all-reduced as soon as it is full, during backward, and copied back; only the last bucket
  (the first layers' gradients, ready when backward ends) cannot hide.
- zero_repro: this suite's engine with its defaults (zero_impl/config.py): a reduce-scatter per
  reduce_bucket_size bucket (an all-reduce at stage 0), launched as it fills when overlap_comm
  (the default), the post-step all-gather at stages 1-2 in allgather_bucket_size buckets, waited
  on by the next forward's modules (overlap_param_gather), and stage 3's per-layer gathers in
  forward and backward, prefetched under compute, the root unit gathered once (stage3_keep_root).

Each system's optimizer step, as its code ran it (OptimizerStep: passes over memory per element
and kernels per parameter tensor): Megatron-LM 2019's FP16_Optimizer walks the parameters one
tensor at a time (the paper's DDP baseline is assumed to step with it: Megatron's training loop
with torch DDP); DeepSpeed 2020's steps by stage, per-tensor overflow and norm checks before a
flat fused Adam; zero_repro steps its shard with torch's fused AdamW, as `make proxies`
counts it (zero_repro_step).

Each system but zero_repro has a host model (step_time.host_windows): the host issues its
layers' kernels at a cost per kernel while the GPU runs ahead of it, up to the next host sync.
Where the stacks sync is read from their code and the torch release they ran (HOST_SYNCS):
Megatron-DeepSpeed 2023's layer twice in every forward (kernels.FUSED_LAYER_FORWARD_SYNCS);
Megatron-LM 2019 on torch 1.1 around every layer's attention dropout and at its checkpoint,
copying the RNG state each time; DeepSpeed 2020's Megatron around the forward and the backward,
its timers' syncs (PAPER_STACK_HOST_SYNCS). The cost per kernel is the one measured on the
development set (PAPER_STACKS_HOST_S_PER_KERNEL).

A record of the suite's engine brings its own counts (calls and bytes per purpose): those
replace the formula.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import ceil
from typing import Callable

DDP_BUCKET_BYTES = 25 * 2 ** 20   # torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=25)
DEEPSPEED_BUCKET = 500_000_000    # reduce_bucket_size = allgather_bucket_size = 5e8 (DeepSpeed 2020 defaults)


@dataclass(frozen=True)
class System:
    """One system's DP path: which collectives, whether they hide under backward, and the
    gradient passes around them."""

    name: str
    label: str
    stages: tuple[int, ...]       # ZeRO stages it runs
    overlap: bool                 # default: gradient collectives launched during backward
    grad_copy_passes: int         # read+write passes over the local gradients per reduction
    source: str
    grad_copy_kernels_per_tensor: int     # of the copies: kernels per parameter tensor ...
    grad_copy_kernels_per_reduction: int  # ... and per reduction (flatten, divide)
    # the optimizer step: (element bytes, stage) -> its passes and kernels; None: a fused Adam's
    # count (optimizer_bytes_per_param)
    optimizer: Callable[[int, int], OptimizerStep] | None = None
    grad_copies_without_dp: bool = False  # the gradient copies run at DP 1 too
    # the fraction of the streaming rate its torch's fp16 kernels reach (kernels.py): scalar loads
    scalar_half_load_fraction: float = 1.0
    layer: str = "megatron2019"          # whose layer and head kernels (layers.LAYERS)
    nccl: str = "2.7.8"                  # the NCCL release of its stack (nccl.VERSIONS)
    # the host model (step_time.host_windows): seconds the host spends per kernel it issues and
    # per collective call, the GPU running ahead of it between host syncs; None: each kernel
    # costs the profile's additive kernel_floor_us instead (zero_repro)
    host_s_per_kernel: float | None = None
    host_s_per_collective: float = 0.0
    # with a host model, where the host syncs inside a micro-batch (HOST_SYNCS); no default
    host_syncs: str | None = None
    # with a host model: its step's kernels (optimizer, gradient copies) at its host cost per
    # kernel too; else at the profile's kernel floor, a plain loop's per-op cost
    step_kernels_at_host_cost: bool = False
    # the post-step parameter all-gathers (stages 1-2) are waited on by the next forward's modules
    # when overlap (megatron-core's overlap_param_gather): they hide behind that forward
    param_gather_overlap: bool = False
    # stage 3 keeps the root unit (what is not a layer: embeddings, final layernorm) gathered from
    # the end of forward to its backward: one gather of it a micro-batch, not two (FSDP2's root)
    stage3_keeps_root: bool = False
    # the attention kernel its layer runs where the point does not say (attention.py; "unfused":
    # the layer's own softmax path)
    attention: str = "unfused"
    fused_loss: bool = False   # its cross entropy one fused kernel each way (torch_block.head_forward)
    # FSDP: one unit per block and one for the root, each gathered whole and its gradients
    # reduce-scattered whole, once per micro-batch (dp_plan's fsdp branch)
    fsdp: bool = False

    def __post_init__(self) -> None:
        if self.host_s_per_kernel is not None and self.host_syncs not in HOST_SYNCS:
            raise ValueError(f"system {self.name}: a host model needs host_syncs, one of {list(HOST_SYNCS)}, "
                             f"got {self.host_syncs!r}")


def parameter_tensors(layers: int) -> int:
    """Megatron's GPT parameter tensors: per layer 2 layernorms, QKV, projection, MLP up and down
    (weight and bias each); the word and position embeddings (the logits reuse the word
    embedding) and the final layernorm."""
    return 12 * layers + 4


@dataclass(frozen=True)
class OptimizerStep:
    """One optimizer step's memory passes (bytes per element, by pass) and kernels: over every
    local gradient (Ψ per TP rank, all its tensors) and over the elements this rank updates (its
    partition at stages 1-3, Ψ at stage 0); the kernels are per parameter tensor of each and per
    step, host syncs counted as kernels (a D2H copy the GPU waits on)."""

    local_passes: dict[str, int]
    updated_passes: dict[str, int]
    half_passes: frozenset[str] = frozenset()   # the passes that touch fp16 only (torch's scalar loads)
    kernels_per_local_tensor: int = 0
    kernels_per_updated_tensor: int = 0
    kernels_per_step: int = 0


def optimizer_bytes_per_param(element_bytes: int) -> int:
    """Adam (gradient read, master/momentum/variance read and written, the model-precision copy
    written: none in fp32, where the master is the parameter) + the gradient-norm read, + the
    overflow check's read in half precision (loss scaling)."""
    half = element_bytes < 4
    return element_bytes + 24 + (element_bytes if half else 0) + element_bytes * (2 if half else 1)


# zero_repro's optimizer step (zero_impl/optimizer.py, torch's fused AdamW as experiments/run/build.py
# builds it on CUDA), as issue 30's engine runs it at stages 1-3: no host sync, and launches
# independent of the bucket count. Kernels a step, counted by the dispatch mode (make proxies:
# experiments/bench_proxies.py, results/reference/bench/proxies.md, whose fp32 rows read 9 at
# every stage; tests/zero_impl/test_step_dispatch.py counts every precision):
# 9 in fp32, 10 in bf16, 19 in fp16 (its loss scaling: the unscale, found_inf, the scale update).
# Bytes per owned element, pass by pass: fp32, the gradient norm's read 4 and fused AdamW's 28
# (gradient, parameter, m, v read; parameter, m, v written): 32; bf16 (gradients reduced into an
# fp32 shard), + the master copied back to bf16 (4 + 2): 38; fp16 (an fp16 shard), the norm's read
# 2, the cast to fp32 2 + 4, AdamW 28, the copy back 4 + 2: 42. The clip and the DP average are
# folded into AdamW's divisor (no pass). The model's element bytes do not tell bf16 from fp16:
# half precision takes fp16's count (the paper's V100 points; bf16 moves 4 B and 9 kernels less).
ZERO_REPRO_STEP_KERNELS = {4: 9, 2: 19}
ZERO_REPRO_STEP_PASSES = {4: {"gradient norm": 4, "fused AdamW": 28},
                          2: {"gradient norm (fp16)": 2, "gradient to fp32": 2 + 4, "fused AdamW": 28,
                              "master to the fp16 parameter": 4 + 2}}


def zero_repro_step(e: int, stage: int) -> OptimizerStep:
    """This engine's step on the elements it owns (ZERO_REPRO_STEP_PASSES, _KERNELS), e the
    model's element bytes (fp32: 4, half precision: 2)."""
    half = 4 if e >= 4 else 2
    return OptimizerStep({}, dict(ZERO_REPRO_STEP_PASSES[half]), kernels_per_step=ZERO_REPRO_STEP_KERNELS[half])


def fp16_optimizer_2019(e: int, stage: int) -> OptimizerStep:
    """Megatron-LM 2019's optimizer step (@ a1d04b79: fp16/fp16.py, fp16util.py, loss_scaler.py,
    mpu/grads.py; apex FusedAdam), one parameter tensor at a time, e the model's element bytes.
    Its zero_grad zeroes the gradients rather than dropping them, so backward's AccumulateGrad
    adds into them (torch 1.x accumulate_grad.cpp) instead of taking the new gradient. Per tensor:
    2 zero_, the accumulate, float, sum, copy, mul_, norm, Adam, copy, and the two host syncs
    (the overflow check's float(), the norm's .item()): 12. In fp32 there is no FP16_Optimizer:
    zero, accumulate, norm and its .item(), Adam: 5. The clip's mul_ (only when the norm exceeds
    --clip-grad) and the overflow and norm all-reduces over the MP group (a few bytes) are not
    counted."""
    if e >= 4:
        return OptimizerStep({}, {"zero_grad": 4, "AccumulateGrad into the zeroed grad": 12, "grad norm": 4,
                                  "FusedAdam": 28}, kernels_per_updated_tensor=5)
    return OptimizerStep({}, {"zero_grad: master grads": 4, "zero_grad: model grads": e,
                              "AccumulateGrad into the zeroed grad": 3 * e,
                              "overflow check: grad.float().sum()": e + 4 + 4,
                              "model grads to master grads": e + 4,
                              "unscale: master grad mul_": 8,
                              "grad norm: master grad norm": 4,
                              "FusedAdam: grad, master, m, v read, master, m, v written": 28,
                              "master params to model params": 4 + e},
                         half_passes=frozenset({"zero_grad: model grads", "AccumulateGrad into the zeroed grad"}),
                         kernels_per_updated_tensor=12)


def deepspeed_2020(e: int, stage: int) -> OptimizerStep:
    """DeepSpeed 2020's step (@ 97787881), by stage:

    - 0, pt/fp16_optimizer.py (step_fused_adam): the gradients flattened, one norm of the flat
      buffer as the overflow check, FusedAdam on the flat fp32 master writing the fp16 copy;
    - 1, pt/zero_optimizer_stage1.py (step): the overflow check (grad.float().sum(), a host sync)
      and the norm (grad.float().norm(), .item()) on every local gradient tensor, then its
      sub-partition's tensors converted to fp32 and flattened (get_flat_sub_partitions),
      unscaled, FusedAdam, copied to fp16;
    - 2, pt/deepspeed_zero_optimizer.py (step): the overflow check and the fp64 norm on each of
      its partition's gradient tensors, the flatten and fp32 conversion, the unscale-and-clip,
      FusedAdam on the flat fp32 partition, the fp16 partition copied back.

    The post-step all-gathers are DpPlan's."""
    if stage == 0:
        return OptimizerStep({}, {"flatten": 2 * e, "norm of the flat grads: float().norm()": e + 4 + 4,
                                  "FusedAdam: grad, master, m, v read, master, m, v, fp16 copy written": 24 + 2 * e},
                             half_passes=frozenset({"flatten"}), kernels_per_step=5)
    if stage == 1:
        return OptimizerStep({"overflow check: grad.float().sum()": e + 4 + 4, "grad norm: grad.float().norm()": e + 4 + 4},
                             {"to fp32, per tensor": e + 4, "flatten (fp32)": 8, "unscale and clip: mul_": 8,
                              "FusedAdam on the sub-partition": 28, "fp32 sub-partition to fp16": 4 + e},
                             kernels_per_local_tensor=6, kernels_per_step=5)
    return OptimizerStep({}, {"overflow check: grad.float().sum()": e + 4 + 4,
                              "grad norm: grad.double().norm()": e + 8 + 8,
                              "flatten": 2 * e, "to fp32": e + 4,
                              "unscale and clip: mul_": 8,
                              "FusedAdam on the flat partition": 28,
                              "fp32 partition to the fp16 partition": 4 + e},
                         half_passes=frozenset({"flatten"}), kernels_per_updated_tensor=6, kernels_per_step=5)


def megatron_float16_optimizer(e: int, stage: int) -> OptimizerStep:
    """Megatron-DeepSpeed 2023's Float16OptimizerWithFloat16Params (megatron/optimizer/optimizer.py
    @ f01c9e6e) over apex's FusedAdam: each parameter's fp16 main_grad up-cast to its fp32 master's
    grad (one kernel a tensor, a Python loop), the unscale and inf check
    (torch._amp_foreach_non_finite_check_and_unscale_), the norm (apex multi_tensor_l2norm), FusedAdam
    (multi_tensor_adam: grad, master, m, v read; master, m, v written), the masters copied back
    to the fp16 parameters (multi_tensor_scale) and the gradient buffer zeroed. The multi-tensor
    launches, the found-inf and norm all-reduces over the MP group and their two .item() syncs:
    12 kernels a step. The clip's scale (only when the norm exceeds --clip-grad) is not counted."""
    return OptimizerStep({}, {"main_grad to the fp32 master grad": e + 4, "unscale and inf check": 8,
                              "grad norm (multi_tensor_l2norm)": 4,
                              "FusedAdam: grad, master, m, v read, master, m, v written": 28,
                              "masters to the fp16 parameters": 4 + e, "gradient buffer zeroed": e},
                         kernels_per_updated_tensor=1, kernels_per_step=12)


# An Adam step written as torch ops, one pass each, bytes per fp32 element each pass reads and
# writes: the second moment (exp_avg_sq.mul_, addcmul_), the denominator (sqrt, the division by the
# bias correction, eps added) and param.addcdiv_; the first moment and the decay by optimizer below.
ADAM_SECOND_MOMENT_AND_UPDATE_PASSES = {"exp_avg_sq.mul_": 8, "exp_avg_sq.addcmul_(grad, grad)": 12, "sqrt": 8,
                                        "divide by the bias correction": 8, "add eps": 8, "param.addcdiv_": 16}


def composer_adamw(e: int, stage: int) -> OptimizerStep:
    """Composer's step under FSDP1 (llm-foundry's MPT configs: decoupled_adamw with weight decay
    0, gradient clipping by norm): FSDP's clip_grad_norm_ (each sharded gradient's norm read, the
    clip coefficient multiplied in) and DecoupledAdamW's per-tensor ops (composer/optim/
    decoupled_weight_decay.py: exp_avg.mul_ and add_, then ADAM_SECOND_MOMENT_AND_UPDATE_PASSES;
    no decay pass at weight decay 0), in fp32: FSDP keeps the shards and their gradients in the
    parameters' fp32 whatever the compute dtype. Kernels: per tensor the clip's norm and multiply
    and the 8 ops; per step the norms' sum, its all-reduce, the coefficient [assumption: 4]."""
    passes = {"clip: gradient norm": 4, "clip: gradient multiply": 8, "exp_avg.mul_": 8, "exp_avg.add_(grad)": 12,
              **ADAM_SECOND_MOMENT_AND_UPDATE_PASSES}
    return OptimizerStep({}, passes, kernels_per_updated_tensor=2 + 2 + len(ADAM_SECOND_MOMENT_AND_UPDATE_PASSES),
                         kernels_per_step=4)


def torch_adamw(e: int, stage: int) -> OptimizerStep:
    """torch.optim.AdamW with its defaults on CUDA (weight decay 0.01; the foreach path, one
    multi-tensor launch a pass: torch/optim/adamw.py, _multi_tensor_adamw): param.mul_ for the
    decay, exp_avg.lerp_, then ADAM_SECOND_MOMENT_AND_UPDATE_PASSES, as `make bench` steps FSDP2: no
    clipping."""
    passes = {"weight decay: param.mul_": 8, "exp_avg.lerp_(grad)": 12, **ADAM_SECOND_MOMENT_AND_UPDATE_PASSES}
    return OptimizerStep({}, passes, kernels_per_step=len(passes))


# Megatron-DeepSpeed 2023 on PyTorch 2.0.1 (the development set's stack, step_time.host_windows):
# host seconds per kernel its layer issues and per collective call, none derived from a scored
# file (experiments/reports/dev_set.py measured_constants; a test keeps these equal to it). Per
# kernel: megatron-core's layer timed on a CPU by this project (reports/host_ops.py --time,
# results/reference/bench/layer_host_time.csv: 2.993 ms of host time a micro-batch) over the 77
# kernels the model counts in a layer: a measurement. Per collective call: the same per-kernel
# cost, an assumption (the call is issued by the same layer code; no c10d call is timed here:
# the CPU proxy runs at TP 1). The single-node file's slopes give 39.9 and 48.1 us
# (validation_host_constants.md); neither is used (validation_loso_constants.md).
MEGATRON_DS2023_HOST_S_PER_KERNEL = 38.9e-6
MEGATRON_DS2023_HOST_S_PER_COLLECTIVE = MEGATRON_DS2023_HOST_S_PER_KERNEL

# Where a system with a host model syncs the host inside a micro-batch (step_time.host_windows):
# "layer": twice in every layer's forward, recomputed forward included (megatron_ds2023);
# "rng_state": torch 1.1's RNG state copies before and after every layer's attention dropout and
# at its checkpoint (below), which also syncs between the recomputed forward and the backward;
# "forward_backward": around the forward and around the backward (the training loop's timers),
# every layer only with Pa+cpu. Each also syncs around the forward and the backward.
HOST_SYNCS = ("layer", "rng_state", "forward_backward")

# The paper's stacks under the same host model. [assumption] Their host cost per kernel of a
# layer is megatron_ds2023's: it is the one measured host cost of Megatron's layer code on
# PyTorch, and no measurement of Python 3.6 with torch 1.1-1.2 on a DGX-2's Xeons exists to replace
# it. Their step's kernels, a per-tensor loop with two host syncs a tensor in FP16_Optimizer, stay
# at the profile's per-op floor (pytorch/pytorch#41383, 2020's torch: a lower bound for 2019's
# loop and its syncs): the layer's cost per kernel is not checked for a step's kernels
# (validation_host_constants.md), and the development set does not decide it (megatron_ds2023
# keeps its step at its host cost, as it was derived; at the floor its median error is lower,
# its 90th percentile and TP 8's median ratio worse). They carry no cost per collective call:
# Megatron-LM 2019's kernel lists (kernels.py) price its TP all-reduces as device time, and no
# call is issued through the host model.
PAPER_STACKS_HOST_S_PER_KERNEL = MEGATRON_DS2023_HOST_S_PER_KERNEL
# Where the paper's stacks sync. Megatron-LM @ a1d04b79 builds on nvcr.io/nvidia/pytorch:19.05-py3
# (docker/Dockerfile), a May 2019 torch, and its authors asked for torch 1.1 (NVIDIA/Megatron-LM#7,
# 2019-09-10). That torch keeps the CUDA generator's 200 MTGP32 states on the device:
# torch.cuda.get_rng_state() copies them to the host with a blocking cudaMemcpy and
# set_rng_state copies them back from pageable memory, which syncs first (THCTensorRandom.cu,
# THCRandom_getRNGState / _setRNGState), until pytorch/pytorch#21301 (the resubmission of #20886,
# June 2019, in torch 1.2) stopped copying them. Megatron's checkpoint gets the state in every
# checkpointed layer's forward and backward and sets it twice in the backward (mpu/random.py:198,
# 215, 220, 230), and its tracker gets and sets it twice around every layer's attention dropout
# (mpu/transformer.py:140, random.py:125-135): RNG_STATE_COPIES a layer. Its timers sync around
# the forward and the backward (pretrain_gpt2.py:327-334, utils.py:111, 118). The copies are
# priced at the profile's PCIe rate, a pinned copy's: these are pageable and each a blocking call,
# so that is a lower bound (the sensitivity table moves the rate). DeepSpeed @ 97787881
# pins torch 1.2.0 (Dockerfile), where those calls copy nothing, and its checkpoint_boundary
# synchronize defaults to False; its Megatron (DeepSpeedExamples @ fd6fb514, Megatron-LM/
# pretrain_gpt2.py:366-375) times the forward and the backward with timers that call
# torch.cuda.synchronize() (utils.py:82, 89), and with Pa+cpu every layer's partition.cpu() syncs
# (deepspeed_checkpointing.py:409). [assumption] The paper's Megatron and DDP baselines ran
# Megatron-LM's own stack (torch 1.1), its ZeRO runs DeepSpeed's.
PAPER_STACK_HOST_SYNCS = {"megatron2019": "rng_state", "pytorch_ddp": "rng_state", "deepspeed2020": "forward_backward"}
# torch 1.1's CUDA RNG state on the device: 200 curandStateMtgp32 of 4,120 B (MAX_NUM_BLOCKS in
# THCTensorRandom.cu; the state tensor is 824,016 B with its 16 B of seed and offset,
# pytorch/pytorch#20843). Copies of it a layer and micro-batch, with recomputation: the forward's
# get and the dropout's get, set, get, set; the backward's get, set, the recomputed dropout's four,
# set (6 to the host, 6 back); without: the dropout's four.
RNG_STATE_BYTES = 200 * 4120
RNG_STATE_COPIES = {True: 12, False: 4}


# torch <= 1.4's fp16 kernels: "we typically see half operations go at ~80% of fp32 rate"
# (N. Gimelshein, pytorch/pytorch#22612, 2019-07-15, of the pointwise kernels, which loaded one
# element per access; torch 1.5, April 2020, vectorized its elementwise loop, pytorch/pytorch#32383).
# [assumption] Applied to every torch kernel whose operands are all fp16 (softmax, the
# reductions, the index kernels too), not to apex's layernorm or to mixed fp16/fp32 passes.
# [assumption] The paper's systems ran torch <= 1.4: DeepSpeed @ 97787881's Dockerfile pins
# torch 1.2.0, and Megatron-LM @ a1d04b79 is of October 2019. zero_repro runs this suite's torch.
TORCH_1_4_SCALAR_HALF_LOADS = 0.8


SYSTEMS = {
    "megatron2019": System("megatron2019", "Megatron-LM 2019", (0,), False, 3,
                           "Megatron-LM model/distributed.py @ a1d04b79: flatten, divide, one blocking all_reduce "
                           "after backward, copy back one tensor at a time (at DP 1 too); FP16_Optimizer",
                           1, 2, fp16_optimizer_2019, grad_copies_without_dp=True,
                           scalar_half_load_fraction=TORCH_1_4_SCALAR_HALF_LOADS,
                           host_s_per_kernel=PAPER_STACKS_HOST_S_PER_KERNEL,
                           host_syncs=PAPER_STACK_HOST_SYNCS["megatron2019"]),
    "deepspeed2020": System("deepspeed2020", "ZeRO-100B (DeepSpeed 2020)", (0, 1, 2), False, 2,
                            "DeepSpeed deepspeed_zero_optimizer.py @ 97787881: bucket copy and divide, one "
                            "dist.reduce per partition a 5e8 bucket overlaps; overlap_comm False; all_gather after "
                            "the step", 1, 1, deepspeed_2020, scalar_half_load_fraction=TORCH_1_4_SCALAR_HALF_LOADS,
                            host_s_per_kernel=PAPER_STACKS_HOST_S_PER_KERNEL,
                            host_syncs=PAPER_STACK_HOST_SYNCS["deepspeed2020"]),
    "pytorch_ddp": System("pytorch_ddp", "PyTorch DDP", (0,), True, 2,
                          "PyTorch DDP (Li et al., VLDB 2020): 25 MB buckets, each gradient copied in and out, "
                          "all-reduced during backward; stepped by Megatron-LM 2019's FP16_Optimizer [assumption: "
                          "the paper's DDP baseline ran Megatron's training loop with torch DDP]",
                          2, 0, fp16_optimizer_2019, scalar_half_load_fraction=TORCH_1_4_SCALAR_HALF_LOADS,
                          host_s_per_kernel=PAPER_STACKS_HOST_S_PER_KERNEL,
                          host_syncs=PAPER_STACK_HOST_SYNCS["pytorch_ddp"]),
    "megatron_ds2023": System("megatron_ds2023", "Megatron-DeepSpeed 2023", (0,), False, 1,
                              "Megatron-DeepSpeed @ f01c9e6e (2023-06) on PyTorch 2.0.1, CUDA 11.8, NCCL 2.14.3 and apex "
                              "2386a912's fused kernels, fp16 [assumption: the development set does not state it], full "
                              "recomputation; Megatron's LocalDDP: one contiguous fp16 gradient buffer divided and "
                              "all-reduced after backward [assumption: not DeepSpeed's engine]; Float16Optimizer",
                              0, 1, megatron_float16_optimizer, layer="megatron_ds2023", nccl="2.14.3",
                              host_s_per_kernel=MEGATRON_DS2023_HOST_S_PER_KERNEL,
                              host_s_per_collective=MEGATRON_DS2023_HOST_S_PER_COLLECTIVE, host_syncs="layer",
                              step_kernels_at_host_cost=True),
    "llm_foundry_fsdp1": System("llm_foundry_fsdp1", "llm-foundry MPT on FSDP1 (Composer)", (2, 3), True, 0,
                                "llm-foundry's benchmarks (scripts/train/benchmarking): Composer's FSDP1 with one unit "
                                "per MPT block and the root, FULL_SHARD (stage 3) or SHARD_GRAD_OP (2), "
                                "limit_all_gathers, each unit's gather prefetched under the compute before it "
                                "[assumption: the A100 rows' Composer defaults, BACKWARD_POST and no forward "
                                "prefetch, leave the host running ahead to issue them], bf16 parameters, gradients "
                                "reduce-scattered in bf16 (PURE) or fp32 (DEFAULT), every micro-batch; the Triton flash "
                                "attention; flash-attn's fused cross entropy (loss_fn: fused_crossentropy); "
                                "DecoupledAdamW with gradient clipping; PyTorch 1.13.1 or 2.1 with NCCL 2.14.3's tuner "
                                "[assumption: 2.1's NCCL 2.18 tunes alike]",
                                0, 0, composer_adamw, layer="torch_block", nccl="2.14.3", stage3_keeps_root=True,
                                attention="flash_triton", fused_loss=True, fsdp=True),
    "fsdp2": System("fsdp2", "PyTorch FSDP2", (3,), True, 0,
                    "torch.distributed.fsdp.fully_shard per block and on the root (experiments/bench_engine.py): "
                    "each block gathered before its forward and again before its backward, the root kept from "
                    "forward to backward, gradients reduce-scattered per block in the parameters' dtype, "
                    "torch.optim.AdamW (foreach); the block's attention unfused unless the point names a kernel",
                    0, 0, torch_adamw, layer="torch_block", nccl="2.14.3", stage3_keeps_root=True, fsdp=True),
    "zero_repro": System("zero_repro", "zero_repro (this engine)", (0, 1, 2, 3), True, 1,
                         "zero_impl: reduce-scatter per bucket (all-reduce at stage 0), overlap_comm, post-step "
                         "all-gather behind the next forward (overlap_param_gather), stage 3 prefetch and kept root; "
                         "fused AdamW", 0, 1, zero_repro_step, param_gather_overlap=True, stage3_keeps_root=True),
}


@dataclass(frozen=True)
class DpPlan:
    """A step's DP collectives: (kind, nbytes) calls per gradient reduction (once per step at
    stages 0-1, every micro-batch at 2-3), the post-step parameter gathers (stages 1-2), stage 3's
    gathers per micro-batch, and the gradient bytes the copies pass over per reduction."""

    grad_calls: tuple[tuple[str, float], ...]
    grad_reductions: int
    param_calls_after_step: tuple[tuple[str, float], ...]
    param_calls_per_micro_batch: tuple[tuple[str, float], ...]
    copy_bytes: float
    copy_kernels: int
    forward_gathers: int = 0    # of param_calls_per_micro_batch, the first this many run in forward


def _chunks(total: float, size: float) -> list[float]:
    n = max(1, ceil(total / size))
    return [size] * (n - 1) + [total - size * (n - 1)]


def _reduces_per_partition(psi: float, dp: int, bucket: float, e: int) -> list[tuple[str, float]]:
    """DeepSpeed 2020: buckets of `bucket` elements over the flat gradient; a bucket issues one
    reduce per partition (psi / dp elements each) it overlaps."""
    part = ceil(psi / dp)
    calls, lo = [], 0.0
    for size in _chunks(psi, bucket):
        hi = lo + size
        first, last = int(lo // part), int((hi - 1) // part)
        for p in range(first, last + 1):
            calls.append(("reduce", (min(hi, (p + 1) * part) - max(lo, p * part)) * e))
        lo = hi
    return calls


def grad_copy_kernels(system: System, layers: int) -> int:
    """Kernels of one reduction's gradient copies."""
    return system.grad_copy_kernels_per_tensor * parameter_tensors(layers) + system.grad_copy_kernels_per_reduction


def fsdp_plan(system: System, *, psi: float, dp: int, stage: int, layers: int, element_bytes: int,
              reduce_bytes: int, grad_accum: int, root: float) -> DpPlan:
    """FSDP's collectives (torch/distributed/fsdp/_runtime_utils.py, torch 1.13-2.1): a unit per
    block and the root unit (embeddings, final norm). Every micro-batch (Composer does not skip
    the reduction under accumulation): each unit gathered whole before its forward, the root first
    (in the parameters' dtype); at stage 3 (FULL_SHARD) each block gathered again before its
    backward, the root kept from its forward to its backward (FSDP1 does not free the root's
    parameters after forward: `_post_forward`); each unit's gradient reduce-scattered when its
    backward ends (in the reduce dtype), the root's last. Around each: the gradient cast to the
    reduce dtype where it differs, divided before the reduce-scatter and its shard after
    (`_get_gradient_predivide_factor`: both divisions at any DP degree > 2), the shard cast to the
    parameters' fp32 and summed into the saved shard (`_cast_grad_to_param_dtype`,
    `_saved_grad_shard`); 3 kernels a unit [assumption: the casts and the sum not counted as kernels]."""
    e, r = element_bytes, reduce_bytes
    unit = (psi - root) / layers
    grads = [("reduce_scatter", unit * r)] * layers + ([("reduce_scatter", root * r)] if root else [])
    gathers = ([("all_gather", root * e)] if root else []) + [("all_gather", unit * e)] * layers
    if stage == 3:
        gathers += [("all_gather", unit * e)] * layers
    # the cast to the reduce dtype (e in, r out) where they differ and the division of the result
    # (2r); on the shard the division (2r), its cast to fp32 (r + 4) and its sum into the saved
    # shard (12)
    copies = psi * (2 * r + (e + r if r != e else 0)) + psi / dp * (2 * r + (r + 4 if r != 4 else 0) + 12)
    return DpPlan(tuple(grads), grad_accum, (), tuple(gathers), copies, 3 * (layers + (1 if root else 0)),
                  forward_gathers=(1 if root else 0) + layers)


def dp_plan(system: System, *, psi: float, dp: int, stage: int, layers: int, element_bytes: int,
            grad_accum: int, reduce_bucket: float, allgather_bucket: float, root: float = 0.0,
            reduce_bytes: int | None = None) -> DpPlan:
    """The DP collectives of one step of `system` (module docstring); psi = the parameters one
    TP rank holds, buckets in elements (the zero_repro engine's; the others use their own); root =
    the elements of psi outside the layers (stage 3's root unit); reduce_bytes: an FSDP system's
    gradient reduce dtype (None: the element bytes)."""
    e = element_bytes
    if system.fsdp and dp > 1:
        return fsdp_plan(system, psi=psi, dp=dp, stage=stage, layers=layers, element_bytes=e,
                         reduce_bytes=reduce_bytes or e, grad_accum=grad_accum, root=root)
    reductions = grad_accum if stage >= 2 else 1
    copies = system.grad_copy_passes * 2 * psi * e
    kernels = grad_copy_kernels(system, layers)
    after: list[tuple[str, float]] = []
    per_micro: list[tuple[str, float]] = []
    if dp <= 1:
        kept = system.grad_copies_without_dp
        return DpPlan((), reductions, (), (), copies if kept else 0.0, kernels if kept else 0)
    if system.name in ("megatron2019", "megatron_ds2023"):
        grads = [("all_reduce", psi * e)]
    elif system.name == "pytorch_ddp":
        grads = [("all_reduce", b) for b in _chunks(psi * e, DDP_BUCKET_BYTES)]
    elif system.name == "deepspeed2020":
        if stage == 0:
            grads = [("all_reduce", b * e) for b in _chunks(psi, DEEPSPEED_BUCKET)]
        else:
            grads = _reduces_per_partition(psi, dp, DEEPSPEED_BUCKET, e)
            part = ceil(psi / dp)
            shards = max(1, part * dp // DEEPSPEED_BUCKET)
            after = [("all_gather", dp * part / shards * e)] * shards
    else:
        grads = [("all_reduce" if stage == 0 else "reduce_scatter", b * e) for b in _chunks(psi, reduce_bucket)]
        if stage in (1, 2):
            # in the next forward's order: the embeddings' bucket first (the root; a parameter
            # larger than a bucket is a bucket of its own, layout.build_buckets), the layers' after
            first = [root] if root > reduce_bucket else []
            after = [("all_gather", b * e) for b in first + _chunks(psi - sum(first), allgather_bucket)]
        if stage == 3:   # each layer in forward and backward; the root first, and last again unless kept
            layer = [("all_gather", (psi - root) / layers * e)] * layers
            first = [("all_gather", root * e)] if root else []
            per_micro = first + layer + layer + (first if not system.stage3_keeps_root else [])
            return DpPlan(tuple(grads), reductions, tuple(after), tuple(per_micro), copies, kernels,
                          forward_gathers=len(first) + layers)
    return DpPlan(tuple(grads), reductions, tuple(after), tuple(per_micro), copies, kernels)


def record_plan(system: System, by_purpose: dict, stage: int, grad_accum: int, element_bytes: int,
                psi: float, layers: int) -> DpPlan:
    """The plan a record's engine counts give (comm.by_purpose: calls and bytes per purpose, in
    the suite's convention: an all-reduce counted twice its size)."""
    grads, params = by_purpose.get("grads", {}), by_purpose.get("params", {})
    reductions = grad_accum if stage >= 2 else 1

    def calls(entry: dict, kind: str, per: int, halve: bool) -> tuple[tuple[str, float], ...]:
        n = int(entry.get("calls", 0))
        if n == 0 or not entry.get("bytes"):
            return ()
        each = entry["bytes"] / n / (2 if halve else 1)
        return ((kind, each),) * max(1, n // per)

    grad_calls = calls(grads, "all_reduce" if stage == 0 else "reduce_scatter", reductions, stage == 0)
    param_calls = calls(params, "all_gather", grad_accum if stage == 3 else 1, False)
    copies = system.grad_copy_passes * 2 * psi * element_bytes if grad_calls else 0.0
    # the counts do not say which gathers ran in forward: half of them, as a layer's two
    return DpPlan(grad_calls, reductions, param_calls if stage in (1, 2) else (),
                  param_calls if stage == 3 else (), copies, grad_copy_kernels(system, layers) if grad_calls else 0,
                  forward_gathers=ceil(len(param_calls) / 2) if stage == 3 else 0)
