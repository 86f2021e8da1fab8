"""Stage 3 (Pos+g+p): parameters live as 1/N shards, gathered one unit at a time.

The model is cut into units (stage3_units.py): by default each transformer layer, plus a root
unit for every other parameter. Rank r keeps the slice [r·S, (r+1)·S) of each of a unit's
buckets in model precision; the unit's parameters are views into a full-size buffer whose
storage exists only while the unit is gathered (the storage is resized to zero when released,
so views saved by autograd come back to life when it is gathered again). A unit's frozen
parameters have a bucket of their own, gathered like the other but never reduce-scattered:
they cost no gradient traffic and no gradient memory, and have no masters.

Schedule, as in PyTorch FSDP2 (`torch/distributed/fsdp/_fully_shard/`):
- forward: before a unit runs, wait for (or issue) its all-gather and prefetch the next units'
  (in forward order); after it runs, release it and hook its outputs;
- backward begins for a unit at the first gradient reaching its outputs or, under activation
  recomputation, when its forward runs again inside backward: it is gathered again and the
  units before it (the next in backward order) are prefetched;
- backward is over for a unit when every trainable parameter has its gradient (the reducer
  then reduce-scatters the unit's gradient into this rank's shard, grad_reducer.py) and the
  gradients of its inputs are computed (stage3_signals.py): the unit is released. A trainable
  parameter still without a gradient then (a branch this rank skipped) is reduced as zeros, there,
  so every rank issues the unit's reduce-scatter at the same point of its schedule.
The root unit stays gathered from its forward to its backward (stage3_keep_root, as FSDP2 keeps
its root: backward begins with it, so releasing it would gather it again at once), unless the
forward ran without gradients; a root kept by a forward no backward followed is released at the
next step() (or close()). At most `stage3_max_live_units` units are gathered at once (the
root counts, since it encloses the whole forward); parameters of at most
`stage3_param_persistence_threshold` elements form one persistent unit that stays gathered and
is all-gathered once after each step.
"""
from __future__ import annotations

from contextlib import contextmanager

from typing import Callable

import torch
from torch import nn

from . import agreement
from .comm import Communicator
from .config import ZeroConfig
from .hooks import WeakHook
from .layout import Bucket, Slot
from .stage3_signals import tensors, wrap_inputs
from .stage3_units import Unit, build_units, lay_out


class Stage3Params:
    """The units of a stage-3 model, their shards, and the gather/release schedule."""

    sharded = True

    def __init__(self, model: nn.Module, slots: list[Slot], config: ZeroConfig, comm: Communicator,
                 device: torch.device, param_init_fn: Callable[[nn.Module], None] | None = None) -> None:
        """`device`: where shards and gathered units live (a meta-device model is built there)."""
        self.comm, self.config, self.device = comm, config, device
        self.units = build_units(model, slots, config)
        self.buckets = lay_out(self.units, comm.size)
        self.unit_of_bucket = [0] * len(self.buckets)  # bucket index -> unit index
        self._shard_offset = [0] * len(self.buckets)   # bucket index -> where its slice starts in the unit's shard
        for i, unit in enumerate(self.units):
            for k, b in enumerate(unit.buckets):
                self.unit_of_bucket[b.index] = i
                self._shard_offset[b.index] = sum(x.shard_numel for x in unit.buckets[:k])
        self.numel = self.buckets[-1].end if self.buckets else 0
        layers_reversed = [u for u in self.units if u.module is not None and u.module is not model]
        root = [u for u in self.units if u.module is model]
        self.forward_order = root + layers_reversed[::-1]   # root, then layers in order
        self.backward_order = root + layers_reversed        # root, then layers reversed
        self.root = root[0] if root else None
        self.in_backward = False
        self.live_units = 0
        self.peak_live_units = 0
        self.peak_gathered_bytes = 0
        self.passes, self.pass_kind = 0, None  # passes begun (all forwards between two backwards: one)
        self.gathers = {key: {"prefetched": 0, "on_demand": 0} for key in ("forward", "backward", "total")}
        self._fp32_shards = [self._initial_shard(u, model, param_init_fn) for u in self.units]
        # the reducer's report_unused, held weakly (the reducer holds this object): the engine
        # sets it to a WeakMethod
        self.report_unused: Callable[[], Callable[[int], None]] | None = None
        self.handles = []  # hooks hold a unit's index and this object weakly (hooks.py)
        for unit in root + layers_reversed:
            index = self.units.index(unit)
            self.handles += [unit.module.register_forward_pre_hook(WeakHook(self._pre_forward, index),
                                                                   with_kwargs=True),
                             unit.module.register_forward_hook(WeakHook(self._post_forward, index))]

    # -- construction -----------------------------------------------------------------------
    def _initial_shard(self, unit: Unit, model: nn.Module, init: Callable | None) -> torch.Tensor:
        """This rank's fp32 slices of the unit's buckets, from the current values or, for parameters
        on the meta device, from `init` run on this unit alone (the whole model never exists)."""
        full = torch.zeros(unit.numel, dtype=self.config.master_dtype, device=self.device)
        on_meta = [s for s in unit.slots if s.param.is_meta]
        if on_meta:
            for s in on_meta:  # a meta tensor cannot take real .data: swap in a real Parameter
                s.param = _replace_parameter(model, s.param, full[s.start - unit.start:s.end - unit.start])
            owned = {id(s.param) for s in on_meta}
            for m in model.modules():
                if any(id(p) in owned for p in m.parameters(recurse=False)):
                    with _hide_other_units(m, owned):
                        if init is not None:
                            init(m)
                        elif hasattr(m, "reset_parameters"):
                            m.reset_parameters()
                        else:
                            raise ValueError(f"{type(m).__name__} has parameters on the meta device but no "
                                             "reset_parameters(); pass param_init_fn to initialize()")
        for s in unit.slots:
            if not s.param.is_meta:
                full[s.start - unit.start:s.end - unit.start].copy_(s.param.detach().reshape(-1))
        if on_meta:  # each rank ran `init` on its own: the DP group's first rank's values for all
            agreement.broadcast(full, self.comm)  # (the rest came broadcast: agreement.py)
        shard = torch.cat([full[lo - unit.start:hi - unit.start]
                           for lo, hi in (b.shard_range(self.comm.rank) for b in unit.buckets)])
        if on_meta:  # the materialized parameters still view `full`: free it now, not at bind()
            full.untyped_storage().resize_(0)
        return shard

    def owned_range(self, bucket: Bucket) -> tuple[int, int]:
        return bucket.shard_range(self.comm.rank)

    def shard_view(self, bucket: Bucket) -> torch.Tensor:
        i = self.unit_of_bucket[bucket.index]
        shard = self.units[i].shard if self.units[i].shard is not None else self._fp32_shards[i]
        return shard[self._shard_offset[bucket.index]:][:bucket.shard_numel]

    def initial_masters(self, bucket: Bucket) -> None:
        """Stage 3 keeps fp32 shards until `bind`: the optimizer copies its masters from them."""
        return None

    def bind(self, dtype: torch.dtype) -> None:
        """Keep only the model-precision shards; parameters become views of released buffers."""
        for unit, fp32 in zip(self.units, self._fp32_shards):
            unit.shard = fp32.to(dtype)
            unit.flat = torch.empty(unit.numel, dtype=dtype, device=unit.shard.device)
            for s in unit.slots:
                s.param.data = unit.flat[s.start - unit.start:s.end - unit.start].view(s.param.shape)
            unit.flat.untyped_storage().resize_(0)
            if unit.persistent:
                self._gather(unit, async_op=False)
        self._fp32_shards = []

    # -- gather / release -------------------------------------------------------------------
    def _gather(self, unit: Unit, async_op: bool) -> None:
        if unit.gathered:
            return
        unit.flat.untyped_storage().resize_(unit.flat.numel() * unit.flat.element_size())
        unit.works = [self.comm.all_gather(unit.flat[b.start - unit.start:b.end - unit.start], self.shard_view(b),
                                           purpose="params", async_op=async_op) for b in unit.buckets]
        unit.gathered = True
        if not unit.persistent:
            self.live_units += 1
            self.peak_live_units = max(self.peak_live_units, self.live_units)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())

    def _wait(self, unit: Unit) -> None:
        for work in unit.works:
            if work is not None:
                work.wait()
        unit.works = []

    def _ensure(self, unit: Unit) -> None:
        self._gather(unit, async_op=False)
        self._wait(unit)

    def _use(self, unit: Unit) -> None:
        """The unit is needed now: count its gather once per pass (prefetched, or issued now and
        waited on), then make sure it is gathered."""
        if unit.counted_in != self.passes and not unit.persistent and (unit.prefetched or not unit.gathered):
            unit.counted_in = self.passes
            for key in ("backward" if self.in_backward else "forward", "total"):
                self.gathers[key]["prefetched" if unit.gathered else "on_demand"] += 1
        unit.prefetched = False
        self._ensure(unit)

    def release(self, unit: Unit) -> None:
        if unit.persistent or not unit.gathered:
            return
        self._wait(unit)
        unit.flat.untyped_storage().resize_(0)
        unit.gathered = unit.prefetched = False
        self.live_units -= 1

    def _prefetch(self, order: list[Unit], current: Unit) -> None:
        budget = self.config.stage3_prefetch_bucket_size
        for unit in order[order.index(current) + 1:]:
            if budget <= 0 or self.live_units >= self.config.stage3_max_live_units:
                return
            if not unit.gathered:
                self._gather(unit, async_op=self.config.overlap_comm)
                unit.prefetched = True
            budget -= unit.numel

    # -- hooks ------------------------------------------------------------------------------
    def _begin_pass(self, kind: str) -> None:
        self.passes += 1
        self.pass_kind = kind
        self.gathers[kind] = {"prefetched": 0, "on_demand": 0}

    def _pre_forward(self, index: int, module: nn.Module, args, kwargs):
        unit = self.units[index]
        if not self.in_backward:
            if self.pass_kind != "forward":  # the first forward since a backward
                self._begin_pass("forward")
            self._use(unit)
            self._prefetch(self.forward_order, unit)
        else:  # activation recomputation: the unit's backward begins
            self._begin_unit_backward(unit)
            if unit.inputs_pending:  # the forward's graph is the one backpropagated (non-reentrant)
                return None
        args, kwargs, wrapped = wrap_inputs(args, kwargs, WeakHook(self._post_backward, index))
        unit.inputs_pending += wrapped
        return (args, kwargs) if wrapped else None

    def _post_forward(self, index: int, module: nn.Module, args, output):
        unit = self.units[index]
        if self.in_backward:  # recomputation: the unit's backward is about to run
            return output
        if torch.is_grad_enabled():
            for t in tensors(output, requiring_grad=True):
                t.register_hook(WeakHook(self._pre_backward, index))
            if unit is self.root and self.config.stage3_keep_root:
                return output  # backward begins with the root: keep it, gathered, until then
        self.release(unit)
        return output

    def _pre_backward(self, index: int, grad: torch.Tensor) -> None:
        self._begin_unit_backward(self.units[index])

    def _begin_unit_backward(self, unit: Unit) -> None:
        self._use(unit)
        if not unit.backward_started:
            unit.backward_started = True
            self._prefetch(self.backward_order, unit)

    def _post_backward(self, index: int) -> None:
        """Autograd computed the gradients of the unit's inputs (stage3_signals.py)."""
        unit = self.units[index]
        unit.inputs_pending = max(0, unit.inputs_pending - 1)
        if self.in_backward and not unit.inputs_pending and not unit.grads_done:
            self._report_unused(unit)
        self._release_if_done(unit)

    def _report_unused(self, unit: Unit) -> None:
        """The unit's backward is over and a trainable parameter of it got no gradient: a branch
        this rank skipped, or a parameter no rank uses. Left pending, the bucket would be reduced
        only at the end of backward here and now on a rank that took the branch, with other
        gathers in between: the ranks' collectives would part ways (a hang on NCCL). Reported
        now with a zero gradient, it is reduced at this same point on every rank, and the
        gradient is the ranks' average with zeros, as at stages 0-2 and under DDP's
        find_unused_parameters. A unit's parameters all get their gradients before its inputs'
        (autograd runs a parameter's AccumulateGrad first; one shared with another unit is the
        root's), so no real gradient is lost."""
        for b in unit.buckets:
            self.report_unused()(b.index)

    def on_gradients_complete(self, bucket_index: int) -> None:
        """Every trainable parameter of the unit has its gradient (the reducer's signal)."""
        unit = self.units[self.unit_of_bucket[bucket_index]]
        unit.grads_done = True
        self._release_if_done(unit)

    def _release_if_done(self, unit: Unit) -> None:
        """Release a unit whose backward is over: its trainable parameters have their gradients
        and its inputs theirs. The root encloses the whole forward: a frozen parameter of it
        may be read until the end of backward, so a root with one is released there."""
        root_with_frozen = unit is self.root and unit.has_frozen
        if self.in_backward and unit.grads_done and not unit.inputs_pending and not root_with_frozen:
            self.release(unit)

    def begin_backward(self) -> None:
        self.in_backward = True
        self._begin_pass("backward")
        for unit in self.units:
            unit.backward_started = False
            unit.grads_done = not any(s.param.requires_grad for s in unit.slots)

    def end_backward(self) -> None:
        for unit in self.units:
            self.release(unit)
            unit.inputs_pending = 0  # signals of graphs not backpropagated (a forward without backward)
        self.in_backward = False

    def finish_gathers(self) -> None:
        """Stages 1-2's lazily waited post-step gathers: stage 3 has none (its units are gathered
        where they are used, and a root kept between forward and backward stays kept)."""

    def before_step(self) -> None:
        """Before the optimizer writes the shards: release every gathered unit but the persistent
        one, waiting on its gathers first. A unit still gathered here holds values the step is
        about to make stale (a root kept by a forward no backward followed; layers prefetched by
        a forward that stopped early, such as an early-exit evaluation), and its in-flight
        prefetch reads the shards the step writes; the next forward gathers the updated values.
        The pending-input counts of such a forward's graph go too: no backward will run it, and
        left set they would hold units past their backward in the next one."""
        for unit in self.units:
            self.release(unit)
            unit.inputs_pending = 0

    def after_step(self, applied: bool) -> None:
        """The persistent unit holds full parameters: refresh them from the updated shards."""
        if applied and self.units[-1].persistent:
            unit = self.units[-1]
            unit.gathered = False
            self._gather(unit, async_op=False)
            self._wait(unit)

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

    def schedule_stats(self) -> dict:
        """Gathers of units prefetched ahead of their use versus issued and waited on when the
        unit was needed ("on_demand"), each unit counted once per pass: "forward" counts all
        forwards since the last backward, "backward" the last backward, "total" every pass."""
        return {**{key: dict(counts) for key, counts in self.gathers.items()},
                "peak_live_units": self.peak_live_units, "root_kept_elements": self.root_kept_elements()}

    def root_kept_elements(self) -> int:
        """Elements of the gather a step saves by keeping the root between forward and backward
        (stage3_keep_root): the paper's 3Ψ less these."""
        return self.root.numel if self.root is not None and self.config.stage3_keep_root else 0

    # -- accounting -------------------------------------------------------------------------
    def gathered_bytes(self) -> int:
        return sum(u.flat.numel() * u.flat.element_size() for u in self.units if u.gathered)

    def bucket_limit(self) -> int:
        """Elements of the largest bucket: a unit's trainable parameters are one bucket, so a
        layer sets the bound, whatever reduce_bucket_size says."""
        return max([b.numel for b in self.buckets], default=0)

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The resident shards and the persistent unit ("params"), and every other unit's full
        buffer, whose storage has its bytes only while the unit is gathered ("gathered_params")."""
        return {"params": [u.shard for u in self.units] + [u.flat for u in self.units if u.persistent],
                "gathered_params": [u.flat for u in self.units if not u.persistent]}


def _replace_parameter(model: nn.Module, old: nn.Parameter, storage: torch.Tensor) -> nn.Parameter:
    """Put a real Parameter viewing `storage` wherever `old` is registered, attributes kept."""
    new = nn.Parameter(storage.view(old.shape), requires_grad=old.requires_grad)
    # old's attributes (megatron's tensor_model_parallel...), not a tensor subclass's own state
    # (a FakeTensor keeps its device there: copied, a simulation's new parameter would be on meta)
    new.__dict__.update({k: v for k, v in old.__dict__.items() if k not in new.__dict__})
    for m in model.modules():
        for key, p in m._parameters.items():
            if p is old:
                m._parameters[key] = new
    return new


@contextmanager
def _hide_other_units(module: nn.Module, owned: set[int]):
    """While `module` is initialized for one unit, its parameters that an earlier unit already
    materialized (a bias under the persistence threshold, a weight in another unit) view storage
    that unit has released: stand meta tensors in for them, so the init cannot write there."""
    hidden = {k: p for k, p in module._parameters.items()
              if p is not None and id(p) not in owned and not p.is_meta}
    for k, p in hidden.items():
        module._parameters[k] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    try:
        yield
    finally:
        module._parameters.update(hidden)
