"""Bytes of live tensor storage: what the engine measures (the paper's formulas live in the
suite, experiments/analysis/memory.py)."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if torch.is_tensor(t):
            storage = t.untyped_storage()
            # a fake tensor's storage (a simulation) has no address: its StorageImpl identifies it
            seen[storage._cdata if is_fake(t) else storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
