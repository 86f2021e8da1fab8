"""On gloo, with ZeroConfig.gloo_point_to_point, reduce-scatters and all-gathers run as
point-to-point exchanges (comm.py).

gloo's reduce_scatter_tensor all-reduces a clone of its input, and its all_gather_into_tensor
copies through a temporary; the exchanges move a reduce-scatter's and an all-gather's bytes,
no more. Checked against gloo's own collectives on integer-valued data (sums exact in any
order): the same results, in place as out of place, with several exchanges in flight before the
first wait; the ledger counts them as the collectives they stand for; and the sends handed to
torch.distributed carry exactly the convention's elements, counted in a dispatch mode.
Training with them is compared with the reference in test_parity (gloo_point_to_point=True cases).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from experiments.launch import spawn
from zero_impl.comm import CommLedger, Communicator

SHARD = 1000  # elements per rank


class SentElements(TorchDispatchMode):
    """Elements handed to torch.distributed's point-to-point sends, and the other c10d calls."""

    def __init__(self) -> None:
        super().__init__()
        self.sent, self.other = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            if func.__name__.startswith("send"):
                self.sent += sum(t.numel() for t in args[0])
            elif not func.__name__.startswith(("recv", "wait")):
                self.other.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _data(world: int, rank: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * salt + rank)
    return torch.randint(-1000, 1000, (world * SHARD,), generator=g).float()


def _exchanges() -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    exchange = Communicator(None, CommLedger(), "dp", point_to_point=True)
    native = Communicator(None, CommLedger(), "dp", point_to_point=False)
    assert exchange.point_to_point and not native.point_to_point
    out: dict = {}

    # reduce-scatter, out of place, two in flight before the first wait (matched in order)
    inputs = [_data(world, rank, salt) for salt in (1, 2)]
    mine = [torch.empty(SHARD) for _ in inputs]
    with SentElements() as counted:
        works = [exchange.reduce_scatter(m, x, "grads", async_op=True) for m, x in zip(mine, inputs)]
        for work in works:
            work.wait()
    out["rs_sent"], out["rs_other"] = counted.sent, counted.other
    expected = [torch.empty(SHARD) for _ in inputs]
    for e, x in zip(expected, inputs):
        native.reduce_scatter(e, x.clone(), "grads")
    out["rs_equal"] = all(torch.equal(m, e) for m, e in zip(mine, expected))

    # reduce-scatter in place: the output is this rank's slice of the input (stage 1)
    flat = _data(world, rank, 3)
    reference = torch.empty(SHARD)
    native.reduce_scatter(reference, flat.clone(), "grads")
    exchange.reduce_scatter(flat[rank * SHARD:(rank + 1) * SHARD], flat, "grads")
    out["rs_in_place_equal"] = torch.equal(flat[rank * SHARD:(rank + 1) * SHARD], reference)

    # all-gather, in place (the post-step gathers) and out of place
    full = torch.zeros(world * SHARD)
    full[rank * SHARD:(rank + 1) * SHARD] = _data(1, rank, 4)
    expected_full = torch.empty(world * SHARD)
    native.all_gather(expected_full, full[rank * SHARD:(rank + 1) * SHARD].clone(), "params")
    with SentElements() as counted:
        exchange.all_gather(full, full[rank * SHARD:(rank + 1) * SHARD], "params")
    out["ag_sent"], out["ag_other"] = counted.sent, counted.other
    apart, expected_apart = torch.empty(world * SHARD), torch.empty(world * SHARD)
    exchange.all_gather(apart, _data(1, rank, 5), "params")
    native.all_gather(expected_apart, _data(1, rank, 5), "params")
    out["ag_equal"] = torch.equal(full, expected_full) and torch.equal(apart, expected_apart)

    out["ledgers_equal"] = exchange.ledger.snapshot() == native.ledger.snapshot()
    try:  # a whole that is not N parts is rejected before anything is sent, as gloo's own call does
        exchange.reduce_scatter(torch.empty(SHARD), torch.empty(world * SHARD + 1), "grads")
    except ValueError as e:
        out["rejected"] = str(e)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_exchanges_equal_gloos_collectives(world):
    for rank, got in enumerate(spawn(_exchanges, world, timeout=120)):
        assert got["rs_equal"] and got["rs_in_place_equal"] and got["ag_equal"], rank
        # what went to torch.distributed: sends only, of a reduce-scatter's and an all-gather's bytes
        assert got["rs_other"] == [] and got["ag_other"] == []
        assert got["rs_sent"] == 2 * (world - 1) * SHARD  # two reduce-scatters: (N-1)/N of each input
        assert got["ag_sent"] == (world - 1) * SHARD       # the shard to every peer
        assert got["ledgers_equal"]
        assert "reduce_scatter on the dp group takes flat contiguous tensors" in got.get("rejected", "")
