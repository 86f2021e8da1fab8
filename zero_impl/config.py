"""ZeroConfig: every knob of the engine, validated when it is built.

Key names follow DeepSpeed's `zero_optimization` section where they mean the same thing, so a
DeepSpeed user can read a config here without a glossary.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STAGES = (0, 1, 2)


@dataclass
class ZeroConfig:
    """Configuration of one ZeRO engine.

    stage: 0 = plain data parallelism (all-reduce), 1 = Pos, 2 = Pos+g, 3 = Pos+g+p.
    precision: dtype of the model's parameters and gradients; with "bf16"/"fp16" the optimizer
        keeps an fp32 master copy of this rank's shard.
    reduce_dtype: dtype in which gradients are accumulated and reduced (None = the precision's).
    grad_accum_steps: micro-batches per optimizer step; `backward` divides the loss by it.
    clip_grad_norm: clip to this global L2 norm (0 = off).
    reduce_bucket_size / allgather_bucket_size: elements per gradient bucket / per parameter
        all-gather (DeepSpeed's names and defaults).
    overlap_comm: launch a bucket's collective asynchronously as soon as it is ready, so it runs
        while backward computes the next bucket; False = blocking collectives.
    loss_scale: fp16 only; 0 = dynamic loss scaling starting at 2**initial_scale_power, halved
        on overflow and doubled after loss_scale_window clean steps, never below min_loss_scale.
    """

    stage: int = 0
    precision: str = "fp32"
    reduce_dtype: str | None = None
    grad_accum_steps: int = 1
    clip_grad_norm: float = 0.0
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = True
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    min_loss_scale: float = 1.0

    def __post_init__(self) -> None:
        for key in ("reduce_bucket_size", "allgather_bucket_size"):  # YAML and DeepSpeed write 5e8
            value = getattr(self, key)
            if isinstance(value, float) and value.is_integer():
                setattr(self, key, int(value))
        _check_choice("stage", self.stage, STAGES)
        _check_choice("precision", self.precision, tuple(DTYPES))
        if self.reduce_dtype is not None:
            _check_choice("reduce_dtype", self.reduce_dtype, tuple(DTYPES) + (None,))
        for key in ("grad_accum_steps", "reduce_bucket_size", "allgather_bucket_size", "loss_scale_window"):
            _check_positive_int(key, getattr(self, key))
        for key in ("clip_grad_norm", "loss_scale"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"ZeroConfig.{key} must be >= 0, got {getattr(self, key)!r}")
        if not self.min_loss_scale > 0:
            raise ValueError(f"ZeroConfig.min_loss_scale must be > 0, got {self.min_loss_scale!r}")
        if not isinstance(self.overlap_comm, bool):
            raise ValueError(f"ZeroConfig.overlap_comm must be true or false, got {self.overlap_comm!r}")

    @property
    def param_dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    @property
    def grad_reduce_dtype(self) -> torch.dtype:
        return DTYPES[self.reduce_dtype or self.precision]

    @property
    def mixed_precision(self) -> bool:
        return self.precision != "fp32"

    @classmethod
    def from_dict(cls, values: dict) -> "ZeroConfig":
        """Build from a plain dict (e.g. a Hydra node), rejecting unknown keys by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ZeroConfig key(s) {unknown}; allowed: {sorted(known)}")
        return cls(**values)


def _check_choice(key: str, value, allowed: tuple) -> None:
    if value not in allowed or isinstance(value, bool):
        raise ValueError(f"ZeroConfig.{key} must be one of {list(allowed)}, got {value!r}")


def _check_positive_int(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ZeroConfig.{key} must be a positive integer, got {value!r}")
