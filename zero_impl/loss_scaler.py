"""Loss scaling for fp16: static, or dynamic as in DeepSpeed (halve on overflow, grow after a clean window)."""
from __future__ import annotations


class LossScaler:
    """Holds the current loss scale; `update` is called once per optimizer step with the
    overflow decision, which the caller has already made identical on every rank.

    Dynamic scaling follows DeepSpeed's DynamicLossScaler.update_scale
    (deepspeed/runtime/fp16/loss_scaler.py): an overflowed step is skipped; it halves the scale
    only when the hysteresis counter is down to 1, else it takes one off the counter. The
    counter is refilled when the scale grows (loss_scale_window clean steps since the last
    overflow), or after every clean step with consecutive_hysteresis. hysteresis=1 halves on
    every overflow."""

    def __init__(self, *, enabled: bool, static_scale: float = 0.0, initial_scale_power: int = 16,
                 window: int = 1000, min_scale: float = 1.0, hysteresis: int = 1,
                 consecutive_hysteresis: bool = False) -> None:
        self.dynamic = enabled and static_scale == 0
        self.scale = float(2 ** initial_scale_power) if self.dynamic else (static_scale if enabled else 1.0)
        self.window = window
        self.min_scale = min_scale
        self.clean_steps = 0
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.hysteresis_left = hysteresis  # overflows still tolerated before the next halving

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis_left <= 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        if self.clean_steps % self.window == 0:
            self.scale *= 2
            self.hysteresis_left = self.hysteresis
