"""The simulated rank sees what ProcessGroupNCCL allocates behind list-based collectives.

On torch's fake backend (world 128), under the simulation's StorageTracker: an async all-gather
into a list holds a flat buffer of the whole output until its Work is dropped, a list
reduce-scatter one of the whole input until it is waited on, a synchronous call holds it for
the call only, and tensor collectives hold nothing.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from experiments.run.nccl_list_buffers import NcclListBuffers
from experiments.run.storage_tracker import StorageTracker

WORLD, CHUNK = 128, 1000  # 128 x 1000 fp32: 512,000 bytes, a multiple of the tracker's 512-byte blocks
FLAT = WORLD * CHUNK * 4


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield
    dist.destroy_process_group()


def test_list_collectives_hold_nccls_flat_buffer(fake_world):
    tracker = StorageTracker()
    with NcclListBuffers(), tracker:
        tracker.begin("step")
        # made under the tracker: a storage it first meets as an op's output would count as new
        outputs = [torch.zeros(CHUNK) for _ in range(WORLD)]
        inputs = [torch.zeros(CHUNK) for _ in range(WORLD)]
        mine, flat_out, shard = torch.zeros(CHUNK), torch.zeros(WORLD * CHUNK), torch.zeros(CHUNK)
        base = tracker.live_bytes()
        work = dist.all_gather(outputs, mine, async_op=True)
        assert tracker.live_bytes() - base == FLAT
        work.wait()
        assert tracker.live_bytes() - base == FLAT  # the Work's outputs: until the Work is dropped
        del work
        assert tracker.live_bytes() == base

        work = dist.reduce_scatter(shard, inputs, async_op=True)
        assert tracker.live_bytes() - base == FLAT
        work.wait()  # the flattened input is stashed until the wait
        assert tracker.live_bytes() == base

        assert dist.all_gather(outputs, mine) is None  # synchronous: held for the call only
        assert tracker.live_bytes() == base and tracker.peak_bytes - base == FLAT

        dist.all_gather_single(flat_out, mine, async_op=True).wait()  # a tensor collective: nothing
        assert tracker.peak_bytes - base == FLAT
