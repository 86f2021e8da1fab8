"""The partitioned optimizer shared by all stages: fp32 master shard, norm, clipping, loss scale.

Whatever the stage, after backward each rank holds the reduced gradient of the slices of the
flat buffer it owns (stage 0 "owns" everything). This module turns those slices into fp32
master tensors, one per (bucket, param group) piece, hands them to an ordinary element-wise
torch optimizer, and writes the updated values back into the model-precision shard.

The update runs in chunks of at most `bucket_size` master elements (or one larger master: a
master is one bucket's shard of one param group and is never split), CB (paper Section 6.2)
applied to the step: its temporaries (the gradients' copy in fp32 when they are fp16/bf16, a
foreach Adam's square root of every second moment) are then bounded by the config, not by the
shard. At once, they cost up to 8 bytes per owned element on top of mixed-precision Adam's 16,
which put Figure 2's 170B point over its 31 GB. Chunking is exact only for optimizers whose
every counter is per parameter (torch.optim's Adam, AdamW, SGD, ...: `CHUNKABLE`); any other
optimizer steps the whole shard at once. Step hooks fire once per chunk (torch's MemTracker,
which marks phases with them, is unaffected; a hook that counts steps is not).
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch._subclasses.fake_tensor import is_fake

from .comm import Communicator
from .layout import Bucket, Piece
from .loss_scaler import LossScaler


# torch.optim's element-wise optimizers whose state, step counter included, is per parameter: a
# step() over some parameters (the others have no .grad) leaves the others exactly as they were.
# Exact types only: a subclass may count steps per group (as apex's and TE's FusedAdam do).
CHUNKABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, torch.optim.Adamax,
             torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adadelta)


@dataclass
class OwnedShard:
    """The slice [lo, hi) of one bucket that this rank updates, in model precision."""

    bucket: Bucket
    lo: int
    hi: int
    param: torch.Tensor        # model-precision storage of [lo, hi)
    grad: torch.Tensor | None  # reduced gradient of [lo, hi) (reduce dtype) once backward is done
    initial: dict[int, torch.Tensor] | None = None  # {piece start: master values} to adopt as masters


@dataclass
class Master:
    """fp32 master tensor of one piece of an owned shard."""

    shard: OwnedShard
    piece: Piece
    tensor: torch.nn.Parameter

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """The part of a shard-shaped tensor `t` that this master covers."""
        return t[self.piece.start - self.shard.lo:self.piece.end - self.shard.lo]


OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


class ShardedOptimizer:
    """Updates this rank's shards with a torch optimizer built by `factory` over fp32 masters.

    `grads_replicated` is True for stage 0, where every rank holds the whole all-reduced
    gradient, so norms must not be summed over data-parallel ranks. The masters start from the
    model's original values, not from their model-precision rounding: adopted from a shard's
    `initial` pieces (stages 0-2 cut them while building the flat buffer), or copied from
    `param` while it still holds them (stage 3, before `bind`).
    """

    def __init__(self, shards: list[OwnedShard], group_options: list[dict], factory: OptimizerFactory, *, clip_grad_norm: float,
                 scaler: LossScaler, dp: Communicator, mp: Communicator, grads_replicated: bool,
                 share_master: bool, master_dtype: torch.dtype = torch.float32,
                 bucket_size: int | None = None, grad_divisor: float = 1.0) -> None:
        """`grad_divisor`: the reduced gradients are sums, divided by this (the DP size) here
        (grad_reducer.step_divisor)."""
        self.shards = shards
        self.clip_grad_norm = clip_grad_norm
        self.grad_divisor = grad_divisor
        self.scaler = scaler
        self.dp, self.mp = dp, mp
        self.grads_replicated = grads_replicated
        self.share_master = share_master  # fp32/fp64 training: the master *is* the model's shard
        self.master_dtype = master_dtype
        self.masters: list[Master] = []
        for shard in shards:
            for piece in shard.bucket.pieces(shard.lo, shard.hi, key=lambda s: s.group):
                if piece.key is None:  # frozen: no master, no optimizer state
                    continue
                data = shard.param[piece.start - shard.lo:piece.end - shard.lo]
                if shard.initial is not None:  # cut from the model's values for us: adopt it
                    data = shard.initial[piece.start]
                elif not share_master:
                    data = data.detach().to(master_dtype, copy=True)
                self.masters.append(Master(shard, piece, torch.nn.Parameter(data)))
        self.excluded_from_norm = [  # (shard, piece) of TP duplicates, counted on TP rank 0 only
            (shard, piece) for shard in shards
            for piece in shard.bucket.pieces(shard.lo, shard.hi, key=lambda s: s.counted_in_norm)
            if not piece.key]
        groups = [dict(options, params=[m.tensor for m in self.masters if m.piece.key == index])
                  for index, options in enumerate(group_options)]
        self.optimizer = factory(groups)
        # master elements per update: None, the whole shard at once, unless the optimizer is CHUNKABLE
        self.chunk_elements = bucket_size if type(self.optimizer) in CHUNKABLE else None
        self.chunks = _chunks(self.masters, self.chunk_elements)
        # torch's fused optimizers take GradScaler's grad_scale (they divide the gradients by it in
        # their kernel) and found_inf (they skip a flagged update themselves)
        self.takes_grad_scale = bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))
        self.skips_on_device = self.takes_grad_scale
        self._divisor: tuple[float, torch.Tensor] | None = None
        self._step_plan: _Plan | None = None
        self._grad_norm: torch.Tensor | None = None  # device values, read when asked (grad_norm, skipped_steps)
        self._norm_scale = 1.0  # _grad_norm / _norm_scale is the norm (a fixed divisor: divided when read)
        self._skipped: torch.Tensor | int = 0
        self.placeholder_states = False  # init_states' states, until a checkpoint is loaded into them
        self._placeholders: list[weakref.ref] = []  # init_states' state tensors, until the first step
        # torch's own load (optimizer.load_state_dict, as DCP's set_optimizer_state_dict calls it)
        # puts a checkpoint's states in place of the placeholders: the first step keeps those.
        # A weak reference: the optimizer may outlive this object (an LR scheduler holds it).
        self.optimizer.register_load_state_dict_post_hook(functools.partial(_states_loaded, weakref.ref(self)))

    # -- the step: no host sync, launches independent of the bucket count ------------------------
    def global_grad_sums(self) -> torch.Tensor:
        """The sum of squares of the global gradient, all-reduced over the DP (not at stage 0,
        where each rank holds all of it) and TP groups, a device tensor summed in fp32 (in the
        gradients' own dtype when wider: fp64). One element;
        under tensor parallelism two, [counted, all]: TP duplicates are counted once in the
        first, and the second holds every element for the overflow test (every rank makes the
        same two-element call, whichever pieces it excludes). One foreach norm over all shards
        and a dot of the norms: the same kernels whatever the bucket count."""
        plan = self._plan()
        dtype = self._norm_dtype()
        if plan.grads:
            norms = torch.stack(torch._foreach_norm(plan.grads, 2, dtype=dtype))
            total = torch.dot(norms, norms)
        else:
            total = torch.zeros((), dtype=dtype, device=self._device())
        if self.mp.size > 1:
            counted = total
            if plan.excluded:
                ex = torch.stack(torch._foreach_norm(plan.excluded, 2, dtype=dtype))
                counted = total - torch.dot(ex, ex)
            sums = torch.stack([counted, total])
        else:
            sums = total.reshape(1)
        # Stage 0: every DP rank holds the same all-reduced gradient, bit for bit (NCCL and gloo
        # reduce each element once, then copy it to every rank), and computes the same sums from
        # it, as DDP with clip_grad_norm_ relies on: the same kernels on the same GPU model give
        # the same bits. Mixed GPU models in one DP group would need this all-reduce back.
        if not self.grads_replicated:
            self.dp.all_reduce(sums, purpose="norm")
        self.mp.all_reduce(sums, purpose="norm")
        return sums

    def _norm_dtype(self) -> torch.dtype:
        return torch.promote_types(self.shards[0].grad.dtype, torch.float32) if self.shards else torch.float32

    def _device(self) -> torch.device:
        return self.shards[0].grad.device if self.shards else torch.device("cpu")

    def step(self) -> bool | StepApplied:
        """Apply one update from the reduced gradients. In fp16 (loss scaling) a step whose
        gradients are not all finite is skipped (nothing changed) on every rank, and the dynamic
        scale lowered; in bf16 and fp32, as in torch, FSDP2 and Megatron, nothing is tested.

        Everything is decided on the device: the norm, the clip coefficient, the overflow flag,
        the skip and the loss-scale update are tensors queued behind the gradients. An optimizer
        that takes GradScaler's `grad_scale` and `found_inf` (torch's fused Adam, AdamW, SGD,
        Adagrad: `_step_supports_amp_scaling`) gets the unscale, the DP average and the clip as
        one divisor, applied in its own kernel, and skips a flagged update itself: no value
        reaches the host and an fp16 step answers with a StepApplied, read only when asked. Any
        other optimizer gets its gradients multiplied in one foreach, and cannot skip on the
        device: in fp16 the flag is read (one sync per step, GradScaler's own fallback)."""
        if self._placeholders:
            self._settle_placeholders()
        sums = self.global_grad_sums()
        scale = self.scaler.factor()
        if self.grad_divisor != 1:
            scale = scale * self.grad_divisor  # the loss scale and the DP average, undone at once
        found_inf = None
        if self.scaler.enabled:  # 1.0 when a gradient is not finite (inf * 0 and nan * 0 are nan), else 0.0
            found_inf = (sums[-1] * 0).nan_to_num_(nan=1.0)
        raw = sums[0].clamp(min=0).sqrt() if self.mp.size > 1 else sums[0].sqrt()  # a difference may round below 0
        self._grad_norm, self._norm_scale = (raw / scale, 1.0) if torch.is_tensor(scale) else (raw, scale)
        coef = grad_scale = None
        if self.takes_grad_scale:
            if self.clip_grad_norm > 0:  # 1 / (min(1, clip / (norm + 1e-6)) / scale), clip_grad_norm_'s formula
                grad_scale = ((raw + 1e-6 * scale) * (1 / self.clip_grad_norm)).clamp_(min=scale)
            elif torch.is_tensor(scale) or scale != 1:
                grad_scale = scale if torch.is_tensor(scale) else self._constant(scale)
        elif self.clip_grad_norm > 0:
            coef = ((raw + 1e-6 * scale).reciprocal_() * self.clip_grad_norm).clamp_(max=1 / scale)
        elif torch.is_tensor(scale) or scale != 1:
            coef = 1 / scale
        applied: bool | StepApplied = True
        if found_inf is not None:
            if self.skips_on_device:
                self.optimizer.found_inf = found_inf if found_inf.dtype == torch.float32 else found_inf.float()
                applied = StepApplied(found_inf)
            elif _read_flag(found_inf):
                self.scaler.update(overflow=True)
                self._skipped += 1
                return False
            else:
                found_inf = None
        if grad_scale is not None:  # the fused kernels read float32 scalars
            self.optimizer.grad_scale = grad_scale if grad_scale.dtype == torch.float32 else grad_scale.float()
        try:
            for chunk in self._plan().chunks:
                self._step_chunk(chunk, coef)
        finally:
            for key in ("grad_scale", "found_inf"):
                self.optimizer.__dict__.pop(key, None)
        self.scaler.update(overflow=found_inf if found_inf is not None else False)
        if found_inf is not None:
            self._skipped = self._skipped + found_inf
        return applied

    def _constant(self, value: float) -> torch.Tensor:
        """A device scalar of `value`, made once (a fixed divisor as a tensor for grad_scale)."""
        if self._divisor is None or self._divisor[0] != value:
            self._divisor = (value, torch.tensor(value, dtype=torch.float32, device=self._device()))
        return self._divisor[1]

    def _step_chunk(self, chunk: "_Chunk", coef: torch.Tensor | float | None) -> None:
        """Update `chunk`'s masters (the torch optimizer skips parameters without a gradient):
        gradients cast to the masters' dtype into one buffer and, unless the optimizer divides
        them itself (grad_scale), multiplied by `coef`, in one foreach each."""
        grads = chunk.grads
        if chunk.cast:
            grads = torch.empty(chunk.numel, dtype=self.master_dtype, device=self._device()).split(chunk.sizes)
            torch._foreach_copy_(grads, chunk.grads)
        if coef is not None:
            torch._foreach_mul_(grads, coef)
        for master, g in zip(chunk.masters, grads):
            master.grad = g
        self.optimizer.step()
        for master in chunk.masters:
            master.grad = None
        if chunk.params:
            torch._foreach_copy_(chunk.params, chunk.masters)

    def _plan(self) -> "_Plan":
        """The tensors the step works on, as lists cut once (a view is an op too: cut per step,
        they would make its launches grow with the bucket count). Built at the first step, after
        the engine has bound every shard to its final storage."""
        if self._step_plan is None:
            self._step_plan = _Plan(
                grads=[s.grad for s in self.shards if s.grad is not None and s.grad.numel()],
                excluded=[shard.grad[piece.start - shard.lo:piece.end - shard.lo]
                          for shard, piece in self.excluded_from_norm],
                chunks=[_Chunk(masters=[m.tensor for m in chunk], grads=[m.local(m.shard.grad) for m in chunk],
                               params=[] if self.share_master else [m.local(m.shard.param) for m in chunk],
                               cast=any(m.shard.grad.dtype != self.master_dtype for m in chunk))
                        for chunk in self.chunks])
        return self._step_plan

    def implementation(self) -> dict:
        """The torch optimizer's class and implementation (fused / foreach / for-loop), as records keep it."""
        defaults = self.optimizer.defaults
        kind = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "default"
        return {"class": type(self.optimizer).__name__, "implementation": kind,
                "skips_on_device": self.skips_on_device}

    @property
    def grad_norm(self) -> float:
        """The last step's global gradient norm (inf or nan when it was skipped; nan before the
        first step and in a simulation): read from the device now."""
        if self._grad_norm is None:
            return float("nan")
        return _read_value(self._grad_norm, float("nan")) / self._norm_scale

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far (fp16 overflow): read from the device now."""
        return int(_read_value(self._skipped, 0)) if torch.is_tensor(self._skipped) else self._skipped

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped = value

    @torch.no_grad()
    def init_states(self) -> None:
        """Give the torch optimizer states to load a checkpoint into if it has none (torch creates
        them at the first step), as torch's get_state_dict does (torch/distributed/checkpoint/
        state_dict.py, _init_optim_state): a step over zero gradients at learning rate 0, which
        leaves every master as it is, then every state tensor zeroed. The step runs over the same
        chunks as step()'s updates, each chunk's zero gradients freed after it, so its temporaries
        are one chunk's, not the shard's (at once, a foreach Adam's cost 8 bytes per owned element).
        They are placeholders: the first step() drops them unless a checkpoint was loaded into them
        (checkpoint/state_dict.py) or torch's optimizer.load_state_dict put other states in."""
        if self.optimizer.state or not self.masters:
            return
        groups = self.optimizer.param_groups
        lrs = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = torch.zeros_like(group["lr"]) if torch.is_tensor(group["lr"]) else 0.0
        for chunk in self.chunks:
            for m in chunk:
                m.tensor.grad = torch.zeros_like(m.tensor)
            self.optimizer.step()
            for m in chunk:
                m.tensor.grad = None
        for group, lr in zip(groups, lrs):
            group["lr"] = lr
        states = [v for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        for value in states:
            value.zero_()
        self._placeholders = [weakref.ref(v) for v in states]
        self.placeholder_states = True

    def _settle_placeholders(self) -> None:
        """At the first step: unless a checkpoint was loaded into them, each master's states that
        are all still init_states' tensors (by identity: a state put in their stead is kept) go, so
        the step starts from none, as a fresh optimizer's. Then the storage of every placeholder
        that no state (nor master) uses is released in place: a state dict taken before the first
        step is a view of them, and one the caller still holds must not keep them for the run (its
        tensors then have empty storage: it is invalidated by the first step)."""
        placeholders = {id(t): t for ref in self._placeholders if (t := ref()) is not None}
        self._placeholders = []
        state = self.optimizer.state
        if self.placeholder_states:
            for p in [p for p, s in state.items()
                      if all(placeholders.get(id(v)) is v for v in s.values() if torch.is_tensor(v))]:
                del state[p]
        self.placeholder_states = False
        used = {v.untyped_storage().data_ptr() for s in state.values() for v in s.values() if torch.is_tensor(v)}
        used.update(m.tensor.untyped_storage().data_ptr() for m in self.masters)  # a state may alias its master
        for t in placeholders.values():
            if t.untyped_storage().data_ptr() not in used:
                t.untyped_storage().resize_(0)

    def chunk_bytes(self) -> int:
        """Bytes of the masters the largest update covers (CB): its temporaries scale with them."""
        return max([sum(m.tensor.numel() for m in c) for c in self.chunks], default=0) * self.master_dtype.itemsize

    def chunk_limit_bytes(self) -> int:
        """What the config holds chunk_bytes() to: bucket_size elements or one larger master
        (masters are never split); the whole shard without bucket_size or a CHUNKABLE optimizer."""
        sizes = [m.tensor.numel() for m in self.masters]
        limit = sum(sizes) if self.chunk_elements is None else max([self.chunk_elements, *sizes])
        return limit * self.master_dtype.itemsize

    def full_master(self, total: int, buckets: list[Bucket], comm: Communicator | None) -> torch.Tensor:
        """The whole flat buffer in the masters' dtype: the masters where they exist, the
        model-precision shard elsewhere (frozen parameters), all-gathered when sharded."""
        flat = torch.zeros(total, dtype=self.master_dtype, device=self.shards[0].param.device if self.shards else None)
        for shard in self.shards:
            flat[shard.lo:shard.hi] = shard.param
        for m in self.masters:
            flat[m.piece.start:m.piece.end] = m.tensor.detach()
        if comm is not None:
            for b in buckets:
                lo, hi = b.shard_range(comm.rank)
                comm.all_gather(flat[b.start:b.end], flat[lo:hi], purpose="export")
        return flat

    def norm_bytes(self) -> int:
        """The norm's sums (global_grad_sums): one, two under tensor parallelism."""
        return (2 if self.mp.size > 1 else 1) * self._norm_dtype().itemsize

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The fp32 masters (unless they are the model's own shard) and every optimizer state
        tensor; among the buffers, the step's device scalars: the last norm, the skipped-step
        count, the dynamic loss scale (ZeroEngine.state_tensors)."""
        masters = [] if self.share_master else [m.tensor for m in self.masters]
        states = [v for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        scalars = [t for t in (self._grad_norm, self._skipped, self._divisor and self._divisor[1]) if torch.is_tensor(t)]
        scalars += self.scaler.state_tensors()
        return {"optimizer_states": masters + states, "buffers": scalars}

    def state_elements_per_param(self) -> int:
        """Optimizer state tensors per parameter element (2 for Adam), once states exist."""
        numel = sum(m.tensor.numel() for m in self.masters)
        states = sum(v.numel() for state in self.optimizer.state.values() for v in state.values()
                     if torch.is_tensor(v) and v.dim() > 0)
        return round(states / numel) if numel else 0


class StepApplied:
    """step()'s answer when the device made the decision: true unless the step was skipped.
    Reading it (bool(), ==, printing, pickling) is a host sync that waits for the whole step on
    the device: `if engine.step():` in a training loop stalls the GPU queue every step, so read
    it only when needed (stats() reads the same flag later)."""

    __slots__ = ("_found_inf",)

    def __init__(self, found_inf: torch.Tensor) -> None:
        self._found_inf = found_inf

    def __bool__(self) -> bool:
        return not _read_flag(self._found_inf)

    def __eq__(self, other: object) -> bool:
        return bool(self) == other if isinstance(other, (bool, StepApplied)) else NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return repr(bool(self))

    def __reduce__(self):
        return bool, (bool(self),)


@dataclass
class _Chunk:
    """One update's tensors: masters, their gradients (reduce dtype) and model-precision params."""

    masters: list[torch.Tensor]
    grads: list[torch.Tensor]
    params: list[torch.Tensor]  # empty when the masters are the model's shard
    cast: bool                  # gradients in another dtype than the masters: copied to a buffer

    @property
    def sizes(self) -> list[int]:
        return [m.numel() for m in self.masters]

    @property
    def numel(self) -> int:
        return sum(self.sizes)


@dataclass
class _Plan:
    grads: list[torch.Tensor]     # every shard's gradient, for the norm
    excluded: list[torch.Tensor]  # the TP duplicates' pieces
    chunks: list[_Chunk]


def _read_flag(t: torch.Tensor) -> bool:
    """A device flag on the host (a sync); a simulation's fake tensor: False."""
    return False if is_fake(t) else bool(t.item())


def _read_value(t: torch.Tensor, default: float) -> float:
    return default if is_fake(t) else t.item()


def _states_loaded(ref: weakref.ref, optimizer: torch.optim.Optimizer) -> None:
    """optimizer.load_state_dict's post hook: the states are now the loaded ones, keep them."""
    so = ref()
    if so is not None:
        so.placeholder_states = False


def _chunks(masters: list[Master], bucket_size: int | None) -> list[list[Master]]:
    """Consecutive masters in groups of at most `bucket_size` elements (a larger master alone);
    None: all in one."""
    if bucket_size is None:
        return [masters] if masters else []
    chunks: list[list[Master]] = []
    size = 0
    for m in masters:
        if not chunks or size + m.tensor.numel() > bucket_size:
            chunks.append([])
            size = 0
        chunks[-1].append(m)
        size += m.tensor.numel()
    return chunks
