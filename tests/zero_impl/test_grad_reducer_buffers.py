"""The gradient reducer's buffers (grad_reducer.py): stage 2-3 staging buffers live only as long
as the stream order needs them; parameters without a gradient are zeroed in one kernel.

On CUDA the reducer finishes each reduce-scatter on a side stream. Its staging buffer and
reduce-scatter output must stay alive until the compute stream has waited for that stream, and
no longer: record_stream would let the caching allocator reuse them only once an event has
completed as seen from the host, so the in-flight bound would not hold on the device. Here, on
CPU, a fake side stream and a fake compute stream stand for CUDA's and a fake communicator's
asynchronous reduce-scatter for NCCL's, so the same code path runs and each buffer's lifetime
is watched through weak references.
"""
from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zero_impl import grad_reducer
from zero_impl.grad_reducer import MAX_INFLIGHT_STAGING, BucketedGradReducer
from zero_impl.layout import Slot, build_buckets


class FakeWork:
    def __init__(self, output: torch.Tensor, input: torch.Tensor, log: list) -> None:
        self.output, self.input, self.log = output, input, log

    def wait(self) -> None:
        self.output.copy_(self.input[:self.output.numel()])
        self.log.append("wait")


class FakeComm:
    size, rank = 2, 0

    def __init__(self, watch) -> None:
        self.watch = watch

    def reduce_scatter(self, output, input, purpose, async_op=False):
        self.watch(input, output)
        return FakeWork(output, input, self.watch.log)


class Watch:
    """Weak references to every staging buffer and reduce-scatter output handed to the collective."""

    def __init__(self) -> None:
        self.log: list = []
        self.refs: list[weakref.ref] = []
        self.staging: list[weakref.ref] = []
        self.max_alive_staging = 0

    def __call__(self, staging: torch.Tensor, out: torch.Tensor) -> None:
        self.staging.append(weakref.ref(staging))
        self.refs += [weakref.ref(staging), weakref.ref(out)]
        self.max_alive_staging = max(self.max_alive_staging, sum(r() is not None for r in self.staging))


class FakeComputeStream:
    """At each wait on the side stream: every buffer the side stream finished with is still alive
    (freeing it earlier would let the compute stream reuse memory the side stream still reads)."""

    def __init__(self, watch: Watch) -> None:
        self.watch, self.waits, self.dead_before_wait, self.checked = watch, 0, 0, 0

    def wait_stream(self, stream) -> None:
        self.waits += 1
        finished = self.watch.log.count("wait")  # those finished since the last wait, not yet released
        self.dead_before_wait += sum(r() is None for r in self.watch.staging[self.checked:finished])
        self.checked = finished


@pytest.mark.parametrize("first_micro_step", [True, False])
def test_staging_buffers_held_until_compute_waits_then_released(monkeypatch, first_micro_step):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16, bias=False) for _ in range(8)])
    params = list(model.parameters())
    slots = [Slot(f"p{i}", p, 0, True) for i, p in enumerate(reversed(params))]
    buckets = build_buckets(slots, bucket_size=256, shard_count=2)  # one parameter a bucket
    assert len(buckets) == 8
    watch = Watch()
    compute = FakeComputeStream(watch)
    record_stream_calls = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: record_stream_calls.append(s))
    monkeypatch.setattr(grad_reducer.torch.cuda, "current_stream", lambda device=None: compute)
    reducer = BucketedGradReducer(buckets, slots, stage=2, comm=FakeComm(watch), dtype=torch.float32,
                                  overlap=True, device=torch.device("cpu"))
    reducer.side = object()  # stands for the CUDA side stream: the reducer takes its CUDA path
    if not first_micro_step:  # a previous micro-step wrote every shard
        reducer.begin_backward(reduce=True, first_micro_step=True)
        model(torch.randn(4, 16)).sum().backward()
        reducer.end_backward()
        watch.__init__()
        compute.__init__(watch)
    reducer.begin_backward(reduce=True, first_micro_step=first_micro_step)
    model(torch.randn(4, 16)).sum().backward()
    reducer.end_backward()

    assert record_stream_calls == []  # the caching allocator's host-side event reuse would break the bound
    assert watch.log.count("wait") == 8
    assert compute.dead_before_wait == 0  # no buffer freed before the compute stream waited for its last use
    # released at the bound, not only at the end of backward: the bound holds
    assert compute.waits >= 8 - MAX_INFLIGHT_STAGING
    assert watch.max_alive_staging <= MAX_INFLIGHT_STAGING + 1
    assert all(r() is None for r in watch.staging)
    assert all(r() is None or any(r() is g for g in reducer.shard_grads)
               for r in watch.refs)  # nothing but the persistent shards outlives backward
    assert reducer.finished == [] and reducer.buffer_bytes() == 0
    reducer.close()


class ZeroOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += "zero" in func.__name__
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("unused", [1, 7])
def test_parameters_without_gradients_zeroed_in_one_kernel(unused):
    """Stage 1, one bucket of 8 parameters of which `unused` get no gradient: at the bucket's
    reduction they are zeroed (stale values in the buffer before) by one kernel, whatever their count."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16, bias=False) for _ in range(8)]
    slots = [Slot(f"p{i}", layer.weight, 0, True) for i, layer in enumerate(layers)]
    buckets = build_buckets(slots, bucket_size=10 ** 6, shard_count=2)
    assert len(buckets) == 1
    reducer = BucketedGradReducer(buckets, slots, stage=1, comm=FakeComm(Watch()), dtype=torch.float32,
                                  overlap=True, device=torch.device("cpu"))
    reducer.full.fill_(float("nan"))  # what a stale buffer could hold
    reducer.begin_backward(reduce=True, first_micro_step=True)
    x = torch.randn(4, 16)
    for layer in layers[:8 - unused]:
        x = layer(x)
    x.sum().backward()
    with ZeroOps() as ops:
        reducer.end_backward()
    assert ops.calls == 1
    for slot in slots[8 - unused:]:
        assert torch.equal(reducer.full[slot.start:slot.end], torch.zeros(slot.numel))
    reducer.close()
