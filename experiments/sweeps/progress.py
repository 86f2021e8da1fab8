""""k of N" and the time left, for long work done item by item (simulated sweeps, the largest-model
search): a line per finished item says how far the work is and, at the pace so far, how long the
rest will take."""
from __future__ import annotations

import time
from collections.abc import Hashable


def duration(seconds: float) -> str:
    """A time left as a reader wants it: seconds under two minutes, else minutes, else hours."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class Progress:
    """`total` items, up to `workers` of them running at once; `start(key)` when an item starts,
    `done(key)` when it ends. The caller may revise `total` and `workers` (items that can run at
    once) as it learns, and set `qualifier`: "about" where the total is an estimate, "at least"
    where it is a lower bound (the time left is then one too)."""

    def __init__(self, total: int, what: str = "", workers: int = 1) -> None:
        self.total, self.what, self.workers, self.qualifier = total, what, workers, ""
        self.finished = 0
        self._began: dict[Hashable, float] = {}
        self._durations: list[float] = []

    def start(self, key: Hashable) -> None:
        self._began[key] = time.perf_counter()

    def done(self, key: Hashable) -> str:
        """Count `key` finished: "[3 of 10 <what>, about 2 min left]"."""
        self.finished += 1
        self._durations.append(time.perf_counter() - self._began.pop(key))
        return self.status()

    def left_s(self) -> float | None:
        """Seconds left: the finished items' mean duration for each item left, `workers` at a time
        (not the time so far per finished item, which counts the first of W items that ran together
        as W items' time). None before the first item ends."""
        left = self.total - self.finished
        if not self._durations or left <= 0:
            return None
        return sum(self._durations) / len(self._durations) * left / max(1, min(self.workers, left))

    def status(self) -> str:
        left = self.left_s()
        what = f" {self.what}" if self.what else ""
        of = f"{self.qualifier} {self.total}" if self.qualifier else str(self.total)
        tail = "" if left is None else f", {self.qualifier if self.qualifier == 'at least' else 'about'} {duration(left)} left"
        return f"[{self.finished} of {of}{what}{tail}]"
