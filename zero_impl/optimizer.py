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
import math
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
                 bucket_size: int | None = None) -> None:
        self.shards = shards
        self.clip_grad_norm = clip_grad_norm
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
        self.grad_norm = float("nan")
        self.skipped_steps = 0
        self.placeholder_states = False  # init_states' states, until a checkpoint is loaded into them
        self._placeholders: list[weakref.ref] = []  # init_states' state tensors, until the first step
        # torch's own load (optimizer.load_state_dict, as DCP's set_optimizer_state_dict calls it)
        # puts a checkpoint's states in place of the placeholders: the first step keeps those.
        # A weak reference: the optimizer may outlive this object (an LR scheduler holds it).
        self.optimizer.register_load_state_dict_post_hook(functools.partial(_states_loaded, weakref.ref(self)))

    def global_grad_sumsq(self) -> tuple[float, bool]:
        """(sum of squares of the true, unscaled-by-clip gradient, any non-finite value anywhere),
        summed in fp32, or in the gradients' own dtype when that is wider (fp64)."""
        device = self.shards[0].grad.device if self.shards else torch.device("cpu")
        dtype = self._norm_dtype()
        counted = torch.zeros((), dtype=dtype, device=device)
        total = torch.zeros((), dtype=dtype, device=device)
        for shard in self.shards:
            sq = torch.linalg.vector_norm(shard.grad, dtype=dtype).square()
            counted += sq
            total += sq
        for shard, piece in self.excluded_from_norm:
            g = shard.grad[piece.start - shard.lo:piece.end - shard.lo]
            counted -= torch.linalg.vector_norm(g, dtype=dtype).square()
        sums = torch.stack([counted, total])
        if self.grads_replicated and self.dp.size > 1:
            sums /= self.dp.size  # every DP rank holds the same full gradient: count it once
        self.dp.all_reduce(sums, purpose="norm")
        self.mp.all_reduce(sums, purpose="norm")
        if is_fake(sums):  # a simulation (FakeTensorMode, experiments/run/fake.py): no values to read
            return float("nan"), False
        return float(sums[0]), not math.isfinite(float(sums[1]))

    def _norm_dtype(self) -> torch.dtype:
        return torch.promote_types(self.shards[0].grad.dtype, torch.float32) if self.shards else torch.float32

    def step(self) -> bool:
        """Apply one update from the reduced gradients; False (and nothing changed) on overflow."""
        if self._placeholders:
            self._settle_placeholders()
        sumsq, overflow = self.global_grad_sumsq()
        scale = self.scaler.scale
        if overflow:
            self.scaler.update(overflow=True)
            self.skipped_steps += 1
            self.grad_norm = float("inf")
            return False
        self.grad_norm = math.sqrt(max(sumsq, 0.0)) / scale
        coef = 1.0 / scale
        if self.clip_grad_norm > 0 and not math.isnan(sumsq):  # NaN: simulated, the step applies unclipped
            # Same formula as torch.nn.utils.clip_grad_norm_.
            coef *= min(1.0, self.clip_grad_norm / (self.grad_norm + 1e-6))
        for chunk in self.chunks:
            self._step_chunk(chunk, coef)
        self.scaler.update(overflow=False)
        return True

    def _step_chunk(self, chunk: list[Master], coef: float) -> None:
        """Update `chunk`'s masters: the torch optimizer skips parameters without a gradient."""
        for m in chunk:
            g = m.local(m.shard.grad)
            if g.dtype != m.tensor.dtype:
                g = g.to(m.tensor.dtype)
            if coef != 1.0:
                g.mul_(coef)
            m.tensor.grad = g
        self.optimizer.step()
        for m in chunk:
            m.tensor.grad = None
            if not self.share_master:
                m.local(m.shard.param).copy_(m.tensor)

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
        """The norm's all-reduce: two sums (global_grad_sumsq)."""
        return 2 * self._norm_dtype().itemsize

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The fp32 masters (unless they are the model's own shard) and every optimizer state
        tensor (ZeroEngine.state_tensors)."""
        masters = [] if self.share_master else [m.tensor for m in self.masters]
        states = [v for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        return {"optimizer_states": masters + states}

    def state_elements_per_param(self) -> int:
        """Optimizer state tensors per parameter element (2 for Adam), once states exist."""
        numel = sum(m.tensor.numel() for m in self.masters)
        states = sum(v.numel() for state in self.optimizer.state.values() for v in state.values()
                     if torch.is_tensor(v) and v.dim() > 0)
        return round(states / numel) if numel else 0


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
