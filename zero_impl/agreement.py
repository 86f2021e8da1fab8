"""Ranks that agree before they train: one config, one model, the same starting values.

Every collective of the engine assumes that the data-parallel ranks built the same thing: the
same ZeroConfig (bucket sizes set the collectives' sizes and count), the same parameters and
buffers by name, shape and order (the flat layout; one broadcast each), and the same values (each rank updates its shard of one model).
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
    """Raise ValueError on every rank of `comm`'s group, naming the first ZeroConfig key, or the
    first parameter or buffer (name, shape, dtype, trainable, on the meta device, and order: each
    is laid out and broadcast in order), whose value differs between its first rank and another;
    collective on the group, a no-op for a world of one."""
    if not _checked(comm):
        return
    settings = {f.name: getattr(config, f.name) for f in fields(config)}
    tensors = [*(_describe("parameter", *named) for named in module.named_parameters()),
               *(_describe("buffer", *named) for named in module.named_buffers())]
    mine = {"config": settings, "tensors": hashlib.sha1(repr(tensors).encode()).hexdigest()}
    everyone = _all_gather_object(mine, comm, device)
    for rank, theirs in enumerate(everyone[1:], start=1):
        for key, value in settings.items():  # the same keys everywhere: one version of zero_impl
            if everyone[0]["config"][key] != theirs["config"][key]:
                raise ValueError(f"ranks disagree on ZeroConfig.{key}: {everyone[0]['config'][key]!r} on DP rank 0, "
                                 f"{theirs['config'][key]!r} on DP rank {rank}")
    if all(e["tensors"] == mine["tensors"] for e in everyone):
        return
    lists = _all_gather_object(tensors, comm, device)  # every rank sees the mismatch: all take this path
    for rank, theirs in enumerate(lists[1:], start=1):
        if theirs != lists[0]:
            raise ValueError(f"ranks disagree on the model: {_difference(lists[0], theirs, rank)}")


def _difference(first: list[tuple[str, tuple]], theirs: list[tuple[str, tuple]], rank: int) -> str:
    """The first difference between DP rank 0's described tensors and DP rank `rank`'s."""
    ours, other = dict(first), dict(theirs)
    for label, described in theirs:
        if label not in ours:
            return f"{label} is on DP rank {rank}, not on DP rank 0"
        if ours[label] != described:
            return f"{label} is {_say(ours[label])} on DP rank 0, {_say(described)} on DP rank {rank}"
    for label, _ in first:
        if label not in other:
            return f"{label} is on DP rank 0, not on DP rank {rank}"
    index = next(i for i, (a, b) in enumerate(zip(first, theirs)) if a[0] != b[0])
    return (f"registered in another order: number {index} is {first[index][0]} on DP rank 0, "
            f"{theirs[index][0]} on DP rank {rank}")


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


def _describe(kind: str, name: str, t: torch.Tensor) -> tuple[str, tuple]:
    trainable = t.requires_grad if kind == "parameter" else None
    return f"{kind} {name!r}", (tuple(t.shape), str(t.dtype).removeprefix("torch."), trainable, t.is_meta)


def _say(described: tuple) -> str:
    shape, dtype, trainable, meta = described
    return f"{shape} {dtype}{' frozen' if trainable is False else ''}{' on the meta device' if meta else ''}"


def _all_gather_object(obj, comm: Communicator, device: torch.device) -> list:
    """dist.all_gather_object over the group; NCCL carries objects in tensors on the current
    CUDA device, which must be this rank's (the parameters'), or every rank would use GPU 0."""
    out: list = [None] * comm.size
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        dist.all_gather_object(out, obj, group=comm.group)
    return out
