"""Every rank of a point agrees on its outcome before any rank goes on (run/real.py `run_as_rank`),
through the job's TCPStore rather than the point's communicators, which a failure can leave blocked.

On NCCL a rank that waits in a collective for a peer that raised never returns on its own: its
kernel spins until the watchdog's timeout. So:
1. A rank whose point raised posts why under `failed` (compare-and-set: the first failure is the
   point's), then aborts its communicators (ncclCommAbort: its pending collectives are dropped,
   not drained, as a graceful destroy would try to).
2. It also wakes a watcher thread on every rank (a key per rank, `wake/<rank>`), which aborts
   that rank's communicators too: the collective its main thread is blocked in then raises.
3. Every rank posts its outcome; rank 0 waits for them all (at most train.timeout_s), writes the
   record (the first failure's traceback and rank) and posts the verdict; the others wait for it,
   then tell rank 0 they are done with the store (its server lives in rank 0).
After a failure no rank makes a collective call, so none can wait for a call another will not make.
A rank that posts no outcome in time (it died, or is stuck outside any collective) ends the job's
world: rank 0 records which ranks were silent, and every rank raises RanksLost.
Gloo has no abort: there a blocked rank returns when the failing rank's group is destroyed (its
sockets close) or at the group's timeout.
"""
from __future__ import annotations

import json
import threading
import traceback
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator

import torch.distributed as dist

from experiments.run.record import classify_failure

WATCHER_JOIN_S = 10.0  # the watcher returns as soon as its key is set; longer only if the store is gone


class PointFailed(RuntimeError):
    """The point failed on some rank: rank 0's record says which rank and why."""


class RanksLost(RuntimeError):
    """A rank posted no outcome in time: the job's ranks cannot train another point together."""


class OutcomeAgreement:
    """One point's ranks agreeing on its outcome through `store` (the point's own prefix of the
    job's store): `with agreement.watching():` around the point's collectives, `failed(e)` in its
    except block, then `decide`, and on rank 0 `publish` once the record is written."""

    def __init__(self, store: dist.Store, rank: int, world: int, timeout_s: float) -> None:
        self.store, self.rank, self.world, self.timeout_s = store, rank, world, timeout_s
        self._lock, self._settled, self._aborted = threading.Lock(), threading.Event(), False

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Abort this rank's communicators as soon as any rank posts a failure. On exit: stop
        the watcher (joined: a thread left blocked in the store's C++ code would abort the
        interpreter's exit), and destroy the process group unless it was aborted."""
        watcher = threading.Thread(target=self._watch, args=(self.store.clone(),), daemon=True, name="outcome-watch")
        watcher.start()
        try:
            yield
        except BaseException:  # what the point's own except blocks let through (KeyboardInterrupt)
            self._abort()
            raise
        finally:
            with self._lock:
                self._settled.set()
                if not self._aborted:
                    dist.destroy_process_group()
            try:
                self.store.set(f"wake/{self.rank}", "settled")
            finally:
                watcher.join(WATCHER_JOIN_S)

    def failed(self, error: Exception) -> dict:
        """This rank's point raised `error` (call in its except block): tell every rank, then abort
        this rank's communicators, in that order, so the failure it causes elsewhere is never
        taken for the first. Returns this rank's outcome."""
        outcome = {"kind": "failed", "rank": self.rank, "status": classify_failure(error)[0],
                   "error": "".join(traceback.format_exception(error))}
        self.store.compare_set("failed", "", json.dumps(outcome))
        self.store.multi_set([f"wake/{r}" for r in range(self.world)], ["failed"] * self.world)
        self._abort()
        return outcome

    def decide(self, outcome: dict) -> dict:
        """Post this rank's outcome ({"kind": "ok"}, {"kind": "preempted", "error", "resume"}, or
        `failed`'s); return the point's verdict ({"status", "error", "resume", "silent"}): rank 0
        makes it from every rank's outcome, the others get it once rank 0 has published it."""
        self.store.set(f"outcome/{self.rank}", json.dumps(outcome))
        if self.rank != 0:
            wait = timedelta(seconds=2 * self.timeout_s)  # rank 0 waits timeout_s for outcomes, then writes
            try:
                self.store.wait(["verdict"], wait)
                verdict = json.loads(self.store.get("verdict"))
            except dist.DistError as e:
                raise RanksLost(f"rank 0 gave no verdict on the point within {wait.total_seconds():.0f} s "
                                f"(it died, or is stuck): {e}") from e
            self.store.set(f"left/{self.rank}", "")
            return verdict
        keys = [f"outcome/{r}" for r in range(self.world)]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
            silent = []
        except dist.DistStoreError:  # timed out: someone is missing
            silent = [r for r, key in enumerate(keys) if not self.store.check([key])]
        posted = [json.loads(v) for v in self.store.multi_get([k for r, k in enumerate(keys) if r not in silent])]
        first = json.loads(self.store.get("failed")) if self.store.check(["failed"]) else None
        failing = [o["rank"] for o in posted if o["kind"] == "failed"]
        preempted = [o for o in posted if o["kind"] == "preempted"]
        verdict = {"status": "ok", "error": None, "resume": None, "silent": silent}
        if first is not None:
            verdict.update(status=first["status"], error=f"rank {first['rank']} failed first (ranks {failing} failed):"
                                                         f"\n{first['error']}")
        elif preempted:  # every rank stops after the same step (train_rank's stop flag is all-reduced)
            verdict.update(status="timeout", error=preempted[0]["error"], resume=preempted[0]["resume"])
        if silent:
            verdict.update(status="fail", error=f"ranks {silent} posted no outcome within {self.timeout_s:.0f} s "
                                                f"(died, or stuck outside any collective); the job ends"
                                                + (f"\n{verdict['error']}" if verdict["error"] else ""))
        return verdict

    def publish(self, verdict: dict) -> None:
        """Rank 0, once the record is written: give the others the verdict, and wait (bounded)
        until they have it, so that the store's server outlives their last call."""
        self.store.set("verdict", json.dumps(verdict))
        others = [f"left/{r}" for r in range(1, self.world) if r not in verdict["silent"]]
        try:
            self.store.wait(others, timedelta(seconds=self.timeout_s))
        except dist.DistStoreError:
            pass  # a rank that died after posting its outcome: nothing left to tell it

    def _watch(self, store: dist.Store) -> None:
        """Wait for this rank's wake key: a failure (abort) or the point's end (nothing to do)."""
        store.set_timeout(timedelta(days=365))  # this clone's own: woken by a key, not by polling
        try:
            store.wait([f"wake/{self.rank}"])
        except dist.DistError:
            pass  # the store's server died with rank 0 before the point ended: nothing will wake us
        self._abort()

    def _abort(self) -> None:
        """Abort every communicator of this rank (torch aborts NCCL's inside one ncclGroupStart/End,
        so that aborting one cannot wait on another); from either thread, once, never after the
        point's process group was destroyed."""
        with self._lock:
            if not self._aborted and not self._settled.is_set() and dist.is_initialized():
                dist.distributed_c10d._abort_process_group()
            self._aborted = True
