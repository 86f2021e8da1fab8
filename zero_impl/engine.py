"""ZeroEngine: the training-loop API (forward, backward, step) over the stage-specific parts.

    engine = zero_impl.initialize(model, ZeroConfig(stage=2, precision="bf16"),
                                  optimizer=lambda groups: torch.optim.AdamW(groups, lr=3e-4))
    loss = loss_fn(engine(inputs), targets)
    engine.backward(loss)   # divides by grad_accum_steps itself, like DeepSpeed
    engine.step()           # call after every micro-batch; True when an update was applied
    engine.close()          # or `with zero_impl.initialize(...) as engine:`; see close()

Stages 0-2 keep full parameters in a flat buffer (flat_params.py) and differ only in what the
gradient reducer (grad_reducer.py) keeps and sends; the partitioned optimizer (optimizer.py)
is common to all stages.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch
from torch import nn

from . import agreement
from .activations import ActivationCheckpoints
from .checkpoint import state_dict as engine_state
from .comm import CommLedger, Communicator
from .config import ZeroConfig
from .flat_params import FlatParamBuffer
from .grad_reducer import BucketedGradReducer
from .layout import Slot
from .loss_scaler import LossScaler
from .memory import storage_bytes
from .optimizer import OptimizerFactory, OwnedShard, ShardedOptimizer, StepApplied
from .stage3 import Stage3Params
from .stage3_units import find_unit_modules

# The kinds of ZeroEngine.state_tensors(): every tensor the engine holds is one of them.
STATE_KINDS = ("params", "gathered_params", "grads", "optimizer_states", "buffers", "checkpoints", "host_checkpoints")


class ZeroEngine(nn.Module):
    """A module wrapped for ZeRO data parallelism (optionally inside a tensor-parallel group)."""

    def __init__(self, module: nn.Module, config: ZeroConfig, optimizer: OptimizerFactory,
                 param_groups: Iterable[dict] | None = None, dp_group=None, mp_group=None,
                 param_init_fn: Callable[[nn.Module], None] | None = None) -> None:
        super().__init__()
        self.module, self.config = module, config
        self.ledger = CommLedger()
        self.dp = Communicator(dp_group, self.ledger, "dp", check_order=config.check_collective_order,
                               force=config.force_collectives, point_to_point=config.gloo_point_to_point)
        self.mp = Communicator(mp_group, self.ledger, "mp", solo=mp_group is None,
                               check_order=config.check_collective_order, force=config.force_collectives,
                               point_to_point=config.gloo_point_to_point)
        if config.partition_activations and mp_group is None:
            raise ValueError("ZeroConfig.partition_activations (Pa) partitions each activation checkpoint over the "
                             "model-parallel group: pass mp_group (the tensor-parallel group)")
        slots, group_options = _collect_slots(module, param_groups, self.mp, with_frozen=config.stage == 3)
        dtype = config.param_dtype
        device = _device_of(slots)
        agreement.check(config, module, self.dp, device)  # one config, one model shape, or one line why not
        agreement.broadcast_states(module, self.dp)       # one starting model: the DP group's first rank's
        if config.stage == 3:
            self.params = Stage3Params(module, slots, config, self.dp, device, param_init_fn)
        else:
            if any(s.param.is_meta for s in slots):
                raise ValueError("a model on the meta device needs stage 3, which builds it unit by unit")
            self.params = FlatParamBuffer(slots, bucket_size=config.reduce_bucket_size,
                                          allgather_bucket_size=config.allgather_bucket_size,
                                          sharded=config.stage > 0, comm=self.dp, overlap=config.overlap_comm,
                                          dtype=dtype, master_dtype=config.master_dtype,
                                          overlap_param_gather=config.overlap_param_gather)
            self.params.register_hooks(module)
        self.slots = slots  # stage 3 may have swapped meta parameters for real ones: read them now
        trainable = [s for s in slots if s.param.requires_grad]
        self.psi = sum(s.numel for s in trainable)
        self.grads = BucketedGradReducer(
            self.params.buckets, trainable, config.stage, self.dp, config.grad_reduce_dtype,
            config.overlap_comm, device,
            on_bucket_complete=self.params.on_gradients_complete if config.stage == 3 else None)
        if config.stage == 3:
            self.params.report_unused = weakref.WeakMethod(self.grads.report_unused)
        shards = [OwnedShard(b, *self.params.owned_range(b), param=self.params.shard_view(b),
                             grad=self.grads.shard_grads[b.index], initial=self.params.initial_masters(b))
                  for b in self.params.buckets]
        self.scaler = LossScaler(enabled=config.precision == "fp16", static_scale=config.loss_scale,
                                 initial_scale_power=config.initial_scale_power,
                                 window=config.loss_scale_window, min_scale=config.min_loss_scale,
                                 hysteresis=config.hysteresis, consecutive_hysteresis=config.consecutive_hysteresis,
                                 device=device)
        self.sharded_optimizer = ShardedOptimizer(
            shards, group_options, optimizer,
            clip_grad_norm=config.clip_grad_norm, scaler=self.scaler, dp=self.dp, mp=self.mp,
            grads_replicated=config.stage == 0, share_master=not config.mixed_precision,
            master_dtype=config.master_dtype, bucket_size=config.optimizer_bucket_size,
            grad_divisor=self.grads.step_divisor)
        self.params.bind(dtype)
        for shard in shards:
            shard.param = self.params.shard_view(shard.bucket)
        _cast_rest(module, dtype, {id(s.param) for s in slots})

        self.activations = None  # ZeRO-R: Pa, Pa+cpu, MD on the activation checkpoints (activations.py)
        if config.activation_checkpoints:
            self.activations = ActivationCheckpoints(
                module, [m for _, m in find_unit_modules(module, config.stage3_unit_classes)], self.mp,
                partition=config.partition_activations, cpu=config.cpu_checkpointing,
                contiguous=config.contiguous_memory_optimization, number_checkpoints=config.number_checkpoints)

        self.micro_steps = 0
        self.steps = 0
        self.closed = False
        self._boundary_traffic = [self.ledger.snapshot(), self.ledger.snapshot()]
        self._checkpoint_hooks = engine_state.guard(self)  # the model's own state_dict() must not mislead

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer over this rank's fp32 masters (for LR schedulers)."""
        return self.sharded_optimizer.optimizer

    # -- training loop ----------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_open()
        if self.config.mixed_precision:
            args, kwargs = _cast_floats((args, kwargs), self.config.param_dtype)
        if self.activations is None:
            out = self.module(*args, **kwargs)
        else:  # ZeRO-R on the activation checkpoints the layers save (activations.py)
            before = self.activations.counts["checkpoints"]
            with self.activations.forward_context():
                out = self.module(*args, **kwargs)
            if torch.is_grad_enabled() and self.module.training and self.activations.counts["checkpoints"] == before:
                key = next(k for k in ("partition_activations", "contiguous_memory_optimization")
                           if getattr(self.config, k))
                raise ValueError(f"ZeroConfig.{key} acts on activation checkpoints, and this training forward "
                                 "saved none: turn on activation recomputation (a reentrant checkpoint per layer, "
                                 "e.g. megatron's recompute_granularity='full'), or turn the key off")
        return _cast_floats(out, torch.float32) if self.config.mixed_precision else out

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss` * fp16 loss scale / grad_accum_steps and reduce the gradients;
        their average over data-parallel ranks is taken around the sum (fp16: divide_factors)
        or by the optimizer's unscale (grad_reducer.step_divisor)."""
        self._check_open()
        accum = self.config.grad_accum_steps
        boundary = (self.micro_steps + 1) % accum == 0
        self.grads.begin_backward(reduce=boundary or self.config.stage >= 2,
                                  first_micro_step=self.micro_steps % accum == 0)
        self.params.begin_backward()
        if self.activations is not None:
            self.activations.begin_backward()
        try:
            # The whole loss scale in backward: dividing by the DP size here would run backward at
            # scale / DP (512 at DP 128) and push small fp16 activation gradients into subnormals.
            # The DP average is taken after (the reducer, the optimizer's unscale). The scale is a
            # device tensor when dynamic: multiplying by it reads nothing on the host. The
            # accumulation divide stays here (as DeepSpeed's and Megatron's): the micro-steps'
            # gradients are summed in the reduce dtype, which must not grow with grad_accum_steps.
            (loss * (self.scaler.factor() / accum)).backward()
            self.grads.end_backward()
        except BaseException:
            self.grads.abandon_backward()
            raise
        finally:
            self.params.end_backward()

    @torch.no_grad()
    def step(self) -> bool | StepApplied:
        """Call after every micro-batch; on the last one of an accumulation, update the parameters.

        Returns True when an update was applied, False on accumulation micro-steps and on
        fp16 overflow (the step is then skipped on every rank and the loss scale lowered). With
        an optimizer that skips on the device (torch's fused AdamW) the step never waits on the
        host, and the answer is a StepApplied: truthy as the bool, read from the device only
        when looked at.
        """
        self._check_open()
        self.micro_steps += 1
        if self.micro_steps % self.config.grad_accum_steps:
            return False
        self.params.before_step()  # nothing may read the shards this step writes, nor keep their old values
        applied = self.sharded_optimizer.step()
        # A skip decided on the device is not known here: gather anyway (the unchanged shards),
        # so that every rank issues the same collectives without reading the decision.
        self.params.after_step(applied is not False)
        self.grads.zero_grads()
        self.steps += 1
        self._boundary_traffic = [self._boundary_traffic[1], self.ledger.snapshot()]
        return applied

    def finish_param_gathers(self) -> None:
        """Stages 1-2: complete the last step's parameter all-gathers now (collectives: call on
        every rank). The next forward waits on them bucket by bucket as its modules run; call
        this first when a forward is run by some ranks only (sampling on rank 0)."""
        self._check_open()
        self.params.finish_gathers()

    # -- lifetime ---------------------------------------------------------------------------
    def close(self, gather: bool = True) -> None:
        """Give back everything the engine holds; afterwards forward, backward and step raise.

        Removes every hook the engine put on the model and drops its buffers, shards, masters
        and optimizer states (an LR scheduler over `engine.optimizer` keeps that optimizer's
        states until it goes too). The model is left usable on its own, in model precision:
        each parameter gets its own storage holding its current value. Stages 0-2 copy it out
        of the flat buffer; stage 3 all-gathers each unit once, so close() must then be called
        on every rank (gather=False skips the collectives and leaves stage 3's parameters empty).
        Deleting an engine without close() frees the same memory (its hooks hold it only
        weakly and then do nothing), but stage 3's parameters are then left empty, and on gloo
        the buffers of exchanges still in flight are kept for the life of the process (comm.py).
        """
        if self.closed:
            return
        for handle in self._checkpoint_hooks:
            handle.remove()
        self.grads.close()
        if self.activations is not None:
            self.activations.close()
        self.params.close(gather)
        self.params = self.grads = self.sharded_optimizer = None
        self.slots, self.closed = [], True

    def __enter__(self) -> ZeroEngine:
        return self

    def __exit__(self, exc_type, *_: Any) -> None:
        # After an error, this rank may be alone in getting here: stage 3 must not gather.
        self.close(gather=exc_type is None)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this ZeroEngine is closed; build a new one with zero_impl.initialize()")

    # -- checkpoints (checkpoint/state_dict.py) ---------------------------------------------
    def state_dict(self, *, destination: dict | None = None, prefix: str = "", keep_vars: bool = False) -> dict:
        """Everything needed to resume, keyed for torch.distributed.checkpoint (DCP): the fp32
        masters as `model.<name>`, the optimizer states, steps, loss scaler and RNG states; each
        value is this rank's pieces of a full tensor (checkpoint/state_dict.py). Before the first
        step it creates the optimizer states, placeholders for dcp.load to fill (a view of them that
        the first step invalidates: checkpoint/state_dict.py). Replaces
        nn.Module's, which would list the engine's model-precision views (and, at stage 3, empty
        shards).

            dcp.save(engine.state_dict(), checkpoint_id=path)   # or zero_impl.checkpoint.save(engine, path)
        """
        self._check_open()
        sd = engine_state.state_dict(self)
        if destination is None and not prefix:
            return sd
        destination = {} if destination is None else destination
        destination.update({prefix + k: v for k, v in sd.items()})
        return destination

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False) -> None:
        """Resume from `state_dict`: engine.state_dict() filled by dcp.load, e.g.
        `sd = engine.state_dict(); dcp.load(sd, checkpoint_id=path); engine.load_state_dict(sd)`.
        zero_impl.checkpoint.load(engine, path) does this at another world size too. Call on
        every rank (stages 1-3 all-gather the loaded shards)."""
        self._check_open()
        engine_state.load_state_dict(self, state_dict)

    # -- inspection -------------------------------------------------------------------------
    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """{name: full tensor in the masters' dtype (fp32; fp64 with precision "fp64")} keyed like
        module.named_parameters(), identical on every rank.

        Trainable parameters come from the masters; the all-gather this needs is counted
        under the purpose "export", outside the per-step figures. For tests and small models:
        it materializes the whole model in fp32 on this device, twice (13B: about 104 GB), so at
        the paper's sizes export through zero_impl.checkpoint instead (sharded, to disk).
        """
        self._check_open()
        self.params.finish_gathers()  # the export's gathers after the step's, on every rank
        flat = self.sharded_optimizer.full_master(self.params.numel, self.params.buckets,
                                                self.dp if self.params.sharded else None)
        slot_of = {id(s.param): s for s in self.slots}
        out = {}
        for name, p in self.module.named_parameters():
            s = slot_of.get(id(p))
            out[name] = flat[s.start:s.end].view(p.shape).clone() if s else p.detach().to(flat.dtype, copy=True)
        return out

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor this rank's engine holds, by kind (STATE_KINDS), each storage under one:

            params            model-precision parameters: the stage 0-2 flat buffer, stage 3's
                              shards and persistent unit, the model's parameters outside them
                              (frozen ones at stages 0-2) and its buffers
            gathered_params   stage 3: each unit's full buffer, whose storage has bytes only while
                              the unit is gathered
            grads             the gradient buffer (stages 0-1) or this rank's shards (stages 2-3)
            optimizer_states  the fp32 masters (unless they are the model's shard) and the
                              optimizer's states (Adam's moments and step counts)
            buffers           working buffers alive now: gradient staging and reduce-scatter
                              outputs, ZeRO-R's gather and prefetch pools; the step's device
                              scalars (norm, skipped steps, loss scale)
            checkpoints       ZeRO-R: the kept part of each live activation checkpoint (and MD's
                              arena) on the device; host_checkpoints: in host memory (Pa+cpu)

        Each part says what it holds (FlatParamBuffer / Stage3Params, BucketedGradReducer,
        ShardedOptimizer, ActivationCheckpoints .state_tensors()); memory() measures them.
        """
        self._check_open()
        out: dict[str, list[torch.Tensor]] = {kind: [] for kind in STATE_KINDS}
        parts = [self.params, self.grads, self.sharded_optimizer, *([self.activations] if self.activations else [])]
        for part in parts:
            for kind, tensors in part.state_tensors().items():
                out[kind] += tensors
        held = {t.untyped_storage()._cdata for tensors in out.values() for t in tensors}
        out["params"] += [t for t in (*self.module.parameters(), *self.module.buffers())
                          if t.untyped_storage()._cdata not in held]
        return out

    def memory(self) -> dict[str, int]:
        """Model-state bytes on this rank, measured from the live storages of state_tensors(), by
        kind; "buffers": the gradient staging alive now, "peak_buffers" at its largest."""
        state = self.state_tensors()
        measured = {"params": storage_bytes(state["params"] + state["gathered_params"]),
                    "grads": storage_bytes(state["grads"]),
                    "optimizer_states": storage_bytes(state["optimizer_states"])}
        measured["total"] = sum(measured.values())
        measured["buffers"] = storage_bytes(self.grads.state_tensors()["buffers"])
        measured["peak_buffers"] = self.grads.peak_buffer_bytes
        if self.config.stage == 3:
            measured["peak_gathered_params"] = self.params.peak_gathered_bytes
        return measured

    def bytes_per_param(self) -> dict[str, int]:
        """Bytes per parameter element of each model-state kind before partitioning (Table 1's
        P, G and K for this configuration; K counts the fp32 master only in mixed precision)."""
        master = 4 if self.config.mixed_precision else 0
        return {"params": self.config.param_dtype.itemsize, "grads": self.config.grad_reduce_dtype.itemsize,
                "optimizer_states": master + 4 * self.sharded_optimizer.state_elements_per_param()}

    def stats(self) -> dict[str, Any]:
        """Communication by collective, model-state memory by kind, loss scale, norm, skipped steps;
        stage 3: "stage3", its gathers prefetched versus on demand (Stage3Params.schedule_stats)."""
        self._check_open()
        previous, last = self._boundary_traffic
        stage3 = {"stage3": self.params.schedule_stats()} if self.config.stage == 3 else {}
        activations = {"activations": self.activations.stats()} if self.activations is not None else {}
        return {
            "stage": self.config.stage,
            "dp_size": self.dp.size,
            "mp_size": self.mp.size,
            "psi": self.psi,
            "padded_psi": self.params.numel,
            "steps": self.steps,
            "micro_steps": self.micro_steps,
            "skipped_steps": self.sharded_optimizer.skipped_steps,
            "loss_scale": self.scaler.scale,
            "grad_norm": self.sharded_optimizer.grad_norm,
            "optimizer": self.sharded_optimizer.implementation(),
            "comm": {"last_step": CommLedger.summarize(last, since=previous, exclude=("export", "init")),
                     "total": CommLedger.summarize(self.ledger.snapshot())},
            "memory": self.memory(),
            "bytes_per_param": self.bytes_per_param(),
            "zero_r_config": self.config.zero_r_config,
            "buffers": self.buffer_bytes(),
            "buffer_limits": self.buffer_limits(),
            **stage3,
            **activations,
        }

    def buffer_bytes(self) -> dict[str, int]:
        """CB (paper Section 6.2): bytes of each fused buffer the engine uses beyond the model
        states, at its largest so far: stage 2-3 gradient staging (live staging buckets and
        reduce-scatter outputs), the post-step parameter all-gathers in flight at once (stages
        1-2, in place in the parameter buffer), the norm's sums, the masters one optimizer
        update covers (its temporaries scale with them), and ZeRO-R's (activations.py)."""
        self._check_open()
        out = {"grad_staging": self.grads.peak_buffer_bytes, "norm": self.sharded_optimizer.norm_bytes(),
               "optimizer_step": self.sharded_optimizer.chunk_bytes()}
        if self.config.stage in (1, 2):
            out["allgather"] = self.params.allgather_bytes()
        if self.activations is not None:
            out.update(self.activations.buffer_bytes())
        return out

    def buffer_limits(self) -> dict[str, int]:
        """The size the config holds each of buffer_bytes() to, whatever the model's size, as each
        part computes it: the staging's MAX_INFLIGHT_STAGING + 1 buckets of at most
        reduce_bucket_size elements plus alignment, or one larger parameter, or at stage 3 a unit
        (BucketedGradReducer.staging_limit_bytes of the params' bucket_limit); the all-gathers in
        flight (FlatParamBuffer.allgather_limit_bytes); the norm's sums (1, 2 under TP); an update of
        optimizer_bucket_size elements (ShardedOptimizer.chunk_limit_bytes); ZeRO-R's, one
        checkpoint each (ActivationCheckpoints.buffer_limits)."""
        self._check_open()
        out = {"grad_staging": self.grads.staging_limit_bytes(self.params.bucket_limit()),
               "norm": self.sharded_optimizer.norm_bytes(), "optimizer_step": self.sharded_optimizer.chunk_limit_bytes()}
        if self.config.stage in (1, 2):
            out["allgather"] = self.params.allgather_limit_bytes()
        if self.activations is not None:
            out.update(self.activations.buffer_limits())
        return out


def initialize(model: nn.Module, config: ZeroConfig, optimizer: OptimizerFactory,
               param_groups: Iterable[dict] | None = None, dp_group=None, mp_group=None,
               param_init_fn: Callable[[nn.Module], None] | None = None) -> ZeroEngine:
    """Wrap `model` for ZeRO training; `optimizer` builds a torch optimizer from param groups.

    param_groups: torch-style groups over the model's parameters ({"params": [...], **options});
    None puts every trainable parameter in one group with the factory's defaults.
    dp_group / mp_group: the data-parallel group ZeRO shards over (None: the default group)
    and the tensor-parallel group whose duplicated parameters count once in the global norm.
    param_init_fn: stage 3 with a model built on the meta device (`with torch.device("meta")`):
    called on each module owning parameters of a unit, once that unit alone is materialized
    (default: the module's reset_parameters()), so the full model never exists on any rank.
    """
    return ZeroEngine(model, config, optimizer, param_groups, dp_group, mp_group, param_init_fn)


def _collect_slots(module: nn.Module, param_groups, mp: Communicator,
                   with_frozen: bool) -> tuple[list[Slot], list[dict]]:
    """Trainable (and, for stage 3, frozen) parameters in gradient-ready order (reverse
    registration), with their param group index (None for frozen ones)."""
    everything = list(module.named_parameters())
    named = [(n, p) for n, p in everything if p.requires_grad]
    # megatron's sequence parallelism leaves these gradients partial on each TP rank: they need an
    # all-reduce over the TP group that this engine does not issue (the TP ranks would drift apart)
    partial = [n for n, p in named if getattr(p, "sequence_parallel", False)]
    if partial and mp.size > 1:
        raise ValueError(f"sequence-parallel parameters are not supported (their gradients are partial on each "
                         f"TP rank): {partial[:3]}{' ...' if len(partial) > 3 else ''}; build the model with "
                         "sequence_parallel=False")
    if param_groups is None:
        group_of, options = {id(p): 0 for _, p in named}, [{}]
    else:
        group_of, options = {}, []
        for index, group in enumerate(param_groups):
            if not isinstance(group, dict) or "params" not in group:
                raise ValueError(f"param_groups[{index}] must be a dict with a 'params' list (torch style), "
                                 f"got {type(group).__name__}")
            group = dict(group)
            params = group.pop("params")
            for p in [params] if torch.is_tensor(params) else list(params):
                if id(p) in group_of:
                    raise ValueError(f"a parameter appears in param groups {group_of[id(p)]} and {index}")
                group_of[id(p)] = index
            options.append(group)
        known = {id(p) for _, p in module.named_parameters()}
        if set(group_of) - known:
            raise ValueError("param_groups name a parameter that is not in the model")
        missing = [n for n, p in named if id(p) not in group_of]
        if missing:
            raise ValueError(f"trainable parameters in no param group: {missing}")
    chosen = everything if with_frozen else named
    return [Slot(name=n, param=p, group=group_of[id(p)] if p.requires_grad else None,
                 counted_in_norm=mp.size == 1 or mp.rank == 0 or getattr(p, "tensor_model_parallel", False))
            for n, p in reversed(chosen)], options


def _device_of(slots: list[Slot]) -> torch.device:
    """The parameters' device; for a meta-device model, the current accelerator or the CPU."""
    if not slots or not slots[0].param.is_meta:
        return slots[0].param.device if slots else torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _cast_rest(module: nn.Module, dtype: torch.dtype, skip: set[int]) -> None:
    """Cast floating parameters not in `skip` (frozen ones) and floating buffers to `dtype`."""
    for p in module.parameters():
        if id(p) not in skip and p.is_floating_point():
            p.data = p.data.to(dtype)
    for m in module.modules():
        for key, buf in m._buffers.items():
            if buf is not None and buf.is_floating_point():
                m._buffers[key] = buf.to(dtype)


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """Cast floating-point tensors in a nest of tuples, lists and dicts."""
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj
