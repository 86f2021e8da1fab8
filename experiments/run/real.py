"""One point on real ranks: megatron-core GPT, TP x DP, the ZeRO engine, timed steps, one record.

`train_rank` trains a point on this rank (torch.distributed is up); `run_as_rank` is one rank of a
job that torchrun, srun or submitit launched (experiments/train.py): rank 0 writes
results/runs/<experiment>/<point_id>.json, also when the point fails. A local sweep
(experiments/sweeps/local.py) calls `train_rank` on ranks it forks itself and writes the record
from the parent.
"""
from __future__ import annotations

import os
import resource
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

import zero_impl
from experiments import records
from experiments.host_allocator import freed_memory_kept, keep_freed_memory_mapped
from experiments.models.megatron_gpt import gpt_loss, initialize_parallel
from experiments.points import ConfigError, Point, resolve_precision
from experiments.run.build import build_model, micro_batch_tokens, wrap_in_engine
from experiments.run.outcome import OutcomeAgreement, PointFailed, RanksLost
from experiments.run.record import build_record


class Preempted(Exception):
    """The launcher asked the point to stop (Slurm's signal before the time limit): the ranks
    saved a checkpoint after `step` completed steps."""

    def __init__(self, step: int, checkpoint: str) -> None:
        super().__init__(f"stopped after step {step} at the launcher's request (Slurm's signal before the "
                         f"time limit); resume from {checkpoint} with train.resume=true")
        self.step, self.checkpoint = step, checkpoint


def checkpoint_root(point: Point, experiment_dir: Path) -> Path:
    """Where a point's checkpoints go: train.checkpoint_dir, else <experiment folder>/checkpoints/<its
    checkpoint id> (its id less train.steps: a resume with another train.steps finds them)."""
    return Path(point.train["checkpoint_dir"]) if point.train["checkpoint_dir"] else \
        experiment_dir / "checkpoints" / point.checkpoint_id


def with_checkpoint_dir(point: Point, experiment_dir: Path) -> dict:
    """point.as_dict() with train.checkpoint_dir resolved (checkpoint_root), for train_rank."""
    resolved = point.as_dict()
    resolved["train"]["checkpoint_dir"] = str(checkpoint_root(point, experiment_dir))
    return resolved


def train_rank(point_dict: dict, precision: str, on_step=None) -> dict:
    """Train one point on this rank (torch.distributed is up); return this rank's measurements.

    Checkpoints (zero_impl.checkpoint) go to train.checkpoint_dir/step_<N> every train.checkpoint_every
    steps, and when the file named by $ZERO_REPRO_STOP_FILE appears (slurm/launch.sh creates it
    on Slurm's signal before the time limit): then the ranks save and raise Preempted. With
    train.resume, training starts from the latest complete checkpoint there (as rank 0 lists
    it), losses and step times included. `on_step(steps done, latest checkpoint)` is called after each step that ends a
    timing window (StepClock): every warm-up step, and the timed steps where the loop closes one."""
    point = Point(**point_dict)
    t = point.train
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":  # torchrun's ranks too: freed memory stays mapped, as on a GPU (host_allocator.py)
        keep_freed_memory_mapped()
    dp_group, tp_group = initialize_parallel(point.tp, seed=t["seed"], timeout_s=t["timeout_s"])
    torch.manual_seed(t["seed"])
    peak = PeakMemory(device)  # from the build through the first optimizer step
    model, init_fn = build_model(point, device, zero_impl.DTYPES[precision])
    engine = wrap_in_engine(point, precision, model, init_fn, dp_group, tp_group)
    dp_rank = dist.get_rank(dp_group)
    losses, times, activation_bytes = [], [], 0
    start, saved, resumed_from = 0, None, None
    root = Path(t["checkpoint_dir"]) if t["checkpoint_dir"] else None
    if t["resume"] and root is not None:
        latest, skipped = zero_impl.checkpoint.resume_point(root)  # rank 0's listing, on every rank
        if dist.get_rank() == 0:
            print(_resuming_from(root, latest, skipped), flush=True)
        if latest is not None:
            saved = resumed_from = str(latest)
            progress = zero_impl.checkpoint.load(engine, saved)
            start, losses, times = progress["step"], progress["losses"], progress["step_times_s"]
            if start > t["warmup_steps"] + t["steps"]:  # else the loop would train nothing and record the old run's
                raise ConfigError(f"train.resume: the latest checkpoint, {saved}, is at step {start}, past this run's "
                                  f"end (train.warmup_steps {t['warmup_steps']} + train.steps {t['steps']}): ask for "
                                  f"train.steps >= {start - t['warmup_steps']}, or train.resume=false to start afresh")
    stop_file = os.environ.get("ZERO_REPRO_STOP_FILE")
    if on_step is not None:
        on_step(start, saved)
    end = t["warmup_steps"] + t["steps"]
    clock, totals = StepClock(device), []  # the open timing window's steps and their losses, on the device
    for step in range(start, end):
        if step == min(1, end - 1) and dist.get_rank() == _faulty_rank(t["fault"]):
            _inject(t["fault"])  # before the barrier: the other ranks wait there for the faulty one
        timed = step >= t["warmup_steps"]
        if not timed or not clock.open or t["fault"] != "none":  # a timing window starts from an idle device, ranks aligned
            _sync(device)
            dist.barrier()
        if timed:
            clock.start_step()
        total = torch.zeros((), device=device)
        for micro in range(t["grad_accum_steps"]):
            tokens = micro_batch_tokens(point, step, micro, dp_rank).to(device)
            if step == start and micro == 0:  # measure what forward saves for backward, once
                with SavedActivations(model) as census:
                    loss = gpt_loss(engine, tokens)
                activation_bytes = census.bytes
            else:
                loss = gpt_loss(engine, tokens)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / t["grad_accum_steps"]
        peak.stop()
        totals.append(total)
        save_due = root is not None and t["checkpoint_every"] and (step + 1) % t["checkpoint_every"] == 0
        # host work ahead closes the window: a checkpoint, the end, a fault run's step (never timed
        # for speed), and under a stop file every STOP_CHECK_STEPS steps, to look for the file
        check_stop = bool(stop_file) and len(clock.marks) >= STOP_CHECK_STEPS
        if not timed or save_due or check_stop or t["fault"] != "none" or step + 1 == end:
            times += clock.close()
            losses += _mean_losses(totals, dp_group)
            totals = []
        if t["fault"] == "slow":
            time.sleep(1.0)
        stop = not clock.open and _stop_requested(stop_file, device) and step + 1 < end
        if root is not None and (stop or save_due):
            saved = str(zero_impl.checkpoint.save(engine, root / f"step_{step + 1}",
                                                  extra={"step": step + 1, "losses": losses, "step_times_s": times}))
        if on_step is not None and not clock.open:  # rank 0's pending record: host work, between windows
            on_step(step + 1, saved)
        if stop:
            engine.finish_param_gathers()  # in flight (overlap_param_gather): no rank leaves before them
            raise Preempted(step + 1, saved)
    engine.finish_param_gathers()  # the last step's, in flight (overlap_param_gather): no rank leaves before them
    stats = engine.stats()
    memory = stats["memory"]
    memory["activations_saved"] = activation_bytes
    memory["peak_bytes"] = peak.bytes
    memory["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if device.type == "cuda":
        memory["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
        memory["cuda_max_reserved"] = torch.cuda.max_memory_reserved()
    return {"rank": dist.get_rank(), "losses": losses, "step_times_s": times, "stats": stats,
            "freed_memory_kept": freed_memory_kept(),  # then peak_rss holds freed memory kept for reuse too
            "resume": {"last_step": len(losses), "checkpoint": saved, "resumed_from": resumed_from,
                       "resumed_step": start if resumed_from else None}}


def _resuming_from(root: Path, latest: Path | None, skipped: list[Path]) -> str:
    """What train.resume starts from, in one line: the newest complete checkpoint and the
    unfinished saves after it that it passes over (a save killed or failed midway)."""
    passed = f"; passing over the unfinished save(s) {', '.join(p.name for p in skipped)}" if skipped else ""
    if latest is None:
        return f"train.resume: no complete checkpoint in {root}{passed}; starting at step 0"
    return f"train.resume: from {latest}, the newest complete checkpoint in {root}{passed}"


# Timed steps between looks for the stop file (slurm/launch.sh): each look reads a flag all ranks
# reduce, a host sync that closes the timing window. Slurm warns 600 s ahead (slurm/run_*.sh), and
# ten steps of the paper's points take well under that.
STOP_CHECK_STEPS = 10


class StepClock:
    """Each timed step's duration as the device ran it, with no wait on the host between steps.

    A window of consecutive steps is timed by marks where each step begins: on CUDA timing events
    on the compute stream, read once the window closes; on CPU, where the ops run on the host, the
    host's clock. Between steps nothing waits: the next forward waits for the post-step parameter
    gathers only where its modules need them (overlap_param_gather), so each step pays the part of
    the gathers its forward does not hide, as in a training run; a sync before every step would
    complete them off the clock and time none of it. The loop closes the window (one sync) before
    host work that is not training: a checkpoint, the stop-file check, the end. A window's first
    step starts from an idle device: it does not wait for the previous step's gathers (one step
    in each window, the run's only window unless it checkpoints or watches a stop file)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []  # the open window's step starts

    @property
    def open(self) -> bool:
        return bool(self.marks)

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start_step(self) -> None:
        self.marks.append(self._now())

    def close(self) -> list[float]:
        """End the window after its last step; its steps' seconds, in order."""
        if not self.marks:
            return []
        marks, self.marks = self.marks + [self._now()], []
        if self.cuda:
            marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
        return [b - a for a, b in zip(marks, marks[1:])]


def _mean_losses(totals: list[torch.Tensor], dp_group) -> list[float]:
    """Each step's loss averaged over the DP ranks, read to the host once a window closes (one
    all-reduce a step, as each was reduced alone: the same sums, bitwise)."""
    works = [dist.all_reduce(total, group=dp_group, async_op=True) for total in totals]
    for work in works:
        work.wait()
    return [total.item() / dist.get_world_size(dp_group) for total in totals]


def _stop_requested(stop_file: str | None, device: torch.device) -> bool:
    """Whether any rank sees the stop file (all ranks agree: they stop after the same step)."""
    if not stop_file:
        return False
    flag = torch.tensor([float(os.path.exists(stop_file))], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


class PeakMemory:
    """Peak bytes of live tensors on this rank: the CUDA allocator's statistics on a GPU (the
    whole run); on CPU torch's MemTracker, which sees every allocation and free, from creation
    until `stop()` (the build, `initialize` and the first optimizer step, where the steady state
    is reached: Adam's states exist from then on)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda, self.peak = device.type == "cuda", 0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
            self.tracker = None
        else:
            # MemTracker's gradient hook reads param.grad before it is accumulated (None: the
            # engine's hooks move each gradient into its bucket), and its backward hooks outlive
            # modules
            warnings.filterwarnings("ignore", message="Expected a tensor .* but got <class 'NoneType'>",
                                    category=UserWarning)
            warnings.filterwarnings("ignore", message="Module is None", category=UserWarning)
            self.tracker = MemTracker()
            self.tracker.__enter__()

    def stop(self) -> None:
        if self.tracker is not None:
            self.peak = sum(kinds["Total"] for kinds in self.tracker.get_tracker_snapshot("peak").values())
            self.tracker.__exit__(None, None, None)
            self.tracker = None

    @property
    def bytes(self) -> int:
        self.stop()
        return torch.cuda.max_memory_allocated() if self.cuda else self.peak


class SavedActivations:
    """Counts the distinct storages forward saves for backward, parameters excluded."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {id(p) for p in model.parameters()}
        self.storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) not in self.params and t.device.type != "meta":
            storage = t.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> "SavedActivations":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _faulty_rank(fault: str) -> int | None:
    """The rank an injected train.fault hits (None: no fault, or `slow`, which every rank runs)."""
    last = dist.get_world_size() - 1
    return {"raise": 0, "hang": 0, "raise_last_rank": last, "hang_last_rank": last}.get(fault)


def _inject(fault: str) -> None:
    if fault.startswith("raise"):
        raise RuntimeError(f"injected fault (train.fault={fault}) on rank {dist.get_rank()}")
    time.sleep(10 ** 6)  # "hang": the other ranks wait in a collective until the point times out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# -- one rank of a launched job ------------------------------------------------------------------
def run_as_rank(point: Point, results_dir: Path, launcher: str, store: dist.Store | None = None) -> Path | None:
    """Train `point` as one rank of a job whose launcher (torchrun, srun, submitit) set RANK,
    WORLD_SIZE and LOCAL_RANK, and MASTER_ADDR and MASTER_PORT unless it passes the job's `store`
    (a submitit job's points share one). Every rank agrees on the point's outcome before it
    returns (experiments/run/outcome.py); rank 0 writes the record, with the first failing rank's
    traceback; then, if the point did not finish, every rank raises (Preempted, PointFailed, or
    RanksLost when a rank posted no outcome in time) and exits non-zero. Returns the record's
    path on rank 0 and None on the others."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != point.gpus:
        raise ConfigError(f"gpus={point.gpus} but the launcher started {world} ranks")
    if torch.cuda.is_available():  # first: resolve_precision asks the current device (no context on GPU 0)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    precision = resolve_precision(point.train["precision"])
    path = results_dir / point.experiment / f"{point.point_id}.json"
    started = records.now()
    root = checkpoint_root(point, results_dir / point.experiment)
    pending = PendingTimeout(path, build_record(point, precision, launcher, "timeout", None, "", started)) \
        if rank == 0 and os.environ.get("ZERO_REPRO_STOP_FILE") else None
    # On an error or timeout NCCL's watchdog aborts the communicators and the rank raises, where
    # torch's default (3) would kill the process before it can post its outcome (outcome.py).
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    backend, timeout = "nccl" if torch.cuda.is_available() else "gloo", timedelta(seconds=point.train["timeout_s"])
    if store is None:  # the launcher's (env://)
        dist.init_process_group(backend, timeout=timeout)
        store = dist.distributed_c10d._get_default_store()
    else:
        dist.init_process_group(backend, store=dist.PrefixStore(f"{point.point_id}/pg/", store), rank=rank,
                                world_size=world, timeout=timeout)
    agreement = OutcomeAgreement(dist.PrefixStore(f"{point.point_id}/outcome/", store), rank, world,
                                 point.train["timeout_s"])
    error: Exception | None = None
    try:
        with agreement.watching():
            try:
                result = train_rank(with_checkpoint_dir(point, results_dir / point.experiment), precision,
                                    on_step=pending)
                results = [None] * world
                dist.all_gather_object(results, result)
                outcome = {"kind": "ok"}
            except Preempted as e:  # saved before the time limit: the record says where to resume
                error, outcome = e, {"kind": "preempted", "error": str(e),
                                     "resume": {"last_step": e.step, "checkpoint": e.checkpoint}}
            except Exception as e:  # a record that says why, then the rank's non-zero exit
                error, outcome = e, agreement.failed(e)
        verdict = agreement.decide(outcome)
        if rank == 0:
            resume = verdict["resume"] or (None if verdict["status"] == "ok" else _resume_point(root))
            records.write_record(path, build_record(point, precision, launcher, verdict["status"],
                                                    results if verdict["status"] == "ok" else None,
                                                    verdict["error"], started, resume=resume))
            if pending is not None:
                pending.discard()  # now: a launcher's later clean-up would move it over this record
            if verdict["status"] == "timeout":  # the launcher requeues on this marker, not on a record's text
                Path(os.environ["ZERO_REPRO_STOP_FILE"] + ".saved").touch()
            # Nobody exits before rank 0 has written: the launcher kills the job's other ranks as
            # soon as one exits, and at 400 ranks the first of them would beat rank 0's write.
            agreement.publish(verdict)
    finally:
        if pending is not None:
            pending.discard()
    if verdict["silent"]:
        raise RanksLost(verdict["error"]) from error
    if verdict["status"] == "timeout" and isinstance(error, Preempted):
        raise error
    if verdict["status"] != "ok":
        lines = verdict["error"].strip().splitlines()
        raise PointFailed(f"point {point.point_id}: " + " ".join(dict.fromkeys((lines[0], lines[-1])))) from error
    return path if rank == 0 else None


def _resume_point(root: Path) -> dict:
    latest = zero_impl.checkpoint.latest(root) if root.exists() else None
    return {"checkpoint": str(latest) if latest else None}


class PendingTimeout:
    """Under Slurm (slurm/launch.sh), rank 0 keeps `<record>.pending`: the point's record as it
    would read if Slurm ended the job now (status timeout, the last step and checkpoint). The
    launcher's TERM trap renames it to the record; a rank that writes a real record discards it."""

    def __init__(self, record_path: Path, record: dict) -> None:
        self.path, self.record = Path(f"{record_path}.pending"), record

    def __call__(self, step: int, checkpoint: str | None) -> None:
        self.record["resume"] = {"last_step": step, "checkpoint": checkpoint}
        self.record["error"] = (f"ended by Slurm (time limit or scancel) after step {step}; "
                                + (f"resume from {checkpoint} with train.resume=true" if checkpoint else
                                   "no checkpoint yet (train.checkpoint_every)"))
        self.record["finished"] = records.now()
        records.write_record(self.path, self.record)

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)
