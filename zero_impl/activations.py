"""ZeRO-R for activation checkpoints (paper Section 6): Pa, Pa+cpu and MD.

With activation recomputation, each layer's input is kept from forward to backward (the
checkpoint) and the layer is recomputed from it. Under tensor (model) parallelism every MP rank
keeps the same checkpoint. Here each checkpoint, as autograd saves it, is replaced by:

    Pa      (partition_activations)            this MP rank's 1/MP slice, all-gathered over
                                               the mp group just before the layer's recomputation;
                                               the gathered copy goes when the layer's backward is done
    Pa+cpu  (cpu_checkpointing)                the slice in host memory (pinned, copied on a side
                                               stream on CUDA), brought back one layer ahead of
                                               its recomputation
    MD      (contiguous_memory_optimization)   the kept data (slice or whole checkpoint) copied into a
                                               pre-allocated contiguous arena of `number_checkpoints`
                                               slots as it is produced, so long-lived checkpoints do
                                               not interleave with short-lived activations

      forward                                      backward (last layer first)
      layer input x ─ keep x[r·n/MP:(r+1)·n/MP] ──→ (host) ··· → device → all-gather → x → recompute
                      (MD: in arena slot k)                    (prefetch slot k-1)          → free x

How checkpoints are found: a reentrant checkpoint (megatron-core's CheckpointFunction,
torch.utils.checkpoint with use_reentrant=True) runs the layer under no_grad inside a training
forward and then saves its inputs for backward. A forward pre-hook on each layer (the blocks
of the first ModuleList, or stage3_unit_classes, as stage 3 finds its units) notes the layer's
first tensor input when it runs so; while the engine's forward runs, saved-tensor hooks replace
exactly those tensors when autograd saves them. Every other saved tensor goes through untouched
(to the saved-tensor hooks outside the engine's forward, if any, which also see the slice kept
for each checkpoint). Pa's all-gathers go through the engine's Communicator: counted in its
ledger under the purpose "activations" (all-gather convention: the output, s·b·h elements per
checkpoint and recomputation).

Gathers and host-to-device copies land in reused buffers (CB). A gathered checkpoint's buffer
is taken until autograd releases the checkpoint, right after its layer's backward (the
reentrant checkpoint's node), so in the usual sequential backward one gather buffer of one
checkpoint's size serves every layer; a host slice's device copy is given back once gathered.
The contract, which reentrant checkpoints keep: the tensor a checkpoint is restored to is not
used after its layer's backward. A non-reentrant checkpoint (torch's use_reentrant=False) saves
under saved-tensor hooks of its own and is not seen: the engine then says the forward saved
no checkpoint (ValueError naming the key).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from .comm import Communicator
from .hooks import WeakHook

PURPOSE = "activations"


class _Checkpoint:
    """One saved checkpoint: what is kept of it, where, and how to rebuild it."""

    __slots__ = ("index", "shape", "dtype", "device", "numel", "part", "pool", "slot", "outer", "ready",
                 "__weakref__")

    def __init__(self, index: int, t: torch.Tensor) -> None:
        self.index, self.shape, self.dtype, self.device, self.numel = index, t.shape, t.dtype, t.device, t.numel()
        self.part: torch.Tensor | None = None   # the kept data: slice (Pa) or whole, device or host
        self.pool = "device"
        self.slot: int | None = None            # MD arena slot
        self.outer = None                       # what saved-tensor hooks outside the engine made of `part`
        self.ready: Any = None                  # (pool index, device copy, CUDA event or None) once prefetched


class _Arena:
    """MD: `slots` equal slots in one pre-allocated contiguous tensor, handed out and taken back."""

    def __init__(self, slots: int, slot_numel: int, dtype: torch.dtype, device: torch.device, pin: bool) -> None:
        self.slots, self.slot_numel, self.dtype, self.device = slots, slot_numel, dtype, device
        self.data = torch.empty(slots * slot_numel, dtype=dtype, device=device, pin_memory=pin)
        self.free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def fits(self, numel: int, dtype: torch.dtype, device: torch.device) -> bool:
        return numel == self.slot_numel and dtype == self.dtype and device == self.device

    def view(self, slot: int) -> torch.Tensor:
        return self.data[slot * self.slot_numel:(slot + 1) * self.slot_numel]


class _BufferPool:
    """CB: flat buffers handed out and given back, reused whenever one of the right size is
    free; records their bytes (more than one buffer only when lifetimes overlap)."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.busy: list[int | None] = []  # the owner (a checkpoint's index) of each buffer taken
        self.peak_bytes = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device, owner: int) -> tuple[int, torch.Tensor]:
        free = [i for i, busy in enumerate(self.busy) if busy is None]
        fitting = [i for i in free if (self.buffers[i].numel(), self.buffers[i].dtype, self.buffers[i].device)
                   == (numel, dtype, device)]
        if fitting:
            i = fitting[0]
        else:  # replace a free buffer of another size, or add one
            if free:
                i = free[0]
                self.buffers[i] = None  # the old one goes before the new one is allocated
            else:
                i = len(self.buffers)
                self.buffers.append(None)
                self.busy.append(None)
            self.buffers[i] = torch.empty(numel, dtype=dtype, device=device)
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.busy[i] = owner
        return i, self.buffers[i]

    def give_back(self, i: int, owner: int) -> None:
        if i < len(self.busy) and self.busy[i] == owner:
            self.busy[i] = None

    @property
    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers if b is not None)

    def clear(self) -> None:
        self.buffers, self.busy = [], []


class ActivationCheckpoints:
    """Pa, Pa+cpu and MD for the reentrant activation checkpoints of `module`'s layers."""

    def __init__(self, module: nn.Module, layers: list[nn.Module], mp: Communicator, *, partition: bool,
                 cpu: bool, contiguous: bool, number_checkpoints: int | None) -> None:
        self.mp, self.partition, self.cpu, self.contiguous = mp, partition, cpu, contiguous
        self.number_checkpoints = number_checkpoints or len(layers)
        self.layers = layers
        self.handles = [m.register_forward_pre_hook(WeakHook(self._on_layer), with_kwargs=True, prepend=True)
                        for m in layers]
        self.in_forward = False
        self.outer_hooks = None
        self.candidates: dict[int, weakref.ref] = {}
        self.live: dict[int, weakref.ref] = {}      # index -> checkpoint, while autograd holds it
        self.forward_index = 0
        self.arenas: dict[str, _Arena | None] = {"device": None, "host": None}
        self.gather_pool, self.prefetch_pool = _BufferPool(), _BufferPool()
        self.stream = None  # CUDA side stream for host <-> device copies (created on first use)
        self.kept = {"device": 0, "host": 0}
        self.peak_kept = {"device": 0, "host": 0}
        self.counts = {"checkpoints": 0, "gathers": 0, "gathered_elements": 0, "prefetched": 0, "on_demand": 0}
        self.last_forward_checkpoints = 0
        self.checkpoint_bytes = 0  # one whole checkpoint, as last seen
        self.part_bytes = 0        # what is kept of it (its slice with Pa, padded)

    # -- forward --------------------------------------------------------------------------
    def forward_context(self) -> "_ForwardContext":
        """Around the engine's forward: saved-tensor hooks that catch the checkpoints."""
        return _ForwardContext(self)

    def _on_layer(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        # A layer running under no_grad inside a training forward: a reentrant checkpoint's
        # forward, which will save the layer's inputs once it returns.
        if not self.in_forward or torch.is_grad_enabled():
            return None
        first = next((a for a in args if torch.is_tensor(a)), None)
        if first is None:
            first = next((v for v in kwargs.values() if torch.is_tensor(v)), None)
        if first is not None and first.is_floating_point():
            self.candidates[id(first)] = weakref.ref(first)
        return None

    def _pack(self, t: torch.Tensor) -> Any:
        ref = self.candidates.pop(id(t), None)
        if ref is None or ref() is not t:
            if self.outer_hooks is None:
                return t
            pack, unpack = self.outer_hooks
            return _Outer(unpack, pack(t))
        ckpt = self._keep(t)
        if self.outer_hooks is not None:
            ckpt.outer = self.outer_hooks[0](ckpt.part)  # they see what is kept; held as long as it is
        return ckpt

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Outer):
            return packed.unpack(packed.value)
        if isinstance(packed, _Checkpoint):
            return self._restore(packed)
        return packed

    def _keep(self, t: torch.Tensor) -> _Checkpoint:
        """Replace the checkpoint `t` by what ZeRO-R keeps of it."""
        ckpt = _Checkpoint(self.forward_index, t)
        self.forward_index += 1
        self.counts["checkpoints"] += 1
        self.checkpoint_bytes = t.numel() * t.element_size()
        flat = t.detach().reshape(-1)
        if self.partition:
            n = -(-flat.numel() // self.mp.size)
            lo, hi = min(self.mp.rank * n, flat.numel()), min((self.mp.rank + 1) * n, flat.numel())
            source, numel = flat[lo:hi], n
        else:
            source, numel = flat, flat.numel()
        pool = "host" if self.cpu else "device"
        target_device = torch.device("cpu") if self.cpu else t.device
        pin = self.cpu and t.device.type == "cuda"
        if self.contiguous:
            arena = self._arena(pool, numel, t.dtype, target_device, pin)
            if not arena.free:
                raise RuntimeError(
                    f"ZeroConfig.number_checkpoints ({arena.slots}) is too small: this forward saved checkpoint "
                    f"#{ckpt.index + 1} while {arena.slots} are held for backward (MD's arena has one slot each)")
            ckpt.slot = arena.free.pop()
            part = arena.view(ckpt.slot)
            weakref.finalize(ckpt, _release_slot, weakref.ref(arena), ckpt.slot)
        else:
            part = torch.empty(numel, dtype=t.dtype, device=target_device, pin_memory=pin)
        if source.numel() < numel:
            part[source.numel():].zero_()  # the padding of the last rank's slice
        self._copy(part[:source.numel()], source, ckpt)
        ckpt.part, ckpt.pool = part, pool
        nbytes = self.part_bytes = part.numel() * part.element_size()
        self._count_kept(pool, nbytes)
        weakref.finalize(ckpt, _release_kept, weakref.ref(self), pool, nbytes)
        self.live[ckpt.index] = weakref.ref(ckpt)
        return ckpt

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, ckpt: _Checkpoint) -> None:
        if dst.device.type == "cpu" and src.device.type == "cuda":
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            src.record_stream(stream)  # the allocator keeps `src` until the copy is done
        else:
            dst.copy_(src)

    def _arena(self, pool: str, numel: int, dtype: torch.dtype, device: torch.device, pin: bool) -> _Arena:
        arena = self.arenas[pool]
        if arena is None or (not arena.fits(numel, dtype, device) and len(arena.free) == arena.slots):
            arena = self.arenas[pool] = None  # the old one goes before the new one is allocated
            arena = self.arenas[pool] = _Arena(self.number_checkpoints, numel, dtype, device, pin)
        elif not arena.fits(numel, dtype, device):
            raise RuntimeError(f"MD (ZeroConfig.contiguous_memory_optimization): a checkpoint of {numel} "
                               f"{dtype} elements on {device} does not fit the arena's slots of "
                               f"{arena.slot_numel} {arena.dtype} on {arena.device} while some are in use")
        return arena

    # -- backward -------------------------------------------------------------------------
    def begin_backward(self) -> None:
        """Start bringing the newest checkpoint back, before backward reaches its layer."""
        if self.cpu:
            newest = self._next_below(self.forward_index)
            if newest is not None:
                self._prefetch(newest)

    def _restore(self, ckpt: _Checkpoint) -> torch.Tensor:
        part = ckpt.part
        if ckpt.pool == "host":
            if ckpt.ready is None:
                self.counts["on_demand"] += 1
                self._prefetch(ckpt)
            else:
                self.counts["prefetched"] += 1
            copy, part, event = ckpt.ready
            ckpt.ready = None
            if event is not None:
                torch.cuda.current_stream(ckpt.device).wait_event(event)
        if self.partition:
            index, gathered = self.gather_pool.take(part.numel() * self.mp.size, ckpt.dtype, ckpt.device, ckpt.index)
            weakref.finalize(ckpt, _give_back, weakref.ref(self.gather_pool), index, ckpt.index)  # after its backward
            self.mp.all_gather(gathered, part, purpose=PURPOSE)
            self.counts["gathers"] += 1
            self.counts["gathered_elements"] += gathered.numel()
            full = gathered[:ckpt.numel]
            if ckpt.pool == "host":
                self.prefetch_pool.give_back(copy, ckpt.index)  # read by the gather (before any later copy on CUDA)
        else:
            full = part  # the device copy itself: given back when the checkpoint goes
        if ckpt.pool == "host":
            below = self._next_below(ckpt.index)
            if below is not None:
                self._prefetch(below)  # one layer ahead of its recomputation
        return full.view(ckpt.shape)

    def _next_below(self, index: int) -> _Checkpoint | None:
        """The live checkpoint saved last before `index`: the next one backward will need."""
        best = None
        for i, ref in list(self.live.items()):
            ckpt = ref()
            if ckpt is None:
                del self.live[i]
            elif i < index and (best is None or i > best.index):
                best = ckpt
        return best

    def _prefetch(self, ckpt: _Checkpoint) -> None:
        """Start copying a host checkpoint back to its device (asynchronously on CUDA)."""
        if ckpt.ready is not None or ckpt.pool != "host":
            return
        index, dst = self.prefetch_pool.take(ckpt.part.numel(), ckpt.dtype, ckpt.device, ckpt.index)
        weakref.finalize(ckpt, _give_back, weakref.ref(self.prefetch_pool), index, ckpt.index)  # if never used
        event = None
        if ckpt.device.type == "cuda":
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream(ckpt.device))  # `dst` may have been read there
            with torch.cuda.stream(stream):
                dst.copy_(ckpt.part, non_blocking=True)
                dst.record_stream(stream)  # the allocator must not hand `dst` out while this copy runs
                event = torch.cuda.Event()
                event.record(stream)
        else:
            dst.copy_(ckpt.part)
        ckpt.ready = (index, dst, event)

    def _side_stream(self):
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        return self.stream

    # -- accounting -----------------------------------------------------------------------
    def _count_kept(self, pool: str, nbytes: int) -> None:
        self.kept[pool] += nbytes
        self.peak_kept[pool] = max(self.peak_kept[pool], self.kept[pool])

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this module holds now (ZeroEngine.state_tensors): the kept part of each live
        checkpoint and MD's arena, on the device ("checkpoints") or, with Pa+cpu, in host memory
        ("host_checkpoints"), and the gather and prefetch pools' buffers ("buffers")."""
        out: dict[str, list[torch.Tensor]] = {"checkpoints": [], "host_checkpoints": []}
        kind = {"device": "checkpoints", "host": "host_checkpoints"}
        for pool, arena in self.arenas.items():
            if arena is not None:
                out[kind[pool]].append(arena.data)
        for ref in self.live.values():
            ckpt = ref()
            if ckpt is not None and ckpt.part is not None:
                out[kind[ckpt.pool]].append(ckpt.part)
        out["buffers"] = [b for pool in (self.gather_pool, self.prefetch_pool) for b in pool.buffers if b is not None]
        return out

    def buffer_bytes(self) -> dict[str, int]:
        """CB: bytes of each buffer this module allocated (peak), by name."""
        out = {"pa_gather": self.gather_pool.peak_bytes} if self.partition else {}
        if self.cpu:
            out["pa_cpu_prefetch"] = self.prefetch_pool.peak_bytes
        if self.contiguous:
            for pool, arena in self.arenas.items():
                if arena is not None or pool == ("host" if self.cpu else "device"):
                    out[f"md_arena_{pool}"] = arena.nbytes if arena is not None else 0
        return out

    def buffer_limits(self) -> dict[str, int]:
        """What each buffer may hold: one gathered checkpoint (padded to a multiple of MP); two
        slices on their way back to the device (the one recomputed and the one prefetched);
        number_checkpoints kept parts (slices with Pa, whole checkpoints without)."""
        part = self.part_bytes
        out = {"pa_gather": part * self.mp.size} if self.partition else {}
        if self.cpu:
            out["pa_cpu_prefetch"] = 2 * part
        if self.contiguous:
            for name in self.buffer_bytes():
                if name.startswith("md_arena"):
                    out[name] = self.number_checkpoints * part
        return out

    def stats(self) -> dict[str, Any]:
        held = sum(1 for ref in self.live.values() if ref() is not None)
        return {"partition_activations": self.partition, "cpu_checkpointing": self.cpu,
                "contiguous_memory_optimization": self.contiguous, "number_checkpoints": self.number_checkpoints,
                "checkpoint_bytes": self.checkpoint_bytes, "held_checkpoints": held,
                "kept_bytes": dict(self.kept), "peak_kept_bytes": dict(self.peak_kept), **self.counts}

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.arenas = {"device": None, "host": None}
        self.gather_pool.clear()
        self.prefetch_pool.clear()


class _Outer:
    """A saved tensor that is not a checkpoint, as the saved-tensor hooks outside packed it."""

    __slots__ = ("unpack", "value")

    def __init__(self, unpack: Any, value: Any) -> None:
        self.unpack, self.value = unpack, value


class _ForwardContext:
    def __init__(self, owner: ActivationCheckpoints) -> None:
        self.owner = owner
        self.hooks = None

    def __enter__(self) -> None:
        owner = self.owner
        owner.in_forward = torch.is_grad_enabled()
        owner.outer_hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        owner.candidates.clear()
        owner.live = {i: ref for i, ref in owner.live.items() if ref() is not None}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(owner._pack, owner._unpack)
        self.hooks.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.hooks.__exit__(*exc)
        self.owner.in_forward = False
        self.owner.candidates.clear()


def _give_back(pool_ref: weakref.ref, index: int, owner: int) -> None:
    pool = pool_ref()
    if pool is not None:
        pool.give_back(index, owner)


def _release_slot(arena_ref: weakref.ref, slot: int) -> None:
    arena = arena_ref()
    if arena is not None:
        arena.free.append(slot)


def _release_kept(owner_ref: weakref.ref, pool: str, nbytes: int) -> None:
    owner = owner_ref()
    if owner is not None:
        owner.kept[pool] -= nbytes
