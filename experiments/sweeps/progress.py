""""k of N" and the time left, for long work done item by item (simulated sweeps, the largest-model
search): a line per finished item says how far the work is and, at the pace so far, how long the
rest will take."""
from __future__ import annotations

import time


def duration(seconds: float) -> str:
    """A time left as a reader wants it: seconds under two minutes, else minutes, else hours."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class Progress:
    """`total` items; each call of `done()` counts one finished and says where the work stands.
    `estimated`: the total is a guess the caller revises (set `total`), printed "of about N"."""

    def __init__(self, total: int, what: str = "", estimated: bool = False) -> None:
        self.total, self.what, self.estimated, self.finished = total, what, estimated, 0
        self.began = time.perf_counter()

    def left_s(self) -> float | None:
        """Seconds left at the pace so far (None before the first item ends)."""
        if not self.finished:
            return None
        return (time.perf_counter() - self.began) / self.finished * (self.total - self.finished)

    def done(self) -> str:
        """Count one more finished item: "[3 of 10 <what>, about 2 min left]"."""
        self.finished += 1
        return self.status()

    def status(self) -> str:
        left = self.left_s()
        what = f" {self.what}" if self.what else ""
        tail = "" if left is None or self.finished >= self.total else f", about {duration(left)} left"
        return f"[{self.finished} of {'about ' if self.estimated else ''}{self.total}{what}{tail}]"
