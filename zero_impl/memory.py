"""Bytes of live tensor storage: what the engine measures (the paper's formulas live in the
suite, experiments/analysis/memory.py)."""
from __future__ import annotations

import torch


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if torch.is_tensor(t):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
