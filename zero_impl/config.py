"""ZeroConfig: every knob of the engine, validated when it is built.

Key names follow DeepSpeed's `zero_optimization` section where they mean the same thing, so a
DeepSpeed user can read a config here without a glossary.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .deepspeed import DeepSpeedConfig, config_error, read_deepspeed

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                                  "fp64": torch.float64}
STAGES = (0, 1, 2, 3)


@dataclass
class ZeroConfig:
    """Configuration of one ZeRO engine.

    stage: 0 = plain data parallelism (all-reduce), 1 = Pos, 2 = Pos+g, 3 = Pos+g+p.
    precision: dtype of the model's parameters and gradients; with "bf16"/"fp16" the optimizer
        keeps an fp32 master copy of this rank's shard. "fp64" exists for verification: with
        double-precision rounding the engine can be compared with a reference to 1e-10.
    reduce_dtype: dtype in which gradients are accumulated and reduced. None: fp32 for bf16 (as
        Megatron-core and DeepSpeed's bf16 optimizer do: bf16's 8-bit mantissa drops small
        contributions when micro-batches and ranks are summed), the precision's own otherwise.
    grad_accum_steps: micro-batches per optimizer step; `backward` divides the loss by it.
    clip_grad_norm: clip to this global L2 norm (0 = off).
    reduce_bucket_size / allgather_bucket_size: elements per gradient bucket / of the post-step
        parameter all-gathers in flight at once, a larger bucket alone (DeepSpeed's names and
        meaning: "elements all-gathered at a time"; flat_params.py). Default 4e7, Megatron-core's bucket size, not DeepSpeed's
        5e8: the stage-2 gradient staging then holds at most MAX_INFLIGHT_STAGING + 1 buckets
        (grad_reducer.py), a constant independent of the model (a single parameter larger than a
        bucket gets a bucket of its own), where 5e8 would stage the whole gradient of any model
        under 500M parameters.
    optimizer_bucket_size: elements of fp32 masters the optimizer updates at once (optimizer.py),
        or one larger master (one bucket's shard of a param group); the step's temporaries (the
        gradients' fp32 copy, a foreach Adam's square roots) scale with it. None: the whole shard
        in one update (up to 8 more bytes per owned element at the step). Optimizers outside
        optimizer.CHUNKABLE always step the whole shard.
    overlap_comm: launch a bucket's collective asynchronously as soon as it is ready, so it runs
        while backward computes the next bucket; False = blocking collectives.
    overlap_param_gather: stages 1-2 (with overlap_comm), opt-in as in megatron-core: each
        bucket's post-step all-gather is waited on when the next forward first runs a module with
        parameters in it, so the gathers hide behind that forward. Until then the model holds
        half-updated parameters: every rank must run the next forward, or call
        engine.finish_param_gathers() on every rank before reading parameters outside forward
        (EMA, torch.save, a tied head) or before a forward some ranks only run (model.state_dict()
        finishes them itself, on every rank that calls it). False (default): step() completes them.
    loss_scale: fp16 only; 0 = dynamic loss scaling starting at 2**initial_scale_power, halved
        on overflow and doubled after loss_scale_window clean steps, never below min_loss_scale.
    hysteresis: overflows tolerated before the dynamic scale halves (DeepSpeed's fp16.hysteresis,
        whose default is 2; 1 halves on every overflow), counted down per overflow and refilled
        when the scale grows; consecutive_hysteresis refills it after every clean step (loss_scaler.py).
    stage3_unit_classes: class names of the submodules gathered as one unit (default: the
        blocks of the first ModuleList); everything else belongs to the root unit.
    stage3_max_live_units: most units gathered at once, the root included (>= 2).
    stage3_prefetch_bucket_size: elements of upcoming units to all-gather ahead (0 = no prefetch).
    stage3_param_persistence_threshold: parameters of at most this many elements stay gathered
        (DeepSpeed uses 1e5; 0 partitions everything, as the paper's Pos+g+p).
    stage3_keep_root: keep the root unit gathered from the end of forward to its backward, which
        begins with it (FSDP2's root, reshard_after_forward=False): one gather of the root a
        step saved, the paper's 3Ψ less the root. False: the paper's schedule.
    check_collective_order: before every collective, check that all ranks of the group issue
        the same one, and raise naming the difference instead of hanging (slow; for debugging).
    force_collectives: issue every collective through torch.distributed even in a world of one
        (comm.Communicator), instead of the local copy that stands for it there, so one GPU runs
        NCCL's streams, events and waits exactly as a real world does (make gpu-check); the
        calls are counted in the traffic. Needs torch.distributed initialized.
    gloo_point_to_point: on gloo with CPU tensors, run reduce-scatters and all-gathers as
        point-to-point exchanges between every pair of ranks (comm.py): gloo's own
        reduce_scatter_tensor all-reduces a clone of its input, twice the bytes, and its
        all_gather_into_tensor copies through a temporary. The traffic is counted the same.
        False (default): gloo's own calls, the ones NCCL gets, so every CPU run and test takes the
        path GPU runs take; the CPU benchmark and `make run` turn the exchange on. No effect on
        NCCL. With it, a rank must not exit with an exchange in flight: with
        overlap_param_gather, call engine.finish_param_gathers() or close() first.

    ZeRO-R (paper Section 6; DeepSpeed's activation_checkpointing names; activations.py). They act on
    the checkpoints of activation recomputation (a reentrant checkpoint per layer, as megatron-core's):
    partition_activations (Pa): keep 1/MP of each checkpoint on each model-parallel rank and
        all-gather it over the mp group just before the layer's recomputation (needs mp_group).
    cpu_checkpointing (Pa+cpu): keep those slices in host memory, brought back one layer ahead of
        their recomputation (needs partition_activations).
    contiguous_memory_optimization (MD): copy the kept checkpoints (slices with Pa, whole without,
        unlike DeepSpeed, which requires Pa) into one pre-allocated contiguous arena as they are produced.
    number_checkpoints: MD's arena slots, the most checkpoints one forward keeps (None: one per
        layer, the blocks of the first ModuleList).
    CB, constant-size buffers, is not a switch: every fused buffer's size is set by the sizes above
        (reduce_bucket_size, allgather_bucket_size, optimizer_bucket_size), whatever the model
        (engine.stats()["buffers"]); optimizer_bucket_size=None gives that up for the step.
    """

    stage: int = 0
    precision: str = "fp32"
    reduce_dtype: str | None = None
    grad_accum_steps: int = 1
    clip_grad_norm: float = 0.0
    reduce_bucket_size: int = 40_000_000
    allgather_bucket_size: int = 40_000_000
    optimizer_bucket_size: int | None = 40_000_000
    overlap_comm: bool = True
    overlap_param_gather: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    min_loss_scale: float = 1.0
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    stage3_unit_classes: tuple[str, ...] | None = None
    stage3_max_live_units: int = 3
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 0
    stage3_keep_root: bool = True
    check_collective_order: bool = False
    force_collectives: bool = False
    gloo_point_to_point: bool = False
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None

    def __post_init__(self) -> None:
        _check_choice("stage", self.stage, STAGES)
        _check_choice("precision", self.precision, tuple(DTYPES))
        if self.reduce_dtype is not None:
            _check_choice("reduce_dtype", self.reduce_dtype, tuple(DTYPES) + (None,))
        for key in ("reduce_bucket_size", "allgather_bucket_size", "optimizer_bucket_size",
                    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
            value = getattr(self, key)  # YAML and DeepSpeed configs write sizes like 5e8
            if isinstance(value, float) and value.is_integer():
                setattr(self, key, int(value))
        for key, minimum in (("grad_accum_steps", 1), ("reduce_bucket_size", 1), ("allgather_bucket_size", 1),
                             ("loss_scale_window", 1), ("hysteresis", 1), ("stage3_prefetch_bucket_size", 0),
                             ("stage3_param_persistence_threshold", 0),
                             ("stage3_max_live_units", 2)):  # 2: the root unit and the running one
            _check_int(key, getattr(self, key), minimum)
        if self.optimizer_bucket_size is not None:
            _check_int("optimizer_bucket_size", self.optimizer_bucket_size, 1)
        if self.stage3_unit_classes is not None:
            if isinstance(self.stage3_unit_classes, str):
                self.stage3_unit_classes = (self.stage3_unit_classes,)
            self.stage3_unit_classes = tuple(self.stage3_unit_classes)
        for key in ("clip_grad_norm", "loss_scale"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"ZeroConfig.{key} must be >= 0, got {getattr(self, key)!r}")
        if not self.min_loss_scale > 0:
            raise ValueError(f"ZeroConfig.min_loss_scale must be > 0, got {self.min_loss_scale!r}")
        for key in ("overlap_comm", "overlap_param_gather", "stage3_keep_root", "consecutive_hysteresis",
                    "check_collective_order", "force_collectives", "gloo_point_to_point",
                    "partition_activations", "cpu_checkpointing", "contiguous_memory_optimization"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"ZeroConfig.{key} must be true or false, got {getattr(self, key)!r}")
        if self.cpu_checkpointing and not self.partition_activations:
            raise ValueError("ZeroConfig.cpu_checkpointing (Pa+cpu) moves the partitioned checkpoints to the host: "
                             "it needs partition_activations=true")
        if self.number_checkpoints is not None:
            _check_int("number_checkpoints", self.number_checkpoints, 1)
            if not self.contiguous_memory_optimization:
                raise ValueError("ZeroConfig.number_checkpoints sizes MD's arena: it needs "
                                 "contiguous_memory_optimization=true")

    @property
    def activation_checkpoints(self) -> bool:
        """Whether any ZeRO-R switch acts on the activation checkpoints (Pa, Pa+cpu, MD)."""
        return self.partition_activations or self.cpu_checkpointing or self.contiguous_memory_optimization

    @property
    def zero_r_config(self) -> str | None:
        """The paper's Table 3 configuration this config is ("C1" ... "C5"), or None."""
        return zero_r_config(self.stage, self.partition_activations, self.cpu_checkpointing,
                             self.contiguous_memory_optimization)

    @property
    def param_dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    @property
    def grad_reduce_dtype(self) -> torch.dtype:
        if self.reduce_dtype is not None:
            return DTYPES[self.reduce_dtype]
        return torch.float32 if self.precision == "bf16" else self.param_dtype

    @property
    def mixed_precision(self) -> bool:
        return self.precision in ("bf16", "fp16")

    @property
    def master_dtype(self) -> torch.dtype:
        """dtype of the optimizer's master weights: fp32 for mixed precision, else the model's."""
        return torch.float32 if self.mixed_precision else self.param_dtype

    @classmethod
    def from_dict(cls, values: dict) -> "ZeroConfig":
        """Build from a plain dict (e.g. a Hydra node), rejecting unknown keys by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ZeroConfig key(s) {unknown}; allowed: {sorted(known)}")
        return cls(**values)

    @classmethod
    def from_deepspeed(cls, path_or_dict) -> "ZeroConfig":
        """The engine config a DeepSpeed JSON (a path or its dict) describes, DeepSpeed's defaults
        for what it omits; raises deepspeed.DeepSpeedConfigError naming a key it cannot honour."""
        return parse_deepspeed(path_or_dict).zero


def parse_deepspeed(path_or_dict) -> DeepSpeedConfig:
    """A DeepSpeed JSON config (a path, or the dict it holds) read by zero_impl/deepspeed.py: its
    ZeroConfig, batch keys, AdamW settings and ignored keys; raises DeepSpeedConfigError (a
    ValueError) in one line naming the first key this engine cannot honour or read."""
    decided, rest = read_deepspeed(path_or_dict)
    try:
        zero = ZeroConfig(**decided)
    except ValueError as e:
        raise config_error(e, rest["source"]) from None
    return DeepSpeedConfig(zero=zero, **rest)


ZERO_R_SWITCHES = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")

# The paper's Table 3 (results/paper/table3_zero_r_configs.csv): ZeRO-DP stage and ZeRO-R switches.
# CB holds in every configuration (the engine's buffers are always bounded by their configured sizes).
ZERO_R_CONFIGS: dict[str, dict] = {
    "C1": {"stage": 1, "partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": True},
    "C2": {"stage": 1, "partition_activations": True, "cpu_checkpointing": False, "contiguous_memory_optimization": True},
    "C3": {"stage": 2, "partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": True},
    "C4": {"stage": 2, "partition_activations": True, "cpu_checkpointing": False, "contiguous_memory_optimization": True},
    "C5": {"stage": 2, "partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": True},
}


def zero_r_config(stage: int, partition_activations: bool = False, cpu_checkpointing: bool = False,
                  contiguous_memory_optimization: bool = False) -> str | None:
    """Table 3's name of this combination (C1 = Pos+CB+MD ... C5 = Pos+g+CB+MD+Pa+cpu), else None."""
    mine = {"stage": stage, "partition_activations": bool(partition_activations),
            "cpu_checkpointing": bool(cpu_checkpointing),
            "contiguous_memory_optimization": bool(contiguous_memory_optimization)}
    return next((name for name, flags in ZERO_R_CONFIGS.items() if flags == mine), None)


def _check_choice(key: str, value, allowed: tuple) -> None:
    if value not in allowed or isinstance(value, bool):
        raise ValueError(f"ZeroConfig.{key} must be one of {list(allowed)}, got {value!r}")


def _check_int(key: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"ZeroConfig.{key} must be an integer >= {minimum}, got {value!r}")
