"""Local processes: a function on N ranks with torch.distributed initialized (`spawn`: gloo on
CPU, NCCL on GPUs), and independent jobs in child processes of their own, a few at a time, each
under a timeout (`ChildPool`: the simulated points and the largest-model search).

The `fork` start method lets a test or a benchmark pass closures and already-built models to
the ranks and skips re-importing torch and megatron-core in each of them (0.3 s per launch
instead of 9 s); `spawn` is available for code that must not inherit the parent's state.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import queue as queue_lib
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experiments.host_allocator import keep_freed_memory_mapped


class RankFailed(RuntimeError):
    """A rank raised (`reason` "error", its traceback in the message), died ("died", with its
    `exitcode`), or the run timed out ("timeout")."""

    def __init__(self, message: str, reason: str, rank: int | None = None, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.reason, self.rank, self.exitcode = reason, rank, exitcode


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, start_method: str = "fork",
          backend: str | None = None, timeout: float | None = None) -> list[Any]:
    """Call fn(*args) on `world_size` local ranks; return their results in rank order."""
    backend = backend or ("nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo")
    # A forked child must not enter an OpenMP parallel region the parent already started: GNU
    # OpenMP's thread pool does not survive fork, and the child hangs. One thread avoids it.
    threads = 1 if start_method == "fork" else max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context(start_method)
    results: queue_lib.Queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="zero_launch_") as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [ctx.Process(target=_rank_main, args=(rank, world_size, init, backend, threads, fn, args, results),
                             daemon=True) for rank in range(world_size)]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, world_size, timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                p.join(5)


def _collect(procs, results, world_size: int, timeout: float | None) -> list[Any]:
    deadline = None if timeout is None else time.monotonic() + timeout
    out: dict[int, Any] = {}
    while len(out) < world_size:
        try:
            rank, ok, payload = results.get(timeout=0.5)
        except queue_lib.Empty:
            if deadline is not None and time.monotonic() > deadline:
                raise RankFailed(f"timed out after {timeout:.0f} s with ranks {sorted(set(range(world_size)) - set(out))} "
                                 "unfinished", reason="timeout")
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
            if dead:
                code = procs[dead[0]].exitcode
                raise RankFailed(f"rank {dead[0]} died with exit code {code}", reason="died", rank=dead[0], exitcode=code)
            continue
        if not ok:
            raise RankFailed(f"rank {rank} failed:\n{payload}", reason="error", rank=rank)
        out[rank] = pickle.loads(payload)
    return [out[r] for r in range(world_size)]


def _rank_main(rank: int, world_size: int, init: str, backend: str, threads: int,
               fn: Callable[..., Any], args: tuple, results) -> None:
    die_with_parent()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)
    if not torch.cuda.is_available():  # CPU ranks: freed memory stays mapped, as on a GPU (host_allocator.py)
        keep_freed_memory_mapped()
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world_size)
        # Pickled here, not by the queue: torch would otherwise share tensors through file
        # descriptors that vanish when this process exits.
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def die_with_parent() -> None:
    """Linux: have the kernel kill this rank if the launching process dies (a killed sweep must
    not leave ranks behind, blocked in a collective forever)."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# -- independent jobs in child processes ---------------------------------------------------------
@dataclass
class _Child:
    key: Hashable
    proc: Any
    conn: Any
    timeout: float
    started: float = field(default_factory=time.monotonic)


def default_workers() -> int:
    """Children at once when the caller names no number: one per CPU."""
    return os.cpu_count() or 1


class ChildPool:
    """Jobs `fn(*args)` in forked children, each a process of its own (a fake process group must
    be its process's only one), at most `workers` at once, each under its own timeout.

    `submit` starts a job; `finished()` waits a moment and returns the jobs that ended since, as
    (key, ok, payload): payload is fn's result, or why it failed (the child's traceback, its
    death, its timeout: "<what> timed out after N s", "<what> process died with exit code C")."""

    def __init__(self, workers: int | None = None, what: str = "job") -> None:
        self.workers = max(1, workers or default_workers())
        self.what, self.running = what, []
        self._ctx = multiprocessing.get_context("fork")

    @property
    def free(self) -> bool:
        return len(self.running) < self.workers

    def submit(self, key: Hashable, timeout: float, fn: Callable[..., Any], *args: Any) -> None:
        parent, child = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=_child_main, args=(child, fn, args), daemon=True)
        proc.start()
        child.close()
        self.running.append(_Child(key, proc, parent, timeout))

    def finished(self) -> list[tuple[Hashable, bool, Any]]:
        time.sleep(0.05)
        out = []
        for job in list(self.running):
            if job.conn.poll():
                try:
                    ok, payload = pickle.loads(job.conn.recv_bytes())
                except EOFError:
                    ok, payload = False, f"{self.what} process died with exit code {job.proc.exitcode}"
            elif not job.proc.is_alive() and not job.conn.poll():  # it may have sent just before exiting
                ok, payload = False, f"{self.what} process died with exit code {job.proc.exitcode}"
            elif not job.proc.is_alive():
                continue  # its result is in the pipe: read on the next call
            elif time.monotonic() - job.started > job.timeout:
                job.proc.kill()
                ok, payload = False, f"{self.what} timed out after {job.timeout:.0f} s"
            else:
                continue
            self.running.remove(job)
            job.proc.join(5)
            job.conn.close()
            out.append((job.key, ok, payload))
        return out


def run_in_child(fn: Callable[..., Any], *args: Any, timeout: float, what: str = "job") -> Any:
    """fn(*args) in a forked child of its own; its result, or RuntimeError saying why not."""
    pool = ChildPool(1, what)
    pool.submit(None, timeout, fn, *args)
    while not (done := pool.finished()):
        pass
    [(_, ok, payload)] = done
    if not ok:
        raise RuntimeError(payload)
    return payload


def _child_main(conn, fn: Callable[..., Any], args: tuple) -> None:
    die_with_parent()
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool (see spawn)
    try:
        conn.send_bytes(pickle.dumps((True, fn(*args))))
    except BaseException:
        conn.send_bytes(pickle.dumps((False, traceback.format_exc())))
    finally:
        conn.close()
