"""The paper's scale on one CPU: a point's rank simulated at its true world size on fake tensors.

    python experiments/sweep.py experiment=fig2 simulate=true        # every Figure 2 point, world 256-400
    python experiments/sweep.py experiment=fig4 simulate=true simulate_rank=5
    python experiments/train.py model=fig4_13b stage=2 gpus=128 cluster=dgx2_v100 simulate=true

One process per point plays one rank (`simulate_rank`, default 0) of the point's whole job:
torch's fake process-group backend (`FakeProcessGroup`) accepts every collective, with the
right shapes, for any world size, so megatron-core's parallel state lays out the real TP x DP
groups; `FakeTensorMode` runs every op with shapes, dtypes and devices but no data and no
memory. On top of that runs what a real point runs: the model built by run/build.py's `build_model`
(eagerly, or on the meta device and materialized unit by unit by stage 3), the ZeRO engine with
the point's stage, precision and knobs, and `SIM_STEPS` complete training steps (forward,
backward, step, with the point's recomputation and gradient accumulation). Every storage the
rank allocates is seen by `StorageTracker` (experiments/run/storage_tracker.py), which gives the
peak device bytes, by phase and by kind, rounded to the CUDA caching allocator's 512-byte blocks,
and logs every allocation and free in order, which run/reserved.py replays through the caching
allocator (experiments/allocator): the bytes the rank would *reserve*, segments and all.

What changes in a simulation (and only there):
- no values exist, so nothing data-dependent can be read: the engine's step skips its host
  reads (zero_impl/optimizer.py: the norm is NaN, no overflow, no clipping: the step applies),
  and no loss is recorded;
- megatron's RNG tracker forks without its CPU-RNG sanity check (an `.item()` on a comparison);
- tensors are fake *CPU* tensors standing for the GPU's (fake CUDA tensors fail in this CPU-only
  torch build), so the point's train.layer_spec must be megatron's `local` one (Transformer
  Engine needs CUDA), and what the initialization allocates while it draws each weight, chunk
  by chunk, before the TP rank keeps its slice (models/megatron_gpt.py `init_parameter`), is
  counted as host memory: on a GPU those chunks are short-lived device memory, never at the peak;
- the optimizer runs torch's multi-tensor (foreach) AdamW, the implementation torch picks for
  CUDA tensors, when the point's cluster has GPUs.

The verdict: `fits` when the replayed allocator's reserved peak, on a device of
cluster.device_memory_gb (x 1e9 bytes, the suite's convention) less cluster.cuda_reserve_gb (the
CUDA context and what lives outside the allocator), never runs out of memory; the record's
status is then `ok`, else `oom` with the kind that dominates the tensor peak named. What a
simulation cannot see: NCCL's communicator buffers (the flat copies ProcessGroupNCCL makes behind
list collectives it does see: run/nccl_list_buffers.py), kernels' workspaces outside the
allocator, when other streams release the blocks they used, and time (no step time, no TFLOPs).
"""
from __future__ import annotations

import contextlib
import functools
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import zero_impl
from experiments import records
from experiments.launch import run_in_child
from experiments.models.megatron_gpt import gpt_loss, initialize_parallel
from experiments.points import Point, check_simulate_rank, simulated_precision
from experiments.run.build import build_model, micro_batch_tokens, wrap_in_engine
from experiments.run.collective_counter import CollectiveCounter
from experiments.run.nccl_list_buffers import NcclListBuffers
from experiments.run.record import simulated_path, simulated_record
from experiments.run.reserved import alloc_conf_from_env, cublas_workspace_bytes, reserved_memory
from experiments.run.storage_tracker import StorageTracker, label_engine

# zero_impl compares two buffers' addresses at DP 1 to skip a copy onto itself; a fake tensor
# has no address, and torch warns of it each time
warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")

SIM_STEPS = 2  # optimizer steps: the first creates the optimizer states, the second runs with them


# -- precision --------------------------------------------------------------------------------
def is_gpu_cluster(point: Point) -> bool:
    return point.cluster.get("device_memory_gb") is not None


# -- megatron under fake tensors --------------------------------------------------------------
@contextlib.contextmanager
def _fake_safe_rng_tracker():
    """megatron's RNG tracker whose fork() swaps states as megatron's does but skips its check
    that the CPU RNG did not move (an `.item()`, impossible on fake tensors)."""
    from megatron.core.tensor_parallel import random as megatron_random

    tracker = megatron_random._CUDA_RNG_STATE_TRACKER
    original = type(tracker)

    class FakeSafeTracker(original):
        @contextlib.contextmanager
        def fork(self, name=megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"cuda rng state {name} is not added")
            orig_state = megatron_random._get_cuda_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            megatron_random._set_cuda_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = megatron_random._get_cuda_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                megatron_random._set_cuda_rng_state(orig_state)
                self._current_state_name = orig_name

    tracker.__class__ = FakeSafeTracker
    try:
        yield
    finally:
        tracker.__class__ = original


# -- one rank's training, measured ------------------------------------------------------------
def train_measured(point_dict: dict, precision: str, *, steps: int = SIM_STEPS, foreach: bool | None = None,
                   fake: bool = True) -> dict:
    """Build, wrap and train `point` on this rank (torch.distributed is up: the fake backend for
    a simulation, gloo for a real run), under a StorageTracker; this rank's measurements.

    The same function measures a simulated rank (fake=True: under FakeTensorMode) and a real
    one (fake=False: real CPU tensors), so the two can be compared (tests/experiments/test_simulate.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    point = Point(**point_dict)
    t = point.train
    device = torch.device("cpu")
    dp_group, tp_group = initialize_parallel(point.tp, seed=t["seed"])
    torch.manual_seed(t["seed"])
    tracker = StorageTracker(cublas_workspace_bytes=cublas_workspace_bytes(point) if fake else 0)
    counter = CollectiveCounter({"tp": tp_group, "dp": dp_group})
    seconds: dict[str, float] = {}
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    rng = _fake_safe_rng_tracker() if fake else contextlib.nullcontext()

    def phase(name: str | None, step: int | None = None) -> None:
        """Start phase `name` (None: end the last one), adding up each phase's wall time."""
        now = time.perf_counter()
        if tracker.timeline:
            last = tracker.timeline[-1].phase
            seconds[last] = seconds.get(last, 0.0) + now - phase.started
        phase.started = now
        if name is None:
            tracker.finish()
        else:
            tracker.begin(name, step)

    phase.started = time.perf_counter()
    with rng, mode, NcclListBuffers(), counter, tracker:  # NCCL's list buffers: outside the counter
        phase("build")
        model, init_fn = build_model(point, device, zero_impl.DTYPES[precision])
        phase("initialize")
        # a real rank makes the calls a simulated one does, NCCL's: no point-to-point exchanges on gloo
        engine = wrap_in_engine(point, precision, model, init_fn, dp_group, tp_group, gloo_point_to_point=False,
                                **({} if foreach is None else {"foreach": foreach}))
        label_engine(tracker, engine)
        dp_rank = dist.get_rank(dp_group)
        for step in range(steps):
            for micro in range(t["grad_accum_steps"]):
                phase("forward", step + 1)
                tokens = micro_batch_tokens(point, step, micro, dp_rank)  # alive through backward, as in train.py
                loss = gpt_loss(engine, tokens)
                phase("backward")
                engine.backward(loss)
                del loss
                phase("step")
                engine.step()
                label_engine(tracker, engine)
        phase(None)
        stats = engine.stats()
    replayed = time.perf_counter()
    reserved = reserved_memory(point, tracker.events)
    seconds["allocator_replay"] = time.perf_counter() - replayed
    return {"rank": dist.get_rank(), "memory": tracker.summary(), "reserved": reserved, "stats": stats,
            "tp_traffic": counter.summary(), "phase_seconds": seconds, "steps": steps, "foreach": foreach}


def simulate_point(point_dict: dict, precision: str, rank: int = 0, *, steps: int = SIM_STEPS,
                   foreach: bool | None = None) -> dict:
    """Play rank `rank` of the point's whole world in this process (fake backend, fake tensors)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    point = Point(**point_dict)
    if not 0 <= rank < point.gpus:
        raise ValueError(f"simulate_rank must be in [0, {point.gpus}), got {rank}")
    started = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=point.gpus)
    try:
        result = train_measured(point_dict, precision, steps=steps, foreach=foreach, fake=True)
    finally:
        from megatron.core import parallel_state
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    result["wall_s"] = time.perf_counter() - started
    return result


# -- one point in a child process, or in this one ------------------------------------------------
def simulate_in_child(point_dict: dict, precision: str, rank: int = 0, *, foreach: bool | None = None,
                      timeout: float = 600.0) -> dict:
    """simulate_point in a forked process of its own (the fake world must be this process's
    only process group); its result, or RuntimeError with the child's traceback."""
    return run_in_child(functools.partial(simulate_point, foreach=foreach), point_dict, precision, rank,
                        timeout=timeout, what="simulation")


def simulate_and_record(point: Point, results_dir: Path, rank: int = 0) -> tuple[dict, Path]:
    """train.py simulate=true: simulate `point` in this process and write its record under
    results_dir/<experiment>/simulated/; the record and its path (a point that does not fit is
    a successful simulation: its record says oom; a failed one has no `simulation` entry)."""
    check_simulate_rank([point], rank)
    alloc_conf_from_env()  # a bad PYTORCH_CUDA_ALLOC_CONF is refused before the simulation starts
    precision, started = simulated_precision(point), records.now()
    try:
        result, error = simulate_point(point.as_dict(), precision, rank,
                                       foreach=True if is_gpu_cluster(point) else None), None
    except Exception:
        result, error = None, traceback.format_exc()
    record = simulated_record(point, precision, result, error, started, rank)
    path = simulated_path(results_dir / point.experiment, point, rank)
    records.write_record(path, record)
    return record, path
