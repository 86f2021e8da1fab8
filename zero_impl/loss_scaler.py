"""Loss scaling for fp16: static, or dynamic as in DeepSpeed (halve on overflow, grow after a clean window).

A dynamic scale lives on the device, as torch's GradScaler keeps it: the overflow decision is a
device tensor, and the update below is a handful of element-wise kernels on 0-dim tensors,
queued behind the step like any other, so no step ever waits for the host to read a flag.
`scale`, `clean_steps` and `hysteresis_left` read the device only when asked (stats(), a
checkpoint), never in the training loop.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake


class LossScaler:
    """Holds the current loss scale; `update` is called once per optimizer step with the
    overflow decision, which the caller has already made identical on every rank.

    Dynamic scaling follows DeepSpeed's DynamicLossScaler.update_scale
    (deepspeed/runtime/fp16/loss_scaler.py): an overflowed step is skipped; it halves the scale
    only when the hysteresis counter is down to 1, else it takes one off the counter. The
    counter is refilled when the scale grows (loss_scale_window clean steps since the last
    overflow), or after every clean step with consecutive_hysteresis. hysteresis=1 halves on
    every overflow. The same rules as tensor arithmetic (`update`): powers of two in fp32,
    exact, so the device's scale is bit for bit the host rule's."""

    def __init__(self, *, enabled: bool, static_scale: float = 0.0, initial_scale_power: int = 16,
                 window: int = 1000, min_scale: float = 1.0, hysteresis: int = 1,
                 consecutive_hysteresis: bool = False, device: torch.device | None = None) -> None:
        self.enabled = enabled  # fp16: the step tests the gradients for overflow
        self.dynamic = enabled and static_scale == 0
        self.window = window
        self.min_scale = min_scale
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        initial = float(2 ** initial_scale_power) if self.dynamic else (static_scale if enabled else 1.0)
        self._static = initial
        # hysteresis 1 is torch's GradScaler rule: its one fused kernel (_amp_update_scale_) runs it,
        # counting clean steps modulo the window (the same growth points)
        self._fused = hysteresis == 1
        if self.dynamic:  # device state: the scale and the two counters (0-dim tensors)
            self._scale = torch.tensor(initial, dtype=torch.float32, device=device)
            self._clean = torch.zeros((), dtype=torch.int32 if self._fused else torch.int64, device=device)
            self._hysteresis_left = torch.tensor(hysteresis, dtype=torch.int64, device=device)
            # a step's outcome known on the host (an optimizer without found_inf read it there) as a
            # device flag made once: a Python bool made into a CUDA tensor per step is a pageable
            # host-to-device copy, which waits for the stream
            self._known = {flag: torch.tensor(float(flag), dtype=torch.float32, device=device)
                           for flag in (False, True)}

    # -- what the step uses: never read on the host ----------------------------------------
    def factor(self) -> torch.Tensor | float:
        """The scale as the step multiplies by it: the device tensor (dynamic) or a constant."""
        return self._scale if self.dynamic else self._static

    def update(self, overflow: torch.Tensor | bool) -> None:
        """One optimizer step's outcome: `overflow` (a 0-dim bool tensor, or a bool) True when
        the step overflowed and was skipped. Queued on the device; nothing is read back."""
        if not self.dynamic:
            return
        found = (self._known[overflow] if isinstance(overflow, bool)
                 else torch.as_tensor(overflow, device=self._scale.device))  # a no-op for a flag already there
        if self._fused:  # halve on overflow, double after `window` clean steps, then the floor: 2 kernels
            torch._amp_update_scale_(self._scale, self._clean, found.float(), 2.0, 0.5, self.window)
            self._scale.clamp_(min=self.min_scale)
            return
        if found.dtype != torch.bool:  # the optimizer's float flag
            found = found != 0
        halve = found & (self._hysteresis_left <= 1)
        self._scale.copy_(torch.where(halve, (self._scale / 2).clamp_(min=self.min_scale), self._scale))
        self._hysteresis_left.sub_((found & ~halve).long())
        self._clean.copy_(torch.where(found, 0, self._clean + 1))
        if self.consecutive_hysteresis:
            self._hysteresis_left.copy_(torch.where(found, self._hysteresis_left, self.hysteresis))
        grow = ~found & (self._clean % self.window == 0)
        self._scale.copy_(torch.where(grow, self._scale * 2, self._scale))
        self._hysteresis_left.copy_(torch.where(grow, self.hysteresis, self._hysteresis_left))

    def state_tensors(self) -> list[torch.Tensor]:
        """The device scalars of a dynamic scale (the engine's state_tensors, as buffers)."""
        return [self._scale, self._clean, self._hysteresis_left, *self._known.values()] if self.dynamic else []

    # -- read lazily (stats, checkpoints) -------------------------------------------------------
    @property
    def scale(self) -> float:
        return _read(self._scale, self._static) if self.dynamic else self._static

    @scale.setter
    def scale(self, value: float) -> None:
        if self.dynamic:
            self._scale.fill_(value)
        else:
            self._static = value

    @property
    def clean_steps(self) -> int:
        """Clean steps since the last overflow (with hysteresis 1: since the last change of scale)."""
        return int(_read(self._clean, 0)) if self.dynamic else 0

    @clean_steps.setter
    def clean_steps(self, value: int) -> None:
        if self.dynamic:
            self._clean.fill_(value % self.window if self._fused else value)

    @property
    def hysteresis_left(self) -> int:
        return int(_read(self._hysteresis_left, self.hysteresis)) if self.dynamic else self.hysteresis

    @hysteresis_left.setter
    def hysteresis_left(self, value: int) -> None:
        if self.dynamic:
            self._hysteresis_left.fill_(value)


def _read(t: torch.Tensor, default: float) -> float:
    """A 0-dim device value on the host (a sync: only where a user asks); a simulation's fake
    tensor has no value: `default`."""
    return default if is_fake(t) else t.item()
