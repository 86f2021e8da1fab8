"""Peak device memory of one rank, by phase and by kind, from every storage the rank allocates.

`StorageTracker` is a TorchDispatchMode, as torch's own `torch.distributed._tools.mem_tracker.
MemTracker`, and sees the same events: every op's output storages (a new storage is an
allocation), a storage's death (a weak reference's callback: a free), and
`UntypedStorage.resize_` (patched while the tracker is active, as MemTracker patches it), which
stage 3 uses to release and re-gather units (`unit.flat.untyped_storage().resize_(0)`). It works
on real tensors (a CPU run over gloo) and on fake ones (`FakeTensorMode`, experiments/run/fake.py)
alike, so a simulated rank and a real one are measured by the same code.

What it adds to MemTracker: the kinds are the engine's, not nn.Module's, and allocations made
while the model is built on the host are not device memory:

    params            model-precision parameters (the stage 0-2 flat buffer, stage-3 shards)
    gathered_params   stage 3: full units gathered for forward/backward (resized to 0 when released)
    grads             the gradient buffer (stages 0-1) or this rank's gradient shard (stages 2-3)
    optimizer_states  fp32 masters and the optimizer's moments
    activations       what forward (and recomputation in backward) allocates, the logits included,
                      and ZeRO-R's kept checkpoints (state_tensors' checkpoints)
    buffers           the engine's working buffers: gradient staging buckets, reduce-scatter
                      outputs, anything the engine allocates outside its persistent states
    temporaries       everything else: gradients of activations, the optimizer step's temporaries
    host              (not device memory) megatron's CPU initialization: the full fp32 TP=1 weight
                      drawn on the host before each rank keeps its slice; ZeRO-R's Pa+cpu
                      checkpoint slices (state_tensors' host_checkpoints)

A storage's kind comes from the engine's own account of what it holds, `ZeroEngine.state_tensors()`
(its kinds map to these by `ENGINE_KINDS`), by storage identity, never by file or variable
names: after initialize and after each step every storage the engine holds is relabelled
(`label_engine`), and each storage the engine's own code allocates later (the op's innermost
caller is in the zero_impl package) takes its kind from state_tensors() at the next event of
another storage, by which time the engine holds what it allocated (a staging bucket, a pool's
buffer, a kept checkpoint). Its bytes are counted then, before that event, so totals and peaks
fall where they did, and a Pa+cpu slice never counts as device memory. Storages the
engine does not hold, and those allocated before it exists, are classified by the phase the
runner is in (`tracker.phase`: build, initialize, forward, backward, step) and by the stack
(`_origin`): megatron's host initialization, torch's optimizers creating states, recomputation
in backward, and, while the engine is being built, the part building it (`_BUILDING`).

Sizes are rounded as the CUDA caching allocator rounds blocks: up to a multiple of 512 bytes
(`CUDA_BLOCK`), per storage. Totals exclude `host`.

The event log (`events`): what the step asks of the CUDA caching allocator, in order, for the
replay in experiments/allocator: each device storage's allocation (its raw requested bytes),
its free, and a resize as the CUDA backend runs one (resize_bytes_cuda: a new block allocated,
the old copied and freed), each on the stream it is allocated on (`stream`: 0, the compute
stream, unless a caller sets another); and what a GPU allocates that no fake kernel does:
cuBLAS's workspace, one per stream on its first GEMM (CublasHandlePool.cpp
getCurrentCUDABlasHandle -> getCUDABlasWorkspace: `cublas_workspace_bytes`, allocated through
the caching allocator, never freed; cuBLASLt reuses it, TORCH_CUBLASLT_UNIFIED_WORKSPACE being
on by default in torch 2.13's CUDA builds: torch/backends/cuda/__init__.py). zero_impl allocates every device buffer on the compute
stream: its side stream (ZeRO-R Pa+cpu's copies) and NCCL's streams only use blocks allocated
there. What the log cannot see: when another stream's use of a block ends (record_stream: the
block returns to the pool after that stream's work, later than the free logged here),
allocations outside the caching allocator (NCCL's communicator buffers, the CUDA context), and
kernels' internal workspaces not taken through it (cuDNN's, flash attention's, NCCL's).
"""
from __future__ import annotations

import inspect
import sys
import weakref
from dataclasses import dataclass, field
from functools import wraps
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

import zero_impl
from experiments.allocator import Event
from zero_impl.flat_params import FlatParamBuffer
from zero_impl.grad_reducer import BucketedGradReducer
from zero_impl.optimizer import ShardedOptimizer
from zero_impl.stage3 import Stage3Params

CUDA_BLOCK = 512  # c10/cuda/CUDACachingAllocator.cpp kMinBlockSize: every block is a multiple of it
KINDS = ("params", "gathered_params", "grads", "optimizer_states", "activations", "buffers", "temporaries")
PHASES = ("build", "initialize", "forward", "backward", "step")
# ZeroEngine.state_tensors' kinds (zero_impl.STATE_KINDS) as these: ZeRO-R's kept checkpoints
# are activations, or host memory with Pa+cpu
ENGINE_KINDS = {"params": "params", "gathered_params": "gathered_params", "grads": "grads",
               "optimizer_states": "optimizer_states", "buffers": "buffers", "checkpoints": "activations",
               "host_checkpoints": "host"}

# While the engine is being built it cannot be asked for its state: what a part allocates while
# it builds is that part's kind (the flat buffer also cuts the fp32 masters, stage 3 its fp32
# shards) until label_engine relabels from state_tensors(), right after initialize.
_BUILDING = {FlatParamBuffer: "params", Stage3Params: "params", BucketedGradReducer: "grads",
             ShardedOptimizer: "optimizer_states"}
_BUILDER_CODE = {inspect.unwrap(f).__code__: kind for cls, kind in _BUILDING.items()
                 for f in vars(cls).values() if inspect.isfunction(f)}
_ENGINE_CODE = str(Path(zero_impl.__file__).resolve().parent) + "/"  # the zero_impl package
# what lies between an op's caller and this mode: torch's dispatch wrappers, and this file
_DISPATCH_CODE = ("/torch/_dynamo/", "/torch/_compile.py", "/torch/_ops.py", "/torch/utils/_python_dispatch.py")
_THIS_FILE = str(Path(__file__).resolve())
# megatron's CPU initialization draws each full weight on the host (experiments/models/megatron_gpt.py)
_HOST_FUNCTIONS = {"_initialize_affine_weight_cpu", "init_parameter"}
# the ops that run a cuBLAS GEMM on CUDA (at::cuda::blas gemm/bgemm): the first on a stream takes its workspace
_GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
          torch.ops.aten.baddbmm.default, torch.ops.aten.addbmm.default, torch.ops.aten._addmm_activation.default}


def cuda_block_bytes(nbytes: int, block: int = CUDA_BLOCK) -> int:
    """Bytes the CUDA caching allocator hands out for a request of `nbytes` (0 stays 0)."""
    return -(-nbytes // block) * block


@dataclass
class _Info:
    nbytes: int          # rounded to CUDA_BLOCK
    kind: str            # until counted, if pending: the kind it takes unless the engine holds it
    key: int = -1        # its allocation in the event log (-1: none logged: host memory, or 0 bytes)
    ref: weakref.ref | None = None
    pending: bool = False  # allocated by the engine's code, not counted yet (StorageTracker._settle)


@dataclass
class PhaseRecord:
    """One phase of the run (`step` counts optimizer steps, from 1; 0 before training)."""

    phase: str
    step: int
    peak_bytes: int = 0
    peak_by_kind: dict[str, int] = field(default_factory=dict)
    end_bytes: int = 0
    end_by_kind: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"phase": self.phase, "step": self.step, "peak_bytes": self.peak_bytes,
                "peak_by_kind": dict(self.peak_by_kind), "end_bytes": self.end_bytes,
                "end_by_kind": dict(self.end_by_kind)}


class StorageTracker(TorchDispatchMode):
    """Live device bytes by kind, their peak (with the breakdown at the peak) and a timeline.

        tracker = StorageTracker()
        with tracker:
            tracker.begin("build"); model = ...
            tracker.begin("initialize"); engine = ...; label_engine(tracker, engine)
            ...
        tracker.peak_bytes, tracker.peak_by_kind, tracker.timeline
    """

    def __init__(self, block: int = CUDA_BLOCK, cublas_workspace_bytes: int = 0) -> None:
        """block: sizes are rounded up to a multiple of it (1: the storages' own bytes);
        cublas_workspace_bytes: cuBLAS's workspace per stream in the event log (0: none, as on CPU)."""
        super().__init__()
        self.block = block
        self.cublas_workspace_bytes = cublas_workspace_bytes
        self.stream = 0                      # the stream new allocations are logged on (0: compute)
        self._events: list[Event | None] = []  # None: an allocation found later to be host memory
        self._alloc_at: dict[int, int] = {}  # live key -> its alloc's index in _events
        self._keys = 0
        self._workspace_streams: set[int] = set()
        self._live = WeakIdKeyDictionary()   # UntypedStorage -> _Info
        self.by_kind = dict.fromkeys(KINDS + ("host",), 0)
        self.total = 0                       # device bytes (host excluded)
        self.peak_bytes = 0
        self.peak_by_kind: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.peak_phase = ""
        self.host_peak_bytes = 0
        self.phase, self.step = "build", 0
        self.timeline: list[PhaseRecord] = []
        self._current: PhaseRecord | None = None
        self._orig_resize = None
        self.engine: weakref.ref | None = None  # label_engine's: the engine asked about its allocations
        self._pending: list[tuple[_Info, weakref.ref]] = []  # (info, its storage), in allocation order
        self._settling = False

    # -- phases -----------------------------------------------------------------------------
    def begin(self, phase: str, step: int | None = None) -> None:
        """Close the running phase and start `phase` (one of PHASES)."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self._settle()
        self._close_phase()
        self.phase = phase
        if step is not None:
            self.step = step
        self._current = PhaseRecord(phase, self.step, self.total, self._kinds(), 0, {})
        self.timeline.append(self._current)

    def finish(self) -> None:
        self._settle()
        self._close_phase()
        self._current = None

    def _close_phase(self) -> None:
        if self._current is not None:
            self._current.end_bytes, self._current.end_by_kind = self.total, self._kinds()

    def _kinds(self) -> dict[str, int]:
        return {k: self.by_kind[k] for k in KINDS}

    # -- accounting -------------------------------------------------------------------------
    def _add(self, kind: str, nbytes: int) -> None:
        self.by_kind[kind] += nbytes
        if kind == "host":
            self.host_peak_bytes = max(self.host_peak_bytes, self.by_kind["host"])
            return
        self.total += nbytes
        if nbytes > 0:
            if self.total > self.peak_bytes:
                self.peak_bytes, self.peak_by_kind, self.peak_phase = self.total, self._kinds(), self.phase
            cur = self._current
            if cur is not None and self.total > cur.peak_bytes:
                cur.peak_bytes, cur.peak_by_kind = self.total, self._kinds()

    def _on_free(self, info: _Info, _ref) -> None:
        self._settle()  # this storage too, if pending: counted, then freed
        self._add(info.kind, -info.nbytes)
        self._log_free(info)

    # -- the event log ----------------------------------------------------------------------
    def _log_alloc(self, info: _Info, raw_bytes: int) -> None:
        """Log `info`'s allocation of `raw_bytes` now (none for host memory or 0 bytes)."""
        info.key = -1
        if raw_bytes == 0 or info.kind == "host":
            return
        info.key, self._keys = self._keys, self._keys + 1
        self._alloc_at[info.key] = len(self._events)
        self._events.append(Event("alloc", info.key, raw_bytes, self.stream))

    def _log_free(self, info: _Info) -> None:
        if info.key >= 0 and self._alloc_at.pop(info.key, None) is not None:
            self._events.append(Event("free", info.key, 0, self.stream))
        info.key = -1

    def _unlog(self, info: _Info) -> None:
        """`info` turned out to be host memory: its allocation never reached the device."""
        i = self._alloc_at.pop(info.key, None) if info.key >= 0 else None
        if i is not None:
            self._events[i] = None
        info.key = -1

    def _log_gemm_workspace(self) -> None:
        if self.cublas_workspace_bytes and self.stream not in self._workspace_streams:
            self._workspace_streams.add(self.stream)
            self._events.append(Event("alloc", self._keys, self.cublas_workspace_bytes, self.stream))
            self._keys += 1  # held for the process's life (cublas_handle_stream_to_workspace)

    @property
    def events(self) -> list[Event]:
        """The event log so far, in order (allocations later found to be host memory left out)."""
        return [e for e in self._events if e is not None]

    def track(self, t: torch.Tensor, kind: str | None = None) -> None:
        """Account for `t`'s storage if new (kind: given, or from the engine's state, the phase
        and the stack), or for a change of its size (an op with out= may resize it)."""
        st = t.untyped_storage()
        info = self._live.get(st)
        if info is None:
            self._settle()
            engine_code = False
            if kind is None:
                kind, engine_code = self._classify()
            info = _Info(cuda_block_bytes(st.nbytes(), self.block), kind)
            info.ref = weakref.ref(st, lambda ref, info=info: self._on_free(info, ref))
            self._live[st] = info
            self._log_alloc(info, st.nbytes())
            if engine_code and self._engine() is not None:  # its kind: the engine's, once it holds it
                info.pending = True
                self._pending.append((info, weakref.ref(st)))
            else:
                self._add(info.kind, info.nbytes)
        else:
            self._resized(st, info)

    def _resized(self, st: torch.UntypedStorage, info: _Info) -> None:
        nbytes = cuda_block_bytes(st.nbytes(), self.block)
        if nbytes != info.nbytes:
            self._settle()
            old, info.nbytes = info.nbytes, nbytes
            self._add(info.kind, nbytes - old)
            if info.kind != "host":  # resize_bytes_cuda: the new block, then the old one freed
                old_info = _Info(old, info.kind, info.key)
                self._log_alloc(info, st.nbytes())
                self._log_free(old_info)

    def _engine(self):
        engine = self.engine() if self.engine is not None else None
        return engine if engine is not None and not engine.closed else None

    def _settle(self) -> None:
        """Count the pending storages, in the order they were allocated, each with the kind the
        engine now holds it as (state_tensors()), else the one it was given. Called before any
        other storage's bytes change, so each is counted where its allocation was."""
        if not self._pending or self._settling:
            return
        self._settling = True  # state_tensors() may drop a storage, whose free settles again
        try:
            held = _held_kinds(self._engine())
            pending, self._pending = self._pending, []
            for info, st in pending:
                alive = st()
                info.kind = held.get(alive._cdata, info.kind) if alive is not None else info.kind
                info.pending = False
                if info.kind == "host":
                    self._unlog(info)
                self._add(info.kind, info.nbytes)
        finally:
            self._settling = False

    def relabel(self, tensors, kind: str) -> None:
        """The storages behind `tensors` are `kind` from now on (tracked first if unknown)."""
        self._settle()
        for t in tensors:
            if not torch.is_tensor(t):
                continue
            st = t.untyped_storage()
            info = self._live.get(st)
            if info is None:
                self.track(t, kind)
            elif info.kind != kind:
                self.by_kind[info.kind] -= info.nbytes
                self.by_kind[kind] += info.nbytes
                if "host" in (info.kind, kind):  # moves bytes in or out of the device total
                    self.total += info.nbytes if info.kind == "host" else -info.nbytes
                was_host, info.kind = info.kind == "host", kind
                if kind == "host":
                    self._unlog(info)
                elif was_host:
                    self._log_alloc(info, st.nbytes())

    def live_bytes(self, kind: str | None = None) -> int:
        self._settle()
        return self.total if kind is None else self.by_kind[kind]

    # -- classification ---------------------------------------------------------------------
    def _classify(self) -> tuple[str, bool]:
        """(the kind of a storage allocated now, unless the engine holds it; whether the engine's
        own code allocated it: the op's innermost caller is in the zero_impl package)."""
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename == _THIS_FILE
                                     or any(part in frame.f_code.co_filename for part in _DISPATCH_CODE)):
            frame = frame.f_back
        engine_code = frame is not None and frame.f_code.co_filename.startswith(_ENGINE_CODE)
        origin, phase = _origin(frame, self.phase), self.phase
        if origin == "host":
            return "host", engine_code
        if phase == "build":
            return "params", engine_code
        if phase == "initialize":  # what a part builds is its kind until label_engine relabels
            return (origin if origin in KINDS else "optimizer_states" if origin == "optimizer_init"
                    else "buffers"), engine_code
        if origin == "optimizer_init":
            return "optimizer_states", engine_code
        if phase == "forward":
            return "activations", engine_code
        if phase == "backward":  # recomputation vs gradients
            return "activations" if origin == "forward" else "temporaries", engine_code
        return "temporaries", engine_code

    # -- TorchDispatchMode ------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.track(t)
        if func in _GEMMS:  # the output is allocated before the GEMM takes its handle's workspace
            self._log_gemm_workspace()
        return out

    def __enter__(self):
        self._orig_resize = torch.UntypedStorage.resize_
        orig, tracker = self._orig_resize, self

        @wraps(orig)
        def resize_(st: torch.UntypedStorage, size: int):
            result = orig(st, size)
            info = tracker._live.get(st)
            if info is not None:
                tracker._resized(st, info)
            return result

        torch.UntypedStorage.resize_ = resize_  # not a dispatched op: MemTracker patches it too
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        self.finish()
        return super().__exit__(*exc)

    def summary(self) -> dict:
        """Peak bytes, the breakdown by kind at the peak, its phase, and the timeline."""
        self._settle()
        return {"peak_bytes": self.peak_bytes, "peak_by_kind": dict(self.peak_by_kind), "peak_phase": self.peak_phase,
                "host_peak_bytes": self.host_peak_bytes, "rounding": f"each storage up to a multiple of {self.block} bytes",
                "timeline": [p.as_dict() for p in self.timeline]}


def _origin(frame, phase: str) -> str:
    """Where an allocation comes from: "host" (megatron's CPU weight draw), in initialize the kind
    of the engine part being built (`_BUILDING`), "optimizer_init" (a torch optimizer creating
    its states), "optimizer", "forward" (a forward method: in backward, activation
    recomputation), "backward" (a backward method or torch.autograd: gradients), or "" when
    nothing known is on the stack; the innermost known frame decides."""
    while frame is not None:
        code = frame.f_code
        name, filename = code.co_name, code.co_filename
        if name in _HOST_FUNCTIONS:
            return "host"
        if phase == "initialize" and code in _BUILDER_CODE:
            return _BUILDER_CODE[code]
        if "/torch/optim/" in filename:
            return "optimizer_init" if name == "_init_group" else "optimizer"
        if phase == "backward" and name in ("forward", "backward") and "/torch/utils/_python_dispatch" not in filename:
            return name
        frame = frame.f_back
    return ""


def _held_kinds(engine) -> dict[int, str]:
    """{storage (its StorageImpl): kind} of every tensor `engine` holds (None: no engine)."""
    if engine is None:
        return {}
    return {t.untyped_storage()._cdata: ENGINE_KINDS[kind] for kind, tensors in engine.state_tensors().items()
            for t in tensors}


def label_engine(tracker: StorageTracker, engine) -> None:
    """Relabel every storage `engine` holds by its kind (ZeroEngine.state_tensors), and let the
    tracker ask it about the storages its code allocates from now on (after initialize, after
    each step)."""
    tracker.engine = weakref.ref(engine)
    for kind, tensors in engine.state_tensors().items():
        tracker.relabel(tensors, ENGINE_KINDS[kind])
