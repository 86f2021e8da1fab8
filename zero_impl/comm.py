"""Collectives with accounting: every tensor handed to torch.distributed is counted here.

Counting convention (the README's "Accounting"): a reduce-scatter counts its full input, an all-gather its full
output, an all-reduce twice its size, a broadcast (initialization only: agreement.py) its size. With it,
DP and ZeRO stages 1-2 move 2Ψ elements per step and stage 3 moves 3Ψ, the numbers of the paper's Section 7.

Every collective here takes flat tensors (all_gather_into_tensor, reduce_scatter_tensor,
all_reduce), behind which NCCL allocates nothing. None takes a list: ProcessGroupNCCL would
flatten a list of all-gather outputs (or reduce-scatter inputs) into a hidden buffer of the
whole output (input), kept by the Work until it is waited on and dropped.

gloo is another matter (ProcessGroupGloo.cpp, torch 2.13): its reduce_scatter_tensor clones
the whole input, all-reduces the clone and copies this rank's slice out, so it moves an
all-reduce's bytes, twice a reduce-scatter's; its all_gather_into_tensor gathers into a flat
temporary of the whole output and copies it out. On gloo with CPU tensors the two can therefore
run as point-to-point exchanges (`point_to_point`, ZeroConfig.gloo_point_to_point, off by
default: the default is the collectives NCCL gets), which move exactly a reduce-scatter's and an
all-gather's bytes: each rank receives every peer's copy of its own slice and sums them, or
receives every peer's shard straight into its place in the output. Counted the same. A
reduce-scatter's exchange receives into a buffer of its own, (N-1)/N of its input, alive until
it is waited on (gloo's own call clones the whole input). Unlike gloo's own collectives,
which a process group being destroyed drains, an exchange must be waited on before its rank
leaves: a peer's receive would fail.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

@dataclass
class Traffic:
    """Calls, elements and bytes of one (collective kind, purpose) pair."""

    calls: int = 0
    elements: int = 0
    bytes: int = 0

    def add(self, elements: int, nbytes: int) -> None:
        self.calls += 1
        self.elements += elements
        self.bytes += nbytes


class CommLedger:
    """Cumulative traffic by (kind, purpose), shared by all communicators of one engine."""

    def __init__(self) -> None:
        self.traffic: dict[tuple[str, str], Traffic] = defaultdict(Traffic)

    def record(self, kind: str, purpose: str, elements: int, element_size: int) -> None:
        self.traffic[(kind, purpose)].add(elements, elements * element_size)

    def snapshot(self) -> dict[tuple[str, str], Traffic]:
        return {key: Traffic(t.calls, t.elements, t.bytes) for key, t in self.traffic.items()}

    @staticmethod
    def summarize(traffic: dict[tuple[str, str], Traffic], since: dict | None = None,
                  exclude: tuple[str, ...] = ()) -> dict:
        """{"by_kind": {kind: {...}}, "by_purpose": {...}, "elements": n, "bytes": n}: the traffic
        since the snapshot `since`, leaving out the purposes in `exclude`."""
        since = since or {}
        by_kind: dict[str, dict[str, int]] = {}
        by_purpose: dict[str, dict[str, int]] = {}
        for key, t in traffic.items():
            if key[1] in exclude:
                continue
            base = since.get(key, Traffic())
            delta = {"calls": t.calls - base.calls, "elements": t.elements - base.elements,
                     "bytes": t.bytes - base.bytes}
            for table, name in ((by_kind, key[0]), (by_purpose, key[1])):
                row = table.setdefault(name, {"calls": 0, "elements": 0, "bytes": 0})
                for field, value in delta.items():
                    row[field] += value
        return {"by_kind": by_kind, "by_purpose": by_purpose,
                "elements": sum(r["elements"] for r in by_kind.values()),
                "bytes": sum(r["bytes"] for r in by_kind.values())}


class Communicator:
    """One process group (or none: a world of one) plus the ledger its traffic goes to.

    With a single rank no collective is issued and nothing is counted: no data moves, and a
    local copy stands for the collective. Without torch.distributed initialized, the world is
    this process alone. `force` (ZeroConfig.force_collectives) sends even a group of one
    through its backend, counted like any other call: on one GPU with NCCL, every collective
    then runs on NCCL's stream, and every wait is a CUDA event the compute stream must honour,
    as at any world size (a missing wait or a buffer freed too early shows up on one GPU).
    """

    def __init__(self, group: dist.ProcessGroup | None, ledger: CommLedger, tag: str, solo: bool = False,
                 check_order: bool = False, force: bool = False, point_to_point: bool = False) -> None:
        """`group` None is the default group; `solo` makes a world of one whatever the group;
        `check_order` compares every collective across ranks before issuing it; `force` issues
        every collective on the group even when it has one rank (never with `solo`);
        `point_to_point` (ZeroConfig.gloo_point_to_point) runs a gloo group's reduce-scatters and
        all-gathers of CPU tensors as exchanges between every pair of ranks (the module's docstring)."""
        self.group = group
        self.ledger = ledger
        self.tag = tag
        self.check_order = check_order
        self.calls = 0
        active = not solo and dist.is_available() and dist.is_initialized()
        if force and not solo and not active:
            raise ValueError("ZeroConfig.force_collectives sends collectives through the process group: "
                             "initialize torch.distributed first (a world of one is fine)")
        self.size = dist.get_world_size(group) if active else 1
        self.rank = dist.get_rank(group) if active else 0
        self.local = self.size == 1 and not (force and active)  # no collective: a copy stands for it
        self.point_to_point = point_to_point and self.size > 1 and _gloo_runs_cpu_tensors(group)

    def _record(self, kind: str, purpose: str, elements: int, tensor: torch.Tensor) -> None:
        """Count a collective about to be issued; with check_order, first make sure every rank
        of the group is about to issue the same one (raising on all of them if not)."""
        self.calls += 1
        if self.check_order:
            mine = (self.calls, kind, purpose, elements, str(tensor.dtype))
            everyone: list = [None] * self.size
            dist.all_gather_object(everyone, mine, group=self.group)
            if any(other != mine for other in everyone):
                described = "; ".join(f"rank {r}: call #{c} {k}/{p} of {n} {d} elements"
                                      for r, (c, k, p, n, d) in enumerate(everyone))
                raise RuntimeError(f"collective order diverged on the {self.tag} group: {described}")
        self.ledger.record(kind, purpose, elements, tensor.element_size())

    def all_reduce(self, tensor: torch.Tensor, purpose: str, async_op: bool = False):
        """Sum `tensor` over the group, in place."""
        if self.local:
            return None
        self._record("all_reduce", purpose, 2 * tensor.numel(), tensor)
        return dist.all_reduce(tensor, group=self.group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, purpose: str) -> None:
        """The group's first rank's `tensor` to every rank, in place (blocking); counted as its size."""
        if self.local:
            return
        self._record("broadcast", purpose, tensor.numel(), tensor)
        dist.broadcast(tensor, group=self.group, group_src=0)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, purpose: str, async_op: bool = False):
        """Sum `input` over ranks; this rank receives its contiguous 1/size slice in `output`."""
        if self.local:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return None
        exchange = self._exchanges(output, input, "reduce_scatter")
        self._record("reduce_scatter", purpose, input.numel(), input)
        if exchange:
            return self._finish_unless_async(_ExchangeWork.reduce_scatter(output, input, self), async_op)
        return dist.reduce_scatter_single(output, input, group=self.group, async_op=async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, purpose: str, async_op: bool = False):
        """Concatenate every rank's `input` into the flat `output` (in place when input is a view of it)."""
        if self.local:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return None
        exchange = self._exchanges(output, input, "all_gather")
        self._record("all_gather", purpose, output.numel(), output)
        if exchange:
            return self._finish_unless_async(_ExchangeWork.all_gather(output, input, self), async_op)
        return dist.all_gather_single(output, input, group=self.group, async_op=async_op)

    def _exchanges(self, output: torch.Tensor, input: torch.Tensor, what: str) -> bool:
        """Whether this call runs as a point-to-point exchange; if so, its tensors are checked
        before anything is counted or sent: the whole (a reduce-scatter's input, an all-gather's
        output) N times the part, one dtype, as gloo's own calls check, and both flat and
        contiguous, as every caller's are (stricter than gloo)."""
        if not (self.point_to_point and input.device.type == "cpu"):
            return False
        whole, part = (input, output) if what == "reduce_scatter" else (output, input)
        if not (whole.dtype == part.dtype and whole.is_contiguous() and part.is_contiguous()
                and whole.dim() == part.dim() == 1 and whole.numel() == self.size * part.numel()):
            raise ValueError(f"{what} on the {self.tag} group takes flat contiguous tensors of one dtype, the "
                             f"whole {self.size} times the part: got {tuple(whole.shape)} {whole.dtype} and "
                             f"{tuple(part.shape)} {part.dtype}")
        return True

    @staticmethod
    def _finish_unless_async(work: _ExchangeWork, async_op: bool) -> _ExchangeWork | None:
        if async_op:
            return work
        work.wait()
        return None


def _gloo_runs_cpu_tensors(group: dist.ProcessGroup | None) -> bool:
    """The group's backend for CPU tensors is gloo: "gloo" (configured "cpu:gloo,cuda:gloo"), no
    backend named ("cpu:gloo" on a CPU build), or mixed ("cpu:gloo,cuda:nccl")."""
    return "cpu:gloo" in dist.get_backend_config(group).split(",")


EXCHANGE_TAG = 0x5A45  # gloo's slot for the exchanges, apart from any other point-to-point traffic of a group


class _ExchangeWork:
    """A reduce-scatter or all-gather run as point-to-point sends and receives (gloo, CPU).

    Every rank posts all its receives before any send: a rank's exchange completes only once
    each peer has sent to it, and so has posted all its own receives; no rank can finish and
    leave while a peer has yet to post one (gloo fails a receive posted to a closed peer).
    Sends and receives of one pair of ranks match in the order they were posted, the same on
    every rank, as the collectives they stand for are issued in the same order everywhere.
    The summing of a reduce-scatter happens in wait(), where the collective's would have ended.

    gloo's point-to-point works alone hold the buffers gloo reads and writes (its pairs only
    point at them), and a work reports completion only once waited on. So every exchange stays
    in `unfinished` until its wait: one dropped unwaited (an engine deleted without close(), a
    wait that raised) keeps its buffers for the life of the process, and gloo never writes
    into freed memory."""

    unfinished: set[_ExchangeWork] = set()

    def __init__(self, comm: Communicator, receives: list[torch.Tensor | None], sends: list[torch.Tensor],
                 finish=None) -> None:
        """Post, for every peer p (rank order), a receive into receives[p], then a send of
        sends[p]; this rank's own entries are skipped."""
        peers = [p for p in range(comm.size) if p != comm.rank]
        self.ops = [dist.P2POp(dist.irecv, receives[p], group=comm.group, tag=EXCHANGE_TAG, group_peer=p)
                    for p in peers]
        self.ops += [dist.P2POp(dist.isend, sends[p], group=comm.group, tag=EXCHANGE_TAG, group_peer=p)
                     for p in peers]
        self.finish = finish
        _ExchangeWork.unfinished.add(self)  # before posting: the ops hold the buffers, even if posting fails
        self.works = dist.batch_isend_irecv(self.ops)

    @classmethod
    def reduce_scatter(cls, output: torch.Tensor, input: torch.Tensor, comm: Communicator) -> _ExchangeWork:
        """Each peer's copy of this rank's slice lands in its row of `received`; the sum goes to
        `output` (which may be this rank's slice of `input` itself, stage 1's in-place reduction)."""
        slices = input.chunk(comm.size)
        received = torch.empty((comm.size - 1, output.numel()), dtype=input.dtype, device=input.device)
        rows = iter(received)
        receives = [None if p == comm.rank else next(rows) for p in range(comm.size)]

        def finish() -> None:  # this rank's own slice, then its peers' in rank order: deterministic
            torch.add(slices[comm.rank], received[0], out=output)
            for more in received[1:]:
                output.add_(more)
        return cls(comm, receives, list(slices), finish)

    @classmethod
    def all_gather(cls, output: torch.Tensor, input: torch.Tensor, comm: Communicator) -> _ExchangeWork:
        """Each peer's shard lands in its place in `output`; this rank's is copied there unless
        `input` is that place already (the post-step gathers, in place)."""
        places = output.chunk(comm.size)
        if places[comm.rank].data_ptr() != input.data_ptr():
            places[comm.rank].copy_(input)
        return cls(comm, list(places), [input] * comm.size)

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        _ExchangeWork.unfinished.discard(self)
        self.ops, self.works = [], []
        if self.finish is not None:
            self.finish, finish = None, self.finish
            finish()
        return True
