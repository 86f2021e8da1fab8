"""Stages 1-2's post-step all-gather at DP 128: in place, with a bounded number of elements in
flight, and waited on inside the next forward, bucket by bucket, as its modules run.

The rank plays DP 128 on torch's fake process group (no data moves; real, small CPU tensors).
Every collective the engine sends to torch.distributed is watched, and each is charged what
ProcessGroupNCCL would hold for it until its Work is waited on: for an all-gather into a list,
the flat buffer of the whole output it gathers into; for any call, an input that is not a view
of the output (NCCL stashes it, so a clone made for the call lives that long).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from torch.utils._python_dispatch import TorchDispatchMode

import zero_impl
from helpers import adamw, global_batch, make_model, param_groups
from experiments.launch import spawn
from experiments.models.tiny_gpt import lm_loss

WORLD = 128


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield
    dist.destroy_process_group()


class GatherWatch:
    """Bytes NCCL would hold for the all-gathers in flight, and the elements they gather."""

    def __init__(self) -> None:
        self.log: list[str] = []  # "issue" and "wait" of each gather, in order (with ComputeLog's "mm")
        self.temporaries = self.elements = 0
        self.peak_temporaries = self.peak_elements = self.calls = self.max_concurrent = 0
        self.open = 0

    def issue(self, fn, output_numel: int, temporary: int, async_op: bool, *args, **kwargs):
        self.calls += 1
        self.log.append("issue")
        self.temporaries += temporary
        self.elements += output_numel
        self.open += 1
        self.peak_temporaries = max(self.peak_temporaries, self.temporaries)
        self.peak_elements = max(self.peak_elements, self.elements)
        self.max_concurrent = max(self.max_concurrent, self.open)
        work = fn(*args, async_op=async_op, **kwargs)
        if not async_op:
            self._done(output_numel, temporary)
            return work
        watch = self

        class Work:
            def wait(self, *a, **k):
                watch.log.append("wait")
                watch._done(output_numel, temporary)
                return work.wait(*a, **k)
        return Work()

    def _done(self, output_numel: int, temporary: int) -> None:
        self.temporaries -= temporary
        self.elements -= output_numel
        self.open -= 1


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def watch_gathers(monkeypatch) -> GatherWatch:
    watch = GatherWatch()
    single, listed = dist.all_gather_single, dist.all_gather

    def all_gather_single(output, input, group=None, async_op=False):
        stashed = 0 if _aliases(output, input) else input.nbytes
        return watch.issue(single, output.numel(), stashed, async_op, output, input, group=group)

    def all_gather(outputs, input, group=None, async_op=False):
        flat = sum(t.nbytes for t in outputs)  # newLikeFlat(outputs), ProcessGroupNCCL::allgather
        stashed = 0 if any(_aliases(o, input) for o in outputs) else input.nbytes
        return watch.issue(listed, sum(t.numel() for t in outputs), flat + stashed, async_op, outputs, input,
                           group=group)

    monkeypatch.setattr(dist, "all_gather_single", all_gather_single)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    return watch


class ComputeLog(TorchDispatchMode):
    """Appends "mm" to `log` for every matrix multiply dispatched."""

    MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.MATMULS:
            self.log.append("mm")
        return func(*args, **(kwargs or {}))


def _engine(stage: int, cap: int, **config) -> zero_impl.ZeroEngine:
    # Buckets of about 300 elements come out at 128-768 after the alignment to lcm(128, 128):
    # the 768 one is the issue's bucket "a little over allgather_bucket_size" (gathered before
    # in chunks, into list outputs, from clones), and 700 in flight lets two smaller buckets
    # overlap but not three, so the bound binds and is not vacuous.
    config = zero_impl.ZeroConfig(stage=stage, reduce_bucket_size=300, allgather_bucket_size=cap, overlap_comm=True,
                                  **{"overlap_param_gather": True, **config})
    engine = zero_impl.initialize(make_model(), config, adamw, param_groups=None)
    tokens = global_batch(0, 1, 1)[0, 0]
    engine.backward(lm_loss(engine(tokens), tokens))
    return engine


@pytest.mark.parametrize("stage", [1, 2])
def test_post_step_allgather_in_place_and_bounded(fake_world, monkeypatch, stage):
    cap = 700
    engine = _engine(stage, cap)
    watch = watch_gathers(monkeypatch)
    assert engine.step()
    assert watch.open >= 1  # held in flight past step(): the next forward waits on them
    engine.finish_param_gathers()

    buckets = engine.params.buckets
    itemsize = 4
    assert len(buckets) >= 4 and any(b.numel > cap for b in buckets)
    assert watch.peak_temporaries == 0  # no list buffer, no clone: every input is a view of its output
    assert watch.peak_elements <= max(cap, max(b.numel for b in buckets))  # in flight: within the bound...
    assert watch.max_concurrent >= 2  # ...which still lets gathers overlap
    assert watch.calls == len(buckets)  # one all-gather per bucket, nothing chunked
    assert engine.params.allgather_bytes() == watch.peak_elements * itemsize
    assert engine.params.allgather_limit_bytes() == max(cap, max(b.numel for b in buckets)) * itemsize
    assert watch.temporaries == 0 and watch.open == 0  # every gather waited on
    engine.close()


@pytest.mark.parametrize("stage", [1, 2])
def test_post_step_gathers_are_waited_on_inside_the_next_forward(fake_world, monkeypatch, stage):
    """The next forward issues its first matrix multiply before the last gathers are waited on
    (they hide behind it), and every module still computes with its updated parameters."""
    engine = _engine(stage, cap=10 ** 9)
    watch = watch_gathers(monkeypatch)
    assert engine.step()
    issued = watch.log.count("issue")
    assert issued == len(engine.params.buckets) >= 4 and "wait" not in watch.log  # all out, none waited on
    tokens = global_batch(1, 1, 1)[0, 0]
    with ComputeLog(watch.log):
        lm_loss(engine(tokens), tokens)
    first_mm = watch.log.index("mm")
    assert "wait" in watch.log[:first_mm] and "wait" in watch.log[first_mm:]  # the first layer's, then later ones
    assert watch.open == 0 and watch.log.count("wait") == issued  # all waited on by the forward's end
    engine.close()


@pytest.mark.parametrize("finish", ["full_parameters", "close", "state_dict", "submodule state_dict",
                                    "overlap_param_gather=False", "default"])
def test_nothing_after_step_leaves_a_gather_open(fake_world, monkeypatch, finish):
    if finish == "default":  # overlap_param_gather is opt-in: step() completes the gathers
        assert zero_impl.ZeroConfig().overlap_param_gather is False
        engine = zero_impl.initialize(make_model(), zero_impl.ZeroConfig(stage=2, reduce_bucket_size=300,
                                                                         allgather_bucket_size=700),
                                      adamw, param_groups=None)
        tokens = global_batch(0, 1, 1)[0, 0]
        engine.backward(lm_loss(engine(tokens), tokens))
    else:
        engine = _engine(2, cap=700, overlap_param_gather=finish != "overlap_param_gather=False")
    watch = watch_gathers(monkeypatch)
    engine.step()
    buckets = len(engine.params.buckets)
    if finish == "full_parameters":
        engine.full_parameters()
    elif finish == "close":
        engine.close()
    elif finish == "state_dict":  # the wrapped module's state-dict pre-hook (torch.save, EMA over it)
        engine.module.state_dict()
    elif finish == "submodule state_dict":  # each owning module has the hook: a part's state dict too
        engine.module.ln_f.state_dict()
    # every post-step gather waited on (full_parameters' own export gathers are blocking ones)
    assert watch.open == 0 and watch.log.count("wait") == buckets


def _after_step_values(stage: int, overlap_param_gather: bool) -> dict:
    """Two ranks, two steps: what a step leaves for full_parameters(), a forward and close()."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config = zero_impl.ZeroConfig(stage=stage, reduce_bucket_size=300, allgather_bucket_size=700,
                                  overlap_param_gather=overlap_param_gather)
    model = make_model()
    engine = zero_impl.initialize(model, config, adamw, param_groups=param_groups(model))
    out = {}
    for step in range(2):
        tokens = global_batch(step, world, 1)[0, rank]
        engine.backward(lm_loss(engine(tokens), tokens))
        engine.step()
    # right after the step, gathers in flight: the module's state dict, then full_parameters()
    out["state_dict"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["full"] = engine.full_parameters()
    tokens = global_batch(2, world, 1)[0, rank]
    out["loss"] = lm_loss(engine(tokens), tokens).item()
    engine.close()
    out["closed"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_values_after_step_are_the_updated_ones(stage):
    """full_parameters() right after step(), the next forward's loss and close()'s parameters are
    the same with the gathers waited on in the next forward as with them completed in step()."""
    lazy, eager = (spawn(_after_step_values, 2, stage, flag, timeout=120) for flag in (True, False))
    for a, b in zip(lazy, eager):
        assert all(torch.equal(a["full"][n], b["full"][n]) for n in b["full"])
        assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in b["state_dict"])
        assert a["loss"] == b["loss"]
        assert all(torch.equal(a["closed"][n], b["closed"][n]) for n in b["closed"])
        assert all(torch.equal(a["closed"][n], a["full"][n]) for n in a["closed"])  # fp32: the masters
