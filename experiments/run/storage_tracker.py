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
    activations       what forward (and recomputation in backward) allocates, the logits included
    buffers           the engine's working buffers: gradient staging buckets, reduce-scatter
                      outputs, anything the engine allocates outside its persistent states
    temporaries       everything else: gradients of activations, the optimizer step's temporaries
    host              (not device memory) megatron's CPU initialization: the full fp32 TP=1 weight
                      drawn on the host before each rank keeps its slice; ZeRO-R's Pa+cpu
                      checkpoint slices (zero_impl/activations.py, `pool == "host"`)

A storage's kind is decided when it is allocated, from the phase the runner is in
(`tracker.phase`: build, initialize, forward, backward, step) and the innermost frame of the
Python stack that belongs to a known place (`_origin`); the engine's persistent states are then
relabelled from the engine's own structures (`label_engine`) after initialize and after each step.

Sizes are rounded as the CUDA caching allocator rounds blocks: up to a multiple of 512 bytes
(`CUDA_BLOCK`), per storage. Totals exclude `host`.
"""
from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from functools import wraps
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

CUDA_BLOCK = 512  # c10/cuda/CUDACachingAllocator.cpp kMinBlockSize: every block is a multiple of it
KINDS = ("params", "gathered_params", "grads", "optimizer_states", "activations", "buffers", "temporaries")
PHASES = ("build", "initialize", "forward", "backward", "step")

_REPO = Path(__file__).resolve().parents[2]
_ZERO = str(_REPO / "zero_impl") + "/"
_ENGINE_BUFFER_FILES = ("grad_reducer.py", "stage3.py", "flat_params.py", "comm.py", "layout.py")
# what the engine allocates while it is built, until label_engine says exactly (the flat buffer
# also cuts the fp32 masters, stage 3 its fp32 shards)
_INITIALIZE_KINDS = {"flat_params.py": "params", "stage3.py": "params", "grad_reducer.py": "grads",
                     "optimizer.py": "optimizer_states"}
# megatron's CPU initialization draws each full weight on the host (experiments/models/megatron_gpt.py)
_HOST_FUNCTIONS = {"_initialize_affine_weight_cpu", "init_parameter"}


def cuda_block_bytes(nbytes: int, block: int = CUDA_BLOCK) -> int:
    """Bytes the CUDA caching allocator hands out for a request of `nbytes` (0 stays 0)."""
    return -(-nbytes // block) * block


@dataclass
class _Info:
    nbytes: int          # rounded to CUDA_BLOCK
    kind: str
    ref: weakref.ref | None = None


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

    def __init__(self, block: int = CUDA_BLOCK) -> None:
        """block: sizes are rounded up to a multiple of it (1: the storages' own bytes)."""
        super().__init__()
        self.block = block
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

    # -- phases -----------------------------------------------------------------------------
    def begin(self, phase: str, step: int | None = None) -> None:
        """Close the running phase and start `phase` (one of PHASES)."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self._close_phase()
        self.phase = phase
        if step is not None:
            self.step = step
        self._current = PhaseRecord(phase, self.step, self.total, self._kinds(), 0, {})
        self.timeline.append(self._current)

    def finish(self) -> None:
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
        self._add(info.kind, -info.nbytes)

    def track(self, t: torch.Tensor, kind: str | None = None) -> None:
        """Account for `t`'s storage if new (kind: given, or from the phase and the stack), or
        for a change of its size (an op with out= may resize it)."""
        st = t.untyped_storage()
        info = self._live.get(st)
        if info is None:
            info = _Info(cuda_block_bytes(st.nbytes(), self.block), kind or self._classify())
            info.ref = weakref.ref(st, lambda ref, info=info: self._on_free(info, ref))
            self._live[st] = info
            self._add(info.kind, info.nbytes)
        else:
            self._resized(st, info)

    def _resized(self, st: torch.UntypedStorage, info: _Info) -> None:
        nbytes = cuda_block_bytes(st.nbytes(), self.block)
        if nbytes != info.nbytes:
            old, info.nbytes = info.nbytes, nbytes
            self._add(info.kind, nbytes - old)

    def relabel(self, tensors, kind: str) -> None:
        """The storages behind `tensors` are `kind` from now on (tracked first if unknown)."""
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
                info.kind = kind

    def live_bytes(self, kind: str | None = None) -> int:
        return self.total if kind is None else self.by_kind[kind]

    # -- classification ---------------------------------------------------------------------
    def _classify(self) -> str:
        origin = _origin(sys._getframe(1), self.phase)
        phase = self.phase
        if origin == "host":
            return "host"
        if phase == "build":
            return "params"
        if origin.startswith("zero_impl/"):
            file = origin.split("/", 1)[1]
            if phase == "initialize":  # provisional until label_engine relabels the persistent states
                return _INITIALIZE_KINDS.get(file, "buffers")
            if file in _ENGINE_BUFFER_FILES:
                return "buffers"
            if file == "activations.py":  # ZeRO-R: the kept checkpoints (slices, MD's arena) in forward,
                return "activations" if phase == "forward" else "buffers"  # CB's gather/prefetch pools after
            return "activations" if phase == "forward" else "temporaries"  # engine.py casts, optimizer.py
        if origin == "optimizer_init":
            return "optimizer_states"
        if phase == "initialize":
            return "buffers"
        if phase == "forward":
            return "activations"
        if phase == "backward":
            return "activations" if origin == "forward" else "temporaries"  # recomputation vs gradients
        return "temporaries"

    # -- TorchDispatchMode ------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.track(t)
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
        return {"peak_bytes": self.peak_bytes, "peak_by_kind": dict(self.peak_by_kind), "peak_phase": self.peak_phase,
                "host_peak_bytes": self.host_peak_bytes, "rounding": f"each storage up to a multiple of {self.block} bytes",
                "timeline": [p.as_dict() for p in self.timeline]}


def _origin(frame, phase: str) -> str:
    """Where an allocation comes from: "host" (megatron's CPU weight draw), "zero_impl/<file>",
    "optimizer_init" (a torch optimizer creating its states), "optimizer", "forward" (a forward
    method: in backward, activation recomputation), "backward" (a backward method or
    torch.autograd: gradients), or "" when nothing known is on the stack."""
    while frame is not None:
        code = frame.f_code
        name, filename = code.co_name, code.co_filename
        if name in _HOST_FUNCTIONS:
            return "host"
        if filename.startswith(_ZERO):
            rel = filename[len(_ZERO):]
            if rel == "activations.py" and _host_pool(frame):
                return "host"
            return "zero_impl/" + rel
        if "/torch/optim/" in filename:
            return "optimizer_init" if name == "_init_group" else "optimizer"
        if phase == "backward" and name in ("forward", "backward") and "/torch/utils/_python_dispatch" not in filename:
            return name
        frame = frame.f_back
    return ""


def _host_pool(frame) -> bool:
    """ZeRO-R's Pa+cpu (zero_impl/activations.py) keeps checkpoint slices in host memory: its
    frames that allocate them have `pool == "host"`. On a GPU they would be on the CPU; in a
    simulation every tensor is on the CPU, so they are told apart here."""
    while frame is not None and frame.f_code.co_filename.endswith("zero_impl/activations.py"):
        if frame.f_locals.get("pool") == "host":
            return True
        frame = frame.f_back
    return False


def label_engine(tracker: StorageTracker, engine) -> None:
    """Relabel the engine's persistent states by kind, from its own structures (after
    initialize, after each step)."""
    params = getattr(engine, "params", None)
    gathered = []
    if params is not None and hasattr(params, "units"):  # stage 3: gathered buffers vs resident shards
        gathered = [u.flat for u in params.units if getattr(u, "flat", None) is not None and not u.persistent]
    gathered_ids = {id(t) for t in gathered}
    resident = [t for t in (params.param_tensors() if params is not None else []) if id(t) not in gathered_ids]
    tracker.relabel([*engine.module.parameters(), *resident], "params")
    tracker.relabel(gathered, "gathered_params")
    grads = engine.grads
    tracker.relabel([grads.full] if grads.full is not None else list(grads.shard_grads), "grads")
    opt = engine.sharded_optimizer
    masters = [] if opt.share_master else [m.tensor for m in opt.masters]
    states = [v for state in opt.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    tracker.relabel(masters + states, "optimizer_states")
