"""Ranks that agree before they train: one config, one model, the same starting values.

Every collective of the engine assumes that the data-parallel ranks built the same thing: the
same ZeroConfig (bucket sizes set the collectives' sizes and count), the same parameters by name
and shape (the flat layout), and the same values (each rank updates its shard of one model).
Nothing in torch checks this, and a difference either hangs in a collective whose sizes differ
or trains silently wrong (a model mixed from every rank's shards). So initialize() checks the
first two, at the cost of one all_gather_object of a short digest, and refuses in one line
naming the first difference; and it broadcasts the parameters and buffers from the DP group's
first rank, as DDP does at construction and FSDP with sync_module_states (stage 3 broadcasts
each unit materialized from the meta device instead: stage3.py). Nothing here runs in a step.
"""
from __future__ import annotations

import hashlib
from contextlib import nullcontext
from dataclasses import fields

import torch
import torch.distributed as dist
from torch import nn

from .comm import Communicator
from .config import ZeroConfig


def check(config: ZeroConfig, module: nn.Module, comm: Communicator, device: torch.device) -> None:
    """Raise ValueError on every rank of `comm`'s group, naming the first ZeroConfig key or the
    first parameter (name, shape, dtype, trainable, on the meta device) whose value differs
    between its first rank and another; collective on the group, a no-op for a world of one."""
    if not _checked(comm):
        return
    settings = {f.name: getattr(config, f.name) for f in fields(config)}
    params = [_describe(p) for p in module.named_parameters()]
    mine = {"config": settings, "params": hashlib.sha1(repr(params).encode()).hexdigest()}
    everyone = _all_gather_object(mine, comm, device)
    for rank, theirs in enumerate(everyone[1:], start=1):
        for key, value in settings.items():  # the same keys everywhere: one version of zero_impl
            if everyone[0]["config"][key] != theirs["config"][key]:
                raise ValueError(f"ranks disagree on ZeroConfig.{key}: {everyone[0]['config'][key]!r} on DP rank 0, "
                                 f"{theirs['config'][key]!r} on DP rank {rank}")
    if all(e["params"] == mine["params"] for e in everyone):
        return
    lists = _all_gather_object(params, comm, device)  # every rank sees the mismatch: all take this path
    first = dict(lists[0])
    for rank, theirs in enumerate(lists[1:], start=1):
        if theirs == lists[0]:
            continue
        for name, described in theirs:
            if name not in first:
                raise ValueError(f"ranks disagree on the model: parameter {name!r} is on DP rank {rank}, "
                                 "not on DP rank 0")
            if first[name] != described:
                raise ValueError(f"ranks disagree on the model: parameter {name!r} is {_say(first[name])} on DP "
                                 f"rank 0, {_say(described)} on DP rank {rank}")
        missing = next(name for name, _ in lists[0] if name not in dict(theirs))
        raise ValueError(f"ranks disagree on the model: parameter {missing!r} is on DP rank 0, not on DP rank {rank}")


def broadcast_states(module: nn.Module, comm: Communicator) -> None:
    """Every parameter and buffer not on the meta device takes the values of the DP group's first
    rank, in place (within the DP group only: under TP each group holds its own TP rank's shards).
    One broadcast per tensor, counted under the purpose "init"."""
    with torch.no_grad():
        for t in (*module.parameters(), *module.buffers()):
            if not t.is_meta and t.numel():
                broadcast(t.data if t.is_contiguous() else _contiguous_in_place(t), comm)


def broadcast(tensor: torch.Tensor, comm: Communicator) -> None:
    """`tensor` takes the DP group's first rank's values, in place, where there are ranks to agree."""
    if _checked(comm):
        comm.broadcast(tensor, purpose="init")


def _contiguous_in_place(t: torch.Tensor) -> torch.Tensor:
    """A non-contiguous tensor (a transposed weight) cannot be broadcast in place: give it
    contiguous storage first, keeping its identity (autograd and optimizer references)."""
    t.data = t.data.contiguous()
    return t.data


def _checked(comm: Communicator) -> bool:
    """Ranks to agree: more than one, and real ones (a simulation's fake group plays one rank
    of a world whose other ranks do not exist: nothing to agree with)."""
    return comm.size > 1 and dist.get_backend(comm.group) != "fake"


def _describe(named: tuple[str, nn.Parameter]) -> tuple[str, tuple]:
    name, p = named
    return name, (tuple(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad, p.is_meta)


def _say(described: tuple) -> str:
    shape, dtype, trainable, meta = described
    return f"{shape} {dtype}{'' if trainable else ' frozen'}{' on the meta device' if meta else ''}"


def _all_gather_object(obj, comm: Communicator, device: torch.device) -> list:
    """dist.all_gather_object over the group; NCCL carries objects in tensors on the current
    CUDA device, which must be this rank's (the parameters'), or every rank would use GPU 0."""
    out: list = [None] * comm.size
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        dist.all_gather_object(out, obj, group=comm.group)
    return out
