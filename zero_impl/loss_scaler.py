"""Loss scaling for fp16: static, or dynamic as in DeepSpeed (halve on overflow, grow after a clean window)."""
from __future__ import annotations


class LossScaler:
    """Holds the current loss scale; `update` is called once per optimizer step with the
    overflow decision, which the caller has already made identical on every rank."""

    def __init__(self, *, enabled: bool, static_scale: float = 0.0, initial_scale_power: int = 16,
                 window: int = 1000, min_scale: float = 1.0) -> None:
        self.dynamic = enabled and static_scale == 0
        self.scale = float(2 ** initial_scale_power) if self.dynamic else (static_scale if enabled else 1.0)
        self.window = window
        self.min_scale = min_scale
        self.clean_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.scale = max(self.scale / 2, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps % self.window == 0:
            self.scale *= 2
