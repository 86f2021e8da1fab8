"""Collectives issued outside the ZeRO engine, counted: megatron's tensor-parallel traffic,
beside its closed form (experiments/run/fake.py records both for every simulated point)."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from experiments.points import Point


class CollectiveCounter:
    """Counts the collectives issued through torch.distributed by anything but the engine (whose
    own go through zero_impl/comm.py and its ledger): megatron's TP all-reduces (forward,
    backward, the vocabulary-parallel cross entropy). Counting convention of zero_impl/comm.py:
    an all-reduce moves twice its size, an all-gather its output, a reduce-scatter its input.
    Patched at call time, so functions megatron bound at import (its sequence-parallel
    all-gather / reduce-scatter, unused without sequence parallelism) are not seen."""

    NAMES = {"all_reduce": 2, "all_gather_into_tensor": 1, "_all_gather_base": 1, "reduce_scatter_tensor": 1,
             "_reduce_scatter_base": 1, "all_gather": 1, "reduce_scatter": 1, "broadcast": 1}

    def __init__(self, groups: dict[str, object]) -> None:
        self.groups = groups
        self.counts: dict[tuple[str, str], dict[str, int]] = {}
        self._saved: dict[str, object] = {}

    def _group_name(self, group) -> str:
        for name, g in self.groups.items():
            if g is group:
                return name
        return "world" if group is None else "other"

    def _wrap(self, name: str, fn):
        factor = self.NAMES[name]

        def wrapped(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if not caller.endswith(os.path.join("zero_impl", "comm.py")):
                group = kwargs.get("group")
                tensors = [a for a in args if torch.is_tensor(a)]
                lists = [a for a in args if isinstance(a, (list, tuple)) and a and torch.is_tensor(a[0])]
                if name in ("all_gather_into_tensor", "_all_gather_base"):
                    numel = tensors[0].numel()                      # the output
                elif name in ("reduce_scatter_tensor", "_reduce_scatter_base"):
                    numel = tensors[1].numel() if len(tensors) > 1 else tensors[0].numel()  # the input
                elif name == "all_gather":
                    numel = sum(t.numel() for t in lists[0]) if lists else 0
                elif name == "reduce_scatter":
                    numel = sum(t.numel() for t in lists[0]) if lists else 0
                else:
                    numel = tensors[0].numel() if tensors else 0
                row = self.counts.setdefault((self._group_name(group), name), {"calls": 0, "elements": 0})
                row["calls"] += 1
                row["elements"] += factor * numel
            return fn(*args, **kwargs)

        return wrapped

    def __enter__(self) -> "CollectiveCounter":
        for name in self.NAMES:
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    def summary(self) -> dict:
        """{group: {collective: {calls, elements}}}, and the elements per group."""
        out: dict[str, dict] = {}
        for (group, name), row in sorted(self.counts.items()):
            out.setdefault(group, {})[name] = dict(row)
        return out


def tp_allreduce_theory(point: Point) -> int:
    """Elements megatron's TP all-reduces move per optimizer step on one rank (without sequence
    parallelism; all-reduce counted twice its size): per layer and micro-batch 2 in forward
    (attention and MLP outputs), 2 more when backward recomputes the layer, 2 in backward (the
    inputs' gradients of the QKV and FC1 column-parallel layers), each s·b·h; the embedding's
    output in forward and the tied output layer's input gradient in backward, s·b·h each; the
    cross entropy's 3 reductions over the vocabulary shards (max, target logit, sum of exps),
    s·b each, which megatron issues at TP 1 too (the layers' reductions it skips there)."""
    s, b, h, layers = point.shape.seq_len, point.micro_batch, point.shape.hidden, point.shape.layers
    per_layer = 4 + (2 if point.train["recompute"] else 0)
    per_micro = (0 if point.tp == 1 else (layers * per_layer + 2) * s * b * h) + 3 * s * b
    return 2 * per_micro * point.train["grad_accum_steps"]
