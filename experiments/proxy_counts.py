"""What a GPU will charge for a training step, counted on the CPU: a dispatch mode over the step.

Every aten op a step dispatches is seen here (`TorchDispatchMode`, below autograd, so backward's
ops too), by phase (forward, backward, step) as the caller marks them:
- kernels: ops that launch one (≈ a CUDA kernel launch each): every op but views, allocations
  and other metadata-only ops (`NO_KERNEL`), and collectives, counted apart;
- host syncs: ops whose result the host must read (`SYNC_OPS`: `.item()`, `if t:`, `nonzero`);
  on a GPU each drains the queue before the host can launch anything more;
- collectives (c10d ops) and their elements, by the suite's convention (zero_impl/comm.py):
  a reduce-scatter counts its input, an all-gather its output, an all-reduce twice its size;
- non-GEMM bytes: bytes read plus written by every kernel that is not a matrix multiply (its
  tensor inputs and outputs), the memory-bound traffic a step-time model prices at bandwidth.
CPU ops and CUDA kernels are not one-to-one (a CUDA op may launch two; foreach ops launch
one per chunk of tensors), but the counts move together: what grows with buckets here does there.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
SYNC_OPS = frozenset({aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default,
                      aten.nonzero.default, aten.allclose.default})
GEMM_OPS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})
NO_KERNEL = frozenset({aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                       aten.detach.default, aten.lift_fresh.default, aten.set_.source_Storage_storage_offset,
                       aten.resize_.default, aten._has_compatible_shallow_copy_type.default,
                       aten.promote_types.default})
PHASES = ("forward", "backward", "step")


@dataclass
class PhaseCounts:
    """One phase's counts (module docstring)."""

    kernels: int = 0
    host_syncs: int = 0
    gemms: int = 0
    collectives: int = 0
    collective_elements: int = 0
    non_gemm_bytes: int = 0
    ops: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # kernel ops by name
    views: int = 0  # views and metadata ops (NO_KERNEL): dispatched, no kernel; not in as_dict
    view_ops: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # (collective kind, bytes of the buffer a collective model prices): calls
    collective_calls: dict[tuple[str, int], int] = field(default_factory=lambda: defaultdict(int))

    def as_dict(self) -> dict:
        return {"kernels": self.kernels, "host_syncs": self.host_syncs, "gemms": self.gemms,
                "collectives": self.collectives, "collective_elements": self.collective_elements,
                "non_gemm_bytes": self.non_gemm_bytes,
                "collective_calls": [[kind, nbytes, n] for (kind, nbytes), n in sorted(self.collective_calls.items())]}


def _collective(name: str, args: tuple) -> tuple[str, int, int]:
    """(kind, elements by the suite's convention, bytes of the buffer a collective model prices:
    an all-reduce's tensor, an all-gather's output, a reduce-scatter's input)."""
    tensors = [t for t in tree_leaves(args) if torch.is_tensor(t)]
    if not tensors:
        return "other", 0, 0
    if name.startswith("allreduce"):
        n = sum(t.numel() for t in tensors)
        return "all_reduce", 2 * n, sum(t.nbytes for t in tensors)
    if name.startswith(("allgather", "_allgather")):
        return "all_gather", tensors[0].numel(), tensors[0].nbytes  # the (flat) output
    if name.startswith(("reduce_scatter", "_reduce_scatter")):
        return "reduce_scatter", tensors[-1].numel(), tensors[-1].nbytes  # the input
    return "other", sum(t.numel() for t in tensors), sum(t.nbytes for t in tensors)


class OpCounter(TorchDispatchMode):
    """Counts a step's ops by phase: set `phase` to one of PHASES before each part runs
    (ops outside them go to "other")."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "other"
        self.counts: dict[str, PhaseCounts] = defaultdict(PhaseCounts)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        c = self.counts[self.phase]
        if func.namespace == "profiler":  # record_function's markers
            return out
        if func.namespace == "c10d":
            if not func.__name__.startswith(("wait", "barrier", "monitored")):
                kind, elements, nbytes = _collective(func.__name__, args)
                c.collectives += 1
                c.collective_elements += elements
                c.collective_calls[(kind, nbytes)] += 1
            return out
        if func in SYNC_OPS:
            c.host_syncs += 1
            return out
        if func.is_view or func in NO_KERNEL:
            c.views += 1
            c.view_ops[func.__name__] += 1
            return out
        c.kernels += 1
        c.ops[func.__name__] += 1
        if func in GEMM_OPS:
            c.gemms += 1
        else:
            c.non_gemm_bytes += sum(t.nbytes for t in tree_leaves((args, kwargs, out)) if torch.is_tensor(t))
        return out

    def phases(self) -> dict[str, dict]:
        return {phase: self.counts[phase].as_dict() for phase in PHASES}
