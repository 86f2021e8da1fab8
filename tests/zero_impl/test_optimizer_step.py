"""The optimizer step's temporaries are bounded by optimizer_bucket_size (CB, zero_impl/optimizer.py).

Stepping a mixed-precision shard at once converts every owned gradient to fp32 before the torch
optimizer runs: 4 bytes per owned element on top of the model states (8 with a foreach Adam's
sqrt, as on CUDA), which is what put Figure 2's 170B point over its 31 GB (32 less the CUDA reserve). In chunks, the step's
peak above its start is at most a chunk's worth, whatever the model size. Values are untouched:
the fp64 parity cases with tiny chunks are in test_parity.py's bucketing variants.
"""
from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import zero_impl
from experiments.launch import spawn
from experiments.models.tiny_gpt import TinyGPT, TinyGPTConfig, lm_loss

pytestmark = pytest.mark.numerical  # make test-matrix reruns these under every CPU setting

SHAPE = TinyGPTConfig(vocab_size=1000, seq_len=32, hidden=96, layers=4, heads=4)
CHUNK = 20_000  # elements of masters per update: several per rank (each rank owns ~250k)


def _live_tensors() -> list[torch.Tensor]:
    return [t for t in gc.get_objects() if torch.is_tensor(t)]


def _total(snapshot: dict) -> int:
    return sum(kinds["Total"] for kinds in snapshot.values())


def _step_peak(stage: int, optimizer_bucket_size: int | None, foreach: bool = False) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(SHAPE).to(torch.float16)
    # clipping on (its coefficient multiplies every chunk's gradients), loss scale 1: no step skipped
    config = zero_impl.ZeroConfig(stage=stage, precision="fp16", loss_scale=1.0, reduce_bucket_size=40_000,
                                  clip_grad_norm=0.01, optimizer_bucket_size=optimizer_bucket_size)
    engine = zero_impl.initialize(model, config,
                                  optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-3, foreach=foreach))
    tokens = torch.randint(0, SHAPE.vocab_size, (2, SHAPE.seq_len), generator=torch.Generator().manual_seed(1))
    peaks = []
    for _ in range(2):  # the first step also creates Adam's states: the second shows the temporaries alone
        engine.backward(lm_loss(engine(tokens).float(), tokens))
        tracker = MemTracker()
        tracker.track_external(*_live_tensors())  # what exists before the step is no allocation of it
        with warnings.catch_warnings(), tracker:
            warnings.simplefilter("ignore", UserWarning)  # MemTracker on a parameter-less view
            before = _total(tracker.get_tracker_snapshot())
            assert engine.step()
            peaks.append(_total(tracker.get_tracker_snapshot("peak")) - before)
    masters = [m.tensor.numel() for m in engine.sharded_optimizer.masters]
    return {"step_peak": peaks[1], "owned": sum(masters), "largest_master": max(masters),
            "chunks": len(engine.sharded_optimizer.chunks), "stats": engine.stats(),
            "params": engine.full_parameters()}


@pytest.mark.parametrize("stage,foreach", [(1, False), (2, False), (2, True)])
def test_step_temporaries_are_bounded_by_the_chunk(stage, foreach):
    whole = spawn(_step_peak, 2, stage, None, foreach, timeout=120)
    chunked = spawn(_step_peak, 2, stage, CHUNK, foreach, timeout=120)
    for w, c in zip(whole, chunked):
        assert w["chunks"] == 1 and c["chunks"] >= 5
        # one update of the whole shard holds the fp32 copy of every owned gradient at once, and
        # a foreach AdamW the square roots of all second moments besides (torch's pick on CUDA)
        assert w["step_peak"] >= (8 if foreach else 4) * w["owned"]
        # in chunks: one chunk's fp32 gradients (a chunk is at most CHUNK elements or one larger
        # master), and AdamW's denominator: foreach, one fp32 square root per element of the
        # chunk (divided and shifted in place); single-tensor (CPU's default), two fp32
        # temporaries of one master (exp_avg_sq.sqrt() / bias_correction2_sqrt: root and quotient)
        chunk = max(CHUNK, c["largest_master"])
        bound = 4 * chunk + (4 * chunk if foreach else 2 * 4 * c["largest_master"]) + 4096
        assert c["step_peak"] <= bound < w["step_peak"], (c["step_peak"], bound, w["step_peak"])
        buffers, limits = c["stats"]["buffers"], c["stats"]["buffer_limits"]
        assert 0 < buffers["optimizer_step"] <= limits["optimizer_step"] == 4 * max(CHUNK, c["largest_master"])
        assert w["stats"]["buffers"]["optimizer_step"] == w["stats"]["buffer_limits"]["optimizer_step"] == 4 * w["owned"]
        # and the same update, bit for bit
        assert all(torch.equal(w["params"][k], c["params"][k]) for k in w["params"])


def _placeholder_peak(stage: int, optimizer_bucket_size: int | None, foreach: bool) -> dict:
    """The transient peak of engine.state_dict() on an engine that has not stepped (it creates the
    optimizer states, as placeholders for dcp.load), above what it leaves allocated."""
    torch.manual_seed(0)
    config = zero_impl.ZeroConfig(stage=stage, precision="fp16", reduce_bucket_size=40_000,
                                  optimizer_bucket_size=optimizer_bucket_size)
    engine = zero_impl.initialize(TinyGPT(SHAPE).to(torch.float16), config,
                                  optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-3, foreach=foreach))
    tracker = MemTracker()
    tracker.track_external(*_live_tensors())
    with warnings.catch_warnings(), tracker:
        warnings.simplefilter("ignore", UserWarning)
        before = _total(tracker.get_tracker_snapshot())
        sd = engine.state_dict()
        after = _total(tracker.get_tracker_snapshot())
        peak = _total(tracker.get_tracker_snapshot("peak"))
    so = engine.sharded_optimizer
    masters = [m.tensor.numel() for m in so.masters]
    return {"transient": peak - after, "kept": after - before, "owned": sum(masters), "largest_master": max(masters),
            "states": sum(v.untyped_storage().nbytes() for s in so.optimizer.state.values() for v in s.values()),
            "placeholders": sum(len(sd[k].chunks) for k in sd if k.startswith("optim."))}


@pytest.mark.parametrize("stage,foreach", [(1, True), (2, False), (3, True)])
def test_placeholder_states_are_built_a_chunk_at_a_time(stage, foreach):
    """An unstepped engine's state_dict() creates Adam's states with a step at lr 0 over zero
    gradients (torch's _init_optim_state): over the same chunks as the real step, so a resume's
    peak is not the whole shard's temporaries above the training peak (Figure 2's 170B point:
    +3.4 GB at 8 bytes per owned element)."""
    whole = spawn(_placeholder_peak, 2, stage, None, foreach, timeout=120)
    chunked = spawn(_placeholder_peak, 2, stage, CHUNK, foreach, timeout=120)
    for w, c in zip(whole, chunked):
        # what stays is the same: Adam's two fp32 moments and step counts, views of them in the state dict
        assert c["kept"] == w["kept"] == c["states"] >= 8 * c["owned"] and c["placeholders"] == w["placeholders"] > 0
        # the step's temporaries: the fp32 zero gradients, and AdamW's as in the real step (see
        # test_step_temporaries_are_bounded_by_the_chunk): foreach, one fp32 temporary per element
        # of the chunk (the scaled gradient's copy, then the second moments' square roots);
        # single-tensor, two fp32 temporaries of one master
        assert w["transient"] >= (8 if foreach else 4) * w["owned"]
        chunk = max(CHUNK, c["largest_master"])
        bound = 4 * chunk + (4 * chunk if foreach else 2 * 4 * c["largest_master"]) + 4096
        assert c["transient"] <= bound < w["transient"], (c["transient"], bound, w["transient"])


class GroupStepSGD(torch.optim.SGD):
    """Element-wise, but counts steps per param group, as apex's and TE's FusedAdam do."""

    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
        return super().step(closure)


def _group_step_run(optimizer_bucket_size: int | None) -> dict:
    torch.manual_seed(0)
    engine = zero_impl.initialize(TinyGPT(SHAPE), zero_impl.ZeroConfig(stage=1, reduce_bucket_size=40_000,
                                                                        optimizer_bucket_size=optimizer_bucket_size),
                                  optimizer=lambda groups: GroupStepSGD(groups, lr=0.1))
    tokens = torch.randint(0, SHAPE.vocab_size, (2, SHAPE.seq_len), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        engine.backward(lm_loss(engine(tokens), tokens))
        engine.step()
    return {"chunks": len(engine.sharded_optimizer.chunks), "group_steps": engine.optimizer.param_groups[0]["step"],
            "params": engine.full_parameters()}


def test_an_optimizer_outside_chunkable_steps_the_whole_shard_once():
    chunked, whole = spawn(_group_step_run, 2, CHUNK, timeout=120), spawn(_group_step_run, 2, None, timeout=120)
    for c, w in zip(chunked, whole):
        assert c["chunks"] == w["chunks"] == 1 and c["group_steps"] == w["group_steps"] == 2
        assert all(torch.equal(c["params"][k], w["params"][k]) for k in w["params"])


def test_optimizer_bucket_size_is_validated():
    assert zero_impl.ZeroConfig(optimizer_bucket_size=4e7).optimizer_bucket_size == 40_000_000
    for bad in (0, -1, 2.5, "big", True):
        with pytest.raises(ValueError, match="optimizer_bucket_size"):
            zero_impl.ZeroConfig(optimizer_bucket_size=bad)
