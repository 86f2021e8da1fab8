"""Autograd signals for the stage-3 schedule: when a unit's backward begins and when it is over.

Begins: the first gradient reaching one of the unit's outputs (a hook on each output tensor),
or, under activation recomputation, the unit's forward running again inside backward.

Over: when the gradients of the unit's inputs have been computed, every node of the unit's
backward has run. Gradients of trainable parameters alone cannot tell: a frozen weight is still
read by the node that computes its input's gradient, and a unit may have no trainable
parameter at all. As in PyTorch FSDP2 (`RegisterPostBackwardFunction` in
`torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py`), the unit's inputs that require
gradients pass through an identity autograd function before the unit runs; its backward, which
autograd runs once the unit has produced all their gradients, is the signal. Like FSDP2, this
forbids modifying those inputs in place inside the unit.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


class PostBackward(torch.autograd.Function):
    """Identity on `tensors`; calls `callback()` when their gradients have all been computed."""

    @staticmethod
    def forward(ctx, callback: Callable[[], Any], *tensors: torch.Tensor):
        ctx.callback = callback  # a WeakHook: the autograd graph must not keep the engine alive
        return tensors

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.callback()
        return (None, *grads)


def wrap_inputs(args: tuple, kwargs: dict, callback: Callable[[], Any]) -> tuple[tuple, dict, bool]:
    """(args, kwargs) with every tensor requiring grad passed through PostBackward, and whether
    there was any (without one, autograd never calls `callback`)."""
    found = tensors((args, kwargs), requiring_grad=True) if torch.is_grad_enabled() else []
    if not found:
        return args, kwargs, False
    replaced = dict(zip(map(id, found), PostBackward.apply(callback, *found)))
    args, kwargs = _map((args, kwargs), lambda t: replaced.get(id(t), t))
    return args, kwargs, True


def tensors(obj: Any, requiring_grad: bool = False) -> list[torch.Tensor]:
    """The tensors in a nest of tuples, lists and dicts, each once."""
    out: dict[int, torch.Tensor] = {}
    _map(obj, lambda t: out.setdefault(id(t), t))
    return [t for t in out.values() if t.requires_grad or not requiring_grad]


def _map(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        items = [_map(o, fn) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)  # namedtuple or not
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return obj
