"""The engine's state dict for torch.distributed.checkpoint (DCP): what each rank owns, keyed
in TP=1 coordinates, and back into a live engine (files.py puts it on disk).

engine.state_dict() holds, keyed for DCP (DCP writes each piece once, even when ranks share it):
  model.<name>          the fp32 master of each trainable parameter (the model-precision parameter
                        is its rounding); frozen parameters upcast; persistent buffers as they are
  optim.<key>.<name>    each element-wise optimizer state (Adam's exp_avg, exp_avg_sq)
  optim_group.<g>.<key> the per-group scalars (Adam's step); optim_groups: the groups' lr, betas...
  engine                steps, micro_steps, skipped steps, loss scaler, shapes, TP degree
  rng.<rank>            this rank's torch (CPU, CUDA) and Python RNG states
A parameter is stored as a 2-D tensor (A, C) in TP=1 coordinates: A is the product of the dims
before megatron's partition_dim, C the rest (A = 1 without TP). A rank's owned range of its
flattened local tensor is at most three boxes of it, which DCP reshards like any other shard.

An engine that has not stepped has no optimizer states yet (torch creates them at the first
step); its state dict carries placeholders of their shapes (ShardedOptimizer.init_states), so
`sd = engine.state_dict(); dcp.load(sd, checkpoint_id=path); engine.load_state_dict(sd)` loads
into them in place, as torch's own get_state_dict does for a fresh optimizer. Such a state dict is
a view of the placeholders and the first step invalidates it: it drops those nothing was loaded
into and releases the storage of every placeholder no longer a state, so a state dict still held
reads as empty there instead of keeping Adam's moments twice for the whole run (take a new one).
"""
from __future__ import annotations

import math
import pickle
import random
import weakref
from typing import Any

import torch
import torch.distributed as dist

FORMAT = 1


class Chunked(torch.Tensor):
    """A tensor of `size` of which this rank holds `chunks`, [(offsets, box)]. It implements DCP's
    _Checkpointable protocol (as DTensor does), so stock dcp.save / dcp.load accept it."""

    @staticmethod
    def __new__(cls, size, chunks, dtype, device):
        self = torch.Tensor._make_wrapper_subclass(cls, size, dtype=dtype, device=device)
        self.chunks = [(tuple(o), t) for o, t in chunks]
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"a zero_impl Chunked tensor only carries shards to DCP; it supports no {func}")

    def __repr__(self) -> str:
        return f"Chunked(size={tuple(self.shape)}, chunks={[(o, tuple(t.shape)) for o, t in self.chunks]})"

    def __reduce_ex__(self, protocol):  # torch.save(engine.state_dict()) keeps this rank's chunks
        return _rebuild, (tuple(self.shape), self.chunks, self.dtype, self.device)

    # DCP (imported late: every engine imports this module, and DCP takes a second to import)
    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(o)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(o), t.shape),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self.shape))
                for o, t in self.chunks]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(torch.Size(o), t.shape) for o, t in self.chunks]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        for o, t in self.chunks:
            if o == tuple(index.offset):
                return t
        raise ValueError(f"{index.fqn}: no local chunk at offsets {tuple(index.offset)}")


def _rebuild(size, chunks, dtype, device) -> Chunked:
    return Chunked(size, chunks, dtype, device)


# -- where this rank's pieces live ---------------------------------------------------------------
def _grid(shape: torch.Size, dim: int | None, tp: int, tp_rank: int) -> tuple[tuple[int, int], int, int]:
    """(global 2-D size, local columns, first column) of a parameter's (A, C) view."""
    if dim is None:
        return (1, math.prod(shape)), math.prod(shape), 0
    cols = math.prod(shape[dim:])
    return (math.prod(shape[:dim]), cols * tp), cols, tp_rank * cols


def _boxes(a: int, e: int, flat: torch.Tensor, cols: int, col0: int) -> list:
    """The elements [a, e) of a local tensor seen as rows of `cols` (`flat` holds exactly them),
    as (offsets, 2-D view) boxes of the global grid: a partial row, whole rows, a partial row."""
    out = []
    while a < e:
        r, c = divmod(a, cols)
        n = min(cols - c, e - a) if c or e - a < cols else (e - a) // cols * cols
        out.append(((r, col0 + c), flat[:n].view(-1, min(n, cols))))
        flat, a = flat[n:], a + n
    return out


def _tp_dim(p: torch.Tensor) -> int | None:
    """The dim megatron shards `p` along (None: replicated). Only contiguous slices are keyed
    right: a strided partition (partition_stride > 1, e.g. interleaved gated-MLP halves) is
    refused rather than stored in the wrong TP=1 coordinates."""
    if not getattr(p, "tensor_model_parallel", False):
        return None
    if getattr(p, "partition_stride", 1) != 1:
        raise ValueError(f"a tensor-parallel parameter with partition_stride {p.partition_stride} cannot be "
                         "checkpointed in TP=1 coordinates yet")
    return p.partition_dim


def _live(engine) -> tuple[dict, dict]:
    """({key: (2-D size, [(offsets, live view)])}, {optim_group key: live scalar state}) of
    everything this rank owns: masters, element-wise optimizer states, frozen parameters."""
    tp, tp_rank, state = engine.mp.size, engine.mp.rank, engine.optimizer.state
    masters: dict[int, list] = {}
    for m in engine.sharded_optimizer.masters:
        masters.setdefault(m.shard.bucket.index, []).append(m)
    ranges: dict[str, list] = {}  # name -> [(a, e) in the parameter, 1-D view of it, master, master's [a, e)]
    slotted = set()
    for b in engine.params.buckets:
        lo, hi = engine.params.owned_range(b)
        for s in b.slots:
            slotted.add(id(s.param))
            a, e = max(lo, s.start), min(hi, s.end)
            if a >= e:
                continue
            if s.group is None:  # frozen: its model-precision shard
                view, m, where = engine.params.shard_view(b)[a - lo:e - lo], None, None
            else:
                m = next(m for m in masters[b.index] if m.piece.start <= a and e <= m.piece.end)
                where = slice(a - m.piece.start, e - m.piece.start)
                view = m.tensor.detach()[where]
            ranges.setdefault(s.name, []).append((a - s.start, e - s.start, view, m, where))
    shapes = {}
    for name, p in engine.module.named_parameters():
        shapes[name] = (p.shape, _tp_dim(p))
        if id(p) not in slotted and p.numel():  # replicated (frozen, stages 0-2): every rank has it
            ranges[name] = [(0, p.numel(), p.data.view(-1), None, None)]
    live, scalars = {}, {}
    for name, pieces in ranges.items():
        size, cols, col0 = _grid(*shapes[name], tp, tp_rank)
        for a, e, view, m, where in pieces:
            live.setdefault(f"model.{name}", (size, []))[1].extend(_boxes(a, e, view, cols, col0))
            for k, v in (state.get(m.tensor, {}) if m is not None else {}).items():
                if torch.is_tensor(v) and v.dim() > 0 and v.shape == m.tensor.shape:
                    live.setdefault(f"optim.{k}.{name}", (size, []))[1].extend(_boxes(a, e, v[where], cols, col0))
                else:
                    scalars.setdefault(f"optim_group.{m.piece.key}.{k}", v if torch.is_tensor(v) else pack(v))
    return live, scalars


def _full_shapes(engine) -> dict[str, tuple[list[int], int | None]]:
    """{name: (TP=1 shape, TP partition dim or None)}, in the module's order."""
    out = {}
    for name, p in engine.module.named_parameters():
        shape, dim = list(p.shape), _tp_dim(p)
        if dim is not None:
            shape[dim] *= engine.mp.size
        out[name] = (shape, dim)
    return out


def _state_keys(module: torch.nn.Module) -> dict[str, str]:
    """The bare model's state_dict() keys -> the name holding the value (a tied weight's first name)."""
    first, keys = {}, {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        named = [*m._parameters.items(), *((n, b) for n, b in m._buffers.items() if n not in m._non_persistent_buffers_set)]
        for n, t in named:
            if t is not None:
                keys[dot + n] = first.setdefault(id(t), dot + n)
    return keys


def _buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    params = {n for n, _ in module.named_parameters()}
    tensors = {**dict(module.named_buffers()), **dict(module.named_parameters())}
    return {n: tensors[n] for n, first in _state_keys(module).items() if n == first and n not in params}


def _meta(engine) -> dict[str, Any]:
    so = engine.sharded_optimizer
    return {"format": FORMAT, "steps": engine.steps, "micro_steps": engine.micro_steps,
            "skipped_steps": so.skipped_steps, "loss_scale": engine.scaler.scale, "clean_steps": engine.scaler.clean_steps,
            "hysteresis_left": engine.scaler.hysteresis_left,
            "optimizer_state": engine.steps > so.skipped_steps,  # torch optimizers create states at their first step
            "stage": engine.config.stage, "precision": engine.config.precision, "dp": engine.dp.size,
            "tp": engine.mp.size, "params": _full_shapes(engine), "state_keys": _state_keys(engine.module)}


def check(engine, meta: Any) -> None:
    """Refuse a checkpoint of another model or TP degree, naming the first parameter that differs."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"not a zero_impl checkpoint (format {FORMAT})")
    mine, theirs = _full_shapes(engine), meta["params"]
    if meta["tp"] != engine.mp.size:
        split = next((n for n, (_, d) in mine.items() if d is not None), None)
        why = f": parameter {split!r} is split {meta['tp']} ways there, {engine.mp.size} here" if split else ""
        raise ValueError(f"checkpoint saved at TP {meta['tp']}, this engine runs TP {engine.mp.size}{why} "
                         "(checkpoints reshard across DP degrees, stages and buckets, not TP degrees)")
    for name, (shape, dim) in mine.items():
        if name not in theirs:
            raise ValueError(f"parameter {name!r} of shape {tuple(shape)} is not in the checkpoint")
        if list(theirs[name][0]) != shape or theirs[name][1] != dim:
            raise ValueError(f"parameter {name!r} has shape {tuple(theirs[name][0])} in the checkpoint, "
                             f"{tuple(shape)} here")
    extra = next((n for n in theirs if n not in mine), None)
    if extra:
        raise ValueError(f"the checkpoint has a parameter {extra!r} that this model lacks")


# -- the engine's state dict -----------------------------------------------------------------------
def state_dict(engine) -> dict[str, Any]:
    """What engine.state_dict() returns (module docstring): views of the live masters and
    optimizer states, no copy (frozen parameters are upcast copies). Collective-free."""
    if engine.micro_steps % engine.config.grad_accum_steps:
        raise RuntimeError("state_dict() inside a gradient accumulation: the partial gradients are not "
                           "saved; call it after the step() that applies an update")
    engine.sharded_optimizer.init_states()  # an unstepped engine's: placeholders for dcp.load to fill
    live, scalars = _live(engine)
    dtype, sd = engine.config.master_dtype, {}
    for key, (size, boxes) in live.items():
        chunks = [(o, t.to(dtype) if key.startswith("model.") else t) for o, t in boxes]
        sd[key] = Chunked(size, chunks, chunks[0][1].dtype, chunks[0][1].device)
    sd.update(scalars)
    sd["optim_groups"] = pack([{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups])
    sd.update({f"model.{n}": b for n, b in _buffers(engine.module).items()})
    sd["engine"] = pack(_meta(engine))
    sd[f"rng.{rank()}"] = pack(_rng_state())
    return sd


@torch.no_grad()
def load_state_dict(engine, sd: dict[str, Any]) -> None:
    """Make the engine what `sd` describes. `sd` has this engine's layout: its engine.state_dict()
    filled by dcp.load, or what files.load() builds. Collective (stages 1-3 all-gather parameters)."""
    meta = unpack(sd["engine"])
    check(engine, meta)
    so, opt, with_optim = engine.sharded_optimizer, engine.optimizer, meta["optimizer_state"]
    so.init_states()  # the states to load into, as state_dict() made them
    engine.params.before_step()  # the load writes the shards: nothing may read them, nor keep their old values
    live, _ = _live(engine)
    for key, (_, boxes) in live.items():
        if key.startswith("optim.") and not with_optim:
            continue
        theirs = dict(sd[key].chunks) if isinstance(sd.get(key), Chunked) else {}
        for o, dest in boxes:
            src = theirs.get(o)
            if src is None or src.shape != dest.shape:
                raise ValueError(f"{key}: this state dict's pieces do not match this engine's layout; build it "
                                 "with engine.state_dict() (or use zero_impl.checkpoint.load)")
            if src.data_ptr() != dest.data_ptr():
                dest.copy_(src)
    if not so.share_master:  # model-precision parameters are the masters' rounding
        for m in so.masters:
            m.local(m.shard.param).copy_(m.tensor)
    so.placeholder_states = False  # the checkpoint's now, or none (saved before the first step)
    for m in so.masters:
        if not with_optim:
            opt.state.pop(m.tensor, None)
        for key in (k for k in sd if k.startswith(f"optim_group.{m.piece.key}.") and with_optim):
            v = sd[key]
            opt.state[m.tensor][key.split(".", 2)[2]] = v.clone() if torch.is_tensor(v) else unpack(v)
    groups = unpack(sd["optim_groups"]) if "optim_groups" in sd else opt.param_groups
    if len(groups) != len(opt.param_groups):
        raise ValueError(f"the checkpoint has {len(groups)} param groups, this engine {len(opt.param_groups)}")
    for group, saved in zip(opt.param_groups, groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    for name, buf in _buffers(engine.module).items():
        src = sd.get(f"model.{name}")
        if torch.is_tensor(src) and src is not buf:
            buf.copy_(src)
    engine.params.after_step(True)  # every rank's loaded shard to every rank (stages 1-2)
    engine.params.finish_gathers()
    accum = engine.config.grad_accum_steps  # saved at a step boundary: keep it one under another accum
    engine.steps, so.skipped_steps = meta["steps"], meta["skipped_steps"]
    engine.micro_steps = meta["micro_steps"] if meta["micro_steps"] % accum == 0 else meta["steps"] * accum
    engine.scaler.scale, engine.scaler.clean_steps = meta["loss_scale"], meta["clean_steps"]
    # a checkpoint written before the scaler had a hysteresis counter: the counter full
    engine.scaler.hysteresis_left = meta.get("hysteresis_left", engine.scaler.hysteresis)
    engine._boundary_traffic = [engine.ledger.snapshot()] * 2  # the load's gathers are not a step's
    if f"rng.{rank()}" in sd:
        _set_rng(unpack(sd[f"rng.{rank()}"]))


# -- the wrapped module's own state_dict() ---------------------------------------------------------
def guard(engine) -> list:
    """Hooks on the wrapped model so its own state_dict()/load_state_dict() never silently give
    wrong answers: at stage 3 (each rank holds 1/N of every parameter) both raise; at stages 0-2
    load_state_dict(assign=True) raises (it would detach parameters from the flat buffer) and, in
    mixed precision, a load refreshes the fp32 masters from the loaded parameters."""
    module, ref = engine.module, weakref.ref(engine)
    if engine.config.stage == 3:
        return [h for m in module.modules() for h in (m.register_state_dict_pre_hook(_refuse_sharded),
                                                      m.register_load_state_dict_pre_hook(_refuse_sharded))]

    def refuse_assign(module, sd, prefix, local_metadata, *args):
        if local_metadata.get("assign_to_params_buffers"):
            raise RuntimeError("load_state_dict(assign=True) on a model wrapped by a ZeroEngine would detach its "
                               "parameters from the engine's flat buffer; load with assign=False")

    @torch.no_grad()
    def refresh_masters(module, incompatible_keys):
        e = ref()
        if e is not None and not e.closed:
            for m in e.sharded_optimizer.masters:
                m.tensor.copy_(m.local(m.shard.param))

    handles = [module.register_load_state_dict_pre_hook(refuse_assign)]
    if engine.config.mixed_precision:
        handles.append(module.register_load_state_dict_post_hook(refresh_masters))
    return handles


def _refuse_sharded(*args) -> None:
    raise RuntimeError("at ZeRO stage 3 each rank holds 1/N of every parameter, so the wrapped model's own "
                       "state_dict()/load_state_dict() would be wrong: use engine.state_dict() / "
                       "zero_impl.checkpoint.save and load (sharded) or engine.full_parameters() (gathered)")


# -- helpers -----------------------------------------------------------------------------------------
def rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def pack(obj: Any) -> bytes:
    """Objects go to DCP pickled: it would otherwise flatten dicts and lists into one item per leaf."""
    return pickle.dumps(obj)


def unpack(value: Any) -> Any:
    return pickle.loads(value) if isinstance(value, bytes) else value


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])

