"""Stage 3 (Pos+g+p): parameters live as 1/N shards, gathered one unit at a time.

The model is cut into units: by default each block of the first ModuleList (the transformer
layers), plus a root unit for every other parameter (embeddings, final norm, and any parameter
shared by two units). Each unit is one bucket of the flat layout: rank r keeps the slice
[r·S, (r+1)·S) of it in model precision, and the unit's parameters are views into a full-size
buffer whose storage exists only while the unit is gathered (the storage is resized to zero
when released, so views saved by autograd come back to life when it is gathered again).

Schedule, as in PyTorch FSDP2 (`torch/distributed/fsdp/_fully_shard/`):
- forward: before a unit runs, wait for (or issue) its all-gather and prefetch the next unit's;
  after it runs, release it and hook its outputs, so that their first gradient
- backward: gathers the unit again (prefetching the unit before it in forward order);
- when every trainable parameter of the unit has its gradient, the reducer reduce-scatters the
  unit's gradient into this rank's shard (grad_reducer.py) and the unit is released.
At most `stage3_max_live_units` units are gathered at once (the root counts, since it encloses
the whole forward); parameters of at most `stage3_param_persistence_threshold` elements form one
persistent unit that stays gathered and is all-gathered once after each step.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .comm import Communicator
from .config import ZeroConfig
from .hooks import WeakHook
from .layout import Bucket, Slot, pack_buckets


@dataclass
class Unit:
    """Parameters gathered and released together."""

    name: str
    module: nn.Module | None   # whose forward hooks drive it (None: the persistent unit)
    slots: list[Slot]
    persistent: bool = False
    bucket: Bucket | None = None
    shard: torch.Tensor | None = None  # this rank's slice, model precision, always resident
    flat: torch.Tensor | None = None   # the whole unit; storage allocated only while gathered
    gathered: bool = False
    work: object = None                # in-flight all-gather
    backward_started: bool = False

    @property
    def has_frozen(self) -> bool:
        return any(not s.param.requires_grad for s in self.slots)


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


class Stage3Params:
    """The units of a stage-3 model, their shards, and the gather/release schedule."""

    sharded = True

    def __init__(self, model: nn.Module, slots: list[Slot], config: ZeroConfig, comm: Communicator,
                 device: torch.device, param_init_fn: Callable[[nn.Module], None] | None = None) -> None:
        """`device`: where shards and gathered units live (a meta-device model is built there)."""
        self.comm, self.config, self.device = comm, config, device
        self.units = [u for u in self._build_units(model, slots, config) if u.slots]  # no parameters: no unit
        self.buckets = pack_buckets([u.slots for u in self.units], comm.size)
        for unit, bucket in zip(self.units, self.buckets):
            unit.bucket = bucket
        self.numel = self.buckets[-1].end if self.buckets else 0
        layers_reversed = [u for u in self.units if u.module is not None and u.module is not model]
        root = [u for u in self.units if u.module is model]
        self.forward_order = root + layers_reversed[::-1]   # root, then layers in order
        self.backward_order = root + layers_reversed        # root, then layers reversed
        scheduled = root + layers_reversed
        self.in_backward = False
        self.live_units = 0
        self.peak_live_units = 0
        self.peak_gathered_bytes = 0
        self._fp32_shards = [self._initial_shard(u, model, param_init_fn) for u in self.units]
        self.handles = []  # hooks hold a unit's index and this object weakly (hooks.py)
        for unit in scheduled:
            index = self.units.index(unit)
            self.handles += [unit.module.register_forward_pre_hook(WeakHook(self._pre_forward, index)),
                             unit.module.register_forward_hook(WeakHook(self._post_forward, index))]

    # -- construction -----------------------------------------------------------------------
    def _build_units(self, model: nn.Module, slots: list[Slot], config: ZeroConfig) -> list[Unit]:
        """Units in gradient-ready order: layers last to first, root, persistent."""
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
        return units

    def _initial_shard(self, unit: Unit, model: nn.Module, init: Callable | None) -> torch.Tensor:
        """This rank's fp32 slice of the unit, from the current values or, for parameters on
        the meta device, from `init` run on this unit alone (the whole model never exists)."""
        b = unit.bucket
        full = torch.zeros(b.numel, dtype=self.config.master_dtype, device=self.device)
        on_meta = [s for s in unit.slots if s.param.is_meta]
        if on_meta:
            for s in on_meta:  # a meta tensor cannot take real .data: swap in a real Parameter
                s.param = _replace_parameter(model, s.param, full[s.start - b.start:s.end - b.start])
            owned = {id(s.param) for s in on_meta}
            for m in model.modules():
                if any(id(p) in owned for p in m.parameters(recurse=False)):
                    if init is not None:
                        init(m)
                    elif hasattr(m, "reset_parameters"):
                        m.reset_parameters()
                    else:
                        raise ValueError(f"{type(m).__name__} has parameters on the meta device but no "
                                         "reset_parameters(); pass param_init_fn to initialize()")
        for s in unit.slots:
            if not s.param.is_meta:
                full[s.start - b.start:s.end - b.start].copy_(s.param.detach().reshape(-1))
        lo, hi = b.shard_range(self.comm.rank)
        shard = full[lo - b.start:hi - b.start].clone()
        if on_meta:  # the materialized parameters still view `full`: free it now, not at bind()
            full.untyped_storage().resize_(0)
        return shard

    def owned_range(self, bucket: Bucket) -> tuple[int, int]:
        return bucket.shard_range(self.comm.rank)

    def shard_view(self, bucket: Bucket) -> torch.Tensor:
        unit = self.units[bucket.index]
        return unit.shard if unit.shard is not None else self._fp32_shards[bucket.index]

    def initial_masters(self, bucket: Bucket) -> None:
        """Stage 3 keeps fp32 shards until `bind`: the optimizer copies its masters from them."""
        return None

    def bind(self, dtype: torch.dtype) -> None:
        """Keep only the model-precision shards; parameters become views of released buffers."""
        for unit, fp32 in zip(self.units, self._fp32_shards):
            b = unit.bucket
            unit.shard = fp32.to(dtype)
            unit.flat = torch.empty(b.numel, dtype=dtype, device=unit.shard.device)
            for s in unit.slots:
                s.param.data = unit.flat[s.start - b.start:s.end - b.start].view(s.param.shape)
            unit.flat.untyped_storage().resize_(0)
            if unit.persistent:
                self._gather(unit, async_op=False)
        self._fp32_shards = []

    # -- gather / release -------------------------------------------------------------------
    def _gather(self, unit: Unit, async_op: bool) -> None:
        if unit.gathered:
            return
        unit.flat.untyped_storage().resize_(unit.flat.numel() * unit.flat.element_size())
        unit.work = self.comm.all_gather(unit.flat, unit.shard, purpose="params", async_op=async_op)
        unit.gathered = True
        if not unit.persistent:
            self.live_units += 1
            self.peak_live_units = max(self.peak_live_units, self.live_units)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())

    def _ensure(self, unit: Unit) -> None:
        self._gather(unit, async_op=False)
        if unit.work is not None:
            unit.work.wait()
            unit.work = None

    def release(self, unit: Unit) -> None:
        if unit.persistent or not unit.gathered:
            return
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
        unit.flat.untyped_storage().resize_(0)
        unit.gathered = False
        self.live_units -= 1

    def _prefetch(self, order: list[Unit], current: Unit) -> None:
        budget = self.config.stage3_prefetch_bucket_size
        for unit in order[order.index(current) + 1:]:
            if budget <= 0 or self.live_units >= self.config.stage3_max_live_units:
                return
            self._gather(unit, async_op=self.config.overlap_comm)
            budget -= unit.bucket.numel

    # -- hooks ------------------------------------------------------------------------------
    def _pre_forward(self, index: int, module: nn.Module, args) -> None:
        unit = self.units[index]
        self._ensure(unit)
        if not self.in_backward:  # in backward this is activation recomputation
            self._prefetch(self.forward_order, unit)

    def _post_forward(self, index: int, module: nn.Module, args, output):
        unit = self.units[index]
        if self.in_backward:  # recomputation: the unit's backward is about to run
            return output
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(WeakHook(self._pre_backward, index))
        self.release(unit)
        return output

    def _pre_backward(self, index: int, grad: torch.Tensor) -> None:
        unit = self.units[index]
        if unit.backward_started:
            return
        unit.backward_started = True
        self._ensure(unit)
        self._prefetch(self.backward_order, unit)

    def begin_backward(self) -> None:
        self.in_backward = True
        for unit in self.units:
            unit.backward_started = False

    def on_gradients_complete(self, bucket_index: int) -> None:
        """Every trainable parameter of the unit has its gradient: its backward is over. A unit
        with frozen parameters waits for the end of backward: nothing signals when the last
        node that reads a frozen parameter has run."""
        unit = self.units[bucket_index]
        if not unit.has_frozen:
            self.release(unit)

    def end_backward(self) -> None:
        for unit in self.units:
            self.release(unit)
        self.in_backward = False

    def after_step(self, applied: bool) -> None:
        """The persistent unit holds full parameters: refresh them from the updated shards."""
        if applied and self.units[-1].persistent:
            unit = self.units[-1]
            unit.gathered = False
            self._gather(unit, async_op=False)

    def close(self, gather: bool = True) -> None:
        """Remove the hooks; with `gather`, give each parameter its own storage holding its full
        value, all-gathering unit after unit (collectives: every rank must call it)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for unit in self.units if gather else []:
            self._ensure(unit)
            for s in unit.slots:
                s.param.data = s.param.data.clone()
            self.release(unit)

    # -- accounting -------------------------------------------------------------------------
    def gathered_bytes(self) -> int:
        return sum(u.flat.numel() * u.flat.element_size() for u in self.units if u.gathered)

    def param_tensors(self) -> list[torch.Tensor]:
        """Tensors whose storages hold parameters now: the shards and any gathered buffer."""
        return [u.shard for u in self.units] + [u.flat for u in self.units if u.gathered]


def _replace_parameter(model: nn.Module, old: nn.Parameter, storage: torch.Tensor) -> nn.Parameter:
    """Put a real Parameter viewing `storage` wherever `old` is registered, attributes kept."""
    new = nn.Parameter(storage.view(old.shape), requires_grad=old.requires_grad)
    new.__dict__.update(old.__dict__)
    for m in model.modules():
        for key, p in m._parameters.items():
            if p is old:
                m._parameters[key] = new
    return new


def _tensors(obj) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []
