"""Stage 3's units: the groups of parameters gathered and released together, and their layout.

By default each block of the first ModuleList (the transformer layers) is a unit, and a root
unit holds every other parameter (embeddings, final norm, and any parameter shared by two
units); parameters of at most `stage3_param_persistence_threshold` elements form one persistent
unit. A unit is one or two buckets of the flat layout (layout.py), back to back: its trainable
parameters, then its frozen ones, so that only trainable elements are reduce-scattered.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from .config import ZeroConfig
from .layout import Bucket, Slot, pack_buckets


@dataclass
class Unit:
    """Parameters gathered and released together."""

    name: str
    module: nn.Module | None   # whose forward hooks drive it (None: the persistent unit)
    slots: list[Slot]
    persistent: bool = False
    buckets: list[Bucket] = field(default_factory=list)  # trainable, then frozen (either may be absent)
    shard: torch.Tensor | None = None  # this rank's slice of each bucket, model precision, always resident
    flat: torch.Tensor | None = None   # the whole unit; storage allocated only while gathered
    gathered: bool = False
    works: list = field(default_factory=list)  # in-flight all-gathers
    prefetched: bool = False           # gathered ahead of its use, not used yet
    counted_in: int = -1               # the pass whose gather count includes this unit
    backward_started: bool = False
    grads_done: bool = False           # every trainable parameter has its gradient in this backward
    inputs_pending: int = 0            # post-backward signals registered and not yet fired

    @property
    def has_frozen(self) -> bool:
        return any(not s.param.requires_grad for s in self.slots)

    @property
    def start(self) -> int:
        return self.buckets[0].start

    @property
    def numel(self) -> int:
        return self.buckets[-1].end - self.start


def find_unit_modules(model: nn.Module, class_names: tuple[str, ...] | None) -> list[tuple[str, nn.Module]]:
    """Outermost submodules whose class is named in `class_names`, or else the children of the
    first ModuleList in the model (its transformer layers), in registration order."""
    if class_names:
        found: list[tuple[str, nn.Module]] = []
        for name, m in model.named_modules():
            inside = any(name.startswith(prefix + ".") for prefix, _ in found)
            if m is not model and type(m).__name__ in class_names and not inside:
                found.append((name, m))
        if not found:
            raise ValueError(f"ZeroConfig.stage3_unit_classes {list(class_names)}: no such submodule in "
                             f"{type(model).__name__}")
        return found
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList):
            return [(f"{name}.{i}", child) for i, child in enumerate(m)]
    return []


def build_units(model: nn.Module, slots: list[Slot], config: ZeroConfig) -> list[Unit]:
    """Units in gradient-ready order: layers last to first, root, persistent; units without
    parameters are left out."""
    owner: dict[int, set[int]] = {}
    layers = find_unit_modules(model, config.stage3_unit_classes)
    if not layers:
        warnings.warn(f"stage 3 found no ModuleList in {type(model).__name__} and no stage3_unit_classes: the "
                      "whole model is one unit, gathered for all of forward and backward", stacklevel=3)
    for index, (_, module) in enumerate(layers):
        for _, p in module.named_parameters(remove_duplicate=False):
            owner.setdefault(id(p), set()).add(index)
    members: list[list[Slot]] = [[] for _ in layers]
    root, persistent = [], []
    for slot in slots:  # slots come in reverse registration order already
        units = owner.get(id(slot.param), set())
        if slot.numel <= config.stage3_param_persistence_threshold:
            persistent.append(slot)
        elif len(units) == 1:
            members[units.pop()].append(slot)
        else:  # not in any layer, or shared by two layers: the root holds it all along
            root.append(slot)
    units = [Unit(name, module, m) for (name, module), m in zip(layers, members)][::-1]
    units.append(Unit("<root>", model, root))
    if persistent:
        units.append(Unit("<persistent>", None, persistent, persistent=True))
    return [u for u in units if u.slots]


def lay_out(units: list[Unit], shard_count: int) -> list[Bucket]:
    """Assign each unit its buckets, back to back: its trainable parameters, then its frozen ones
    (either may be absent), each padded as layout.py pads (a multiple of `shard_count` at least).
    Only the first is ever reduce-scattered; the optimizer finds no master in the second."""
    buckets = pack_buckets([[s for s in u.slots if s.param.requires_grad != frozen]
                            for u in units for frozen in (False, True)], shard_count)
    unit_of = {id(s): u for u in units for s in u.slots}
    for b in buckets:
        unit_of[id(b.slots[0])].buckets.append(b)
    return buckets
