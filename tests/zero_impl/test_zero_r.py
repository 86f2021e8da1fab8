"""ZeRO-R (paper Section 6; zero_impl/activations.py, engine.stats()["buffers"]): Pa, Pa+cpu, CB, MD.

On megatron-core's GPT at TP = 2 x DP = 2 with one activation checkpoint per layer (float64):
Pa, Pa+cpu and MD leave training bitwise what it is without them; Pa divides the bytes of saved
checkpoints per rank by MP (two censuses: the storages autograd is handed, and torch's
MemTracker's live storages after forward), Pa+cpu moves them from the device's accounting to
the host's, and Pa's all-gathers move s·b·h elements per layer and recomputation, under 1/10 of
the tensor-parallel traffic megatron moves itself; our Pa equals megatron's own
distribute_saved_activations in bytes kept, elements gathered and results. Every buffer stays
within its configured size. MD's mechanics in one process on a plain torch model with torch's
reentrant checkpoint: the checkpoints of a step live in the arena's storage.
"""
from __future__ import annotations

import csv
import functools
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import zero_impl
from experiments.launch import spawn
from experiments.models.megatron_gpt import build_gpt, initialize_parallel, lm_inputs
from experiments.models.gpt_shape import GPTShape
from experiments.models.tiny_gpt import synthetic_tokens
from zero_impl.config import ZERO_R_CONFIGS, zero_r_config

pytestmark = pytest.mark.numerical  # make test-matrix reruns these under every CPU setting

SHAPE = GPTShape(layers=3, hidden=16, heads=4, seq_len=8, vocab_size=256)
TP, WORLD, GLOBAL_BATCH, STEPS = 2, 4, 8, 3
MICRO = GLOBAL_BATCH // (WORLD // TP)
SBH = SHAPE.seq_len * MICRO * SHAPE.hidden   # elements of one checkpoint (a layer's input)
FP64 = 8
PAPER = Path(__file__).resolve().parents[2] / "results" / "paper" / "table3_zero_r_configs.csv"
NONE = {"partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False}


def _flags(name: str) -> dict:
    return {k: v for k, v in ZERO_R_CONFIGS[name].items() if k != "stage"}


def _loss(model, tokens: torch.Tensor, after_forward=None) -> torch.Tensor:
    from megatron.core import tensor_parallel
    inputs = lm_inputs(tokens)
    labels = inputs.pop("labels")
    logits = model(**inputs)
    if after_forward is not None:
        after_forward()
    logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class LiveStorages(TorchDispatchMode):
    """Census of live storages: every storage an op creates while active, and whether it is still
    alive (its bytes) when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if torch.is_tensor(t):
                storage = t.untyped_storage()
                known = self.storages.get(storage._cdata)
                if known is None or known[0].expired():  # a freed storage's address is reused
                    self.storages[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        return out

    @property
    def bytes(self) -> int:
        return sum(n for ref, n in self.storages.values() if not ref.expired())

    def settled_bytes(self, quiet_s: float = 0.3, deadline_s: float = 10.0) -> int:
        """bytes, once gloo's worker threads have dropped the tensors of finished collectives
        (a matmul output all-reduced in place lives a moment longer there: ProcessGroupGloo's
        worker resets its work after completing it): nothing allocates meanwhile, so the reading
        only falls; it is taken once it has not fallen for quiet_s (a loaded machine's worker
        may take longer than one short wait), or at deadline_s."""
        start = last_drop = time.monotonic()
        least = self.bytes
        while time.monotonic() - last_drop < quiet_s and time.monotonic() - start < deadline_s:
            time.sleep(0.01)
            if (now := self.bytes) < least:
                least, last_drop = now, time.monotonic()
        return least


def _train(stage: int, zero_r: dict, megatron_pa: bool = False, recompute: bool = True) -> dict:
    """STEPS steps of megatron's GPT in float64; the first forward under two censuses; the
    tensor-parallel traffic megatron itself moves during forward and backward, counted by
    wrapping torch.distributed (the engine's own collectives go through its ledger)."""
    warnings.filterwarnings("ignore")
    import megatron.core.tensor_parallel.utils as tp_utils
    dp_group, tp_group = initialize_parallel(TP)
    model = build_gpt(SHAPE, recompute=recompute).double()
    model.config.distribute_saved_activations = megatron_pa
    engine = zero_impl.initialize(model, zero_impl.ZeroConfig(stage=stage, precision="fp64", reduce_bucket_size=700,
                                                                allgather_bucket_size=600, **zero_r),
                                  optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-3),
                                  dp_group=dp_group, mp_group=tp_group)
    mp_traffic = {"elements": 0, "counting": False, "megatron_gathers": 0}
    all_reduce, gather = dist.all_reduce, tp_utils.dist_all_gather_func

    def counted_all_reduce(tensor, *args, group=None, **kwargs):
        if mp_traffic["counting"] and group is tp_group:
            mp_traffic["elements"] += 2 * tensor.numel()   # the ledger's convention: twice the size
        return all_reduce(tensor, *args, group=group, **kwargs)

    def counted_gather(output, input, group=None, async_op=False):  # megatron's Pa (distribute_saved_activations)
        mp_traffic["megatron_gathers"] += output.numel()
        return gather(output, input, group=group, async_op=async_op)

    dist.all_reduce, tp_utils.dist_all_gather_func = counted_all_reduce, counted_gather
    dp_rank = dist.get_rank(dp_group)
    saved: dict[int, int] = {}
    arena_hits: list[bool] = []
    out: dict = {"kept_after_forward": [], "activation_elements": []}
    try:
        for step in range(STEPS):
            tokens = synthetic_tokens(GLOBAL_BATCH, SHAPE.seq_len + 1, SHAPE.vocab_size, seed=step)
            tokens = tokens[dp_rank * MICRO:(dp_rank + 1) * MICRO]
            before = engine.stats()["comm"]["total"]["by_purpose"].get("activations", {"elements": 0})["elements"]
            mp_traffic["counting"] = step == 0
            if step == 0:
                def pack(t):  # census: every storage autograd is handed for backward
                    storage = t.untyped_storage()
                    saved[storage.data_ptr()] = storage.nbytes()
                    return t
                # live storages when the model's forward is done (before the loss's TP all-gather,
                # whose buffers gloo's worker threads release when they get to it)
                with LiveStorages() as live, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    loss = _loss(engine, tokens, lambda: out.update(live_after_forward=live.settled_bytes()))
                if engine.activations is not None and engine.activations.contiguous:
                    arena_hits = _in_arena(engine.activations)
            else:
                loss = _loss(engine, tokens)
            if engine.activations is not None:
                out["kept_after_forward"].append(dict(engine.activations.kept))
            engine.backward(loss)
            mp_traffic["counting"] = False
            engine.step()
            after = engine.stats()["comm"]["total"]["by_purpose"].get("activations", {"elements": 0})["elements"]
            out["activation_elements"].append(after - before)
    finally:
        dist.all_reduce, tp_utils.dist_all_gather_func = all_reduce, gather
    stats = engine.stats()
    out.update(params={k: v.clone() for k, v in engine.full_parameters().items()}, saved_bytes=sum(saved.values()),
               mp_elements=mp_traffic["elements"], megatron_gathers=mp_traffic["megatron_gathers"],
               arena_hits=arena_hits, stats=stats)
    return out


def _in_arena(activations) -> list[bool]:
    """For each checkpoint held now: whether its kept data lies in MD's arena (its storage)."""
    arena = next(a for a in activations.arenas.values() if a is not None)
    lo = arena.data.untyped_storage().data_ptr()
    parts = [ref().part for ref in activations.live.values() if ref() is not None]  # no checkpoint kept here
    return [p.untyped_storage().data_ptr() == lo and 0 <= p.data_ptr() - lo < arena.nbytes for p in parts]


@functools.cache
def run(stage: int, config: str | None = None, megatron_pa: bool = False) -> list[dict]:
    """Every rank's results for ZeRO-DP `stage` under Table 3's configuration `config` (None:
    no ZeRO-R switch; "Pa": partition_activations alone)."""
    zero_r = {} if config is None else dict(NONE, partition_activations=True) if config == "Pa" else _flags(config)
    return spawn(_train, WORLD, stage, zero_r, megatron_pa, timeout=180)


def _bitwise_equal(a: list[dict], b: list[dict]) -> bool:
    return all(torch.equal(x["params"][k], y["params"][k]) for x, y in zip(a, b) for k in x["params"])


# -- configuration ----------------------------------------------------------------------------
def test_table3_configurations_and_validation():
    rows = list(csv.DictReader(PAPER.open()))
    assert [r["config"] for r in rows] == list(ZERO_R_CONFIGS)
    for r in rows:  # our names for the paper's switches; CB holds everywhere, Pp nowhere
        stage = 2 if r["Pg"] == "on" else 1
        flags = {"partition_activations": r["Pa"] == "on", "cpu_checkpointing": r["Pa+cpu"] == "on",
                 "contiguous_memory_optimization": r["MD"] == "on"}
        assert r["CB"] == "on" and r["Pp"] == "off" and r["Pos"] == "on"
        assert ZERO_R_CONFIGS[r["config"]] == {"stage": stage, **flags}
        assert zero_impl.ZeroConfig(stage=stage, **flags).zero_r_config == r["config"]
    assert zero_r_config(2) is None and zero_r_config(3, True, False, True) is None
    with pytest.raises(ValueError, match="ZeroConfig.cpu_checkpointing .* needs partition_activations"):
        zero_impl.ZeroConfig(cpu_checkpointing=True)
    with pytest.raises(ValueError, match="ZeroConfig.number_checkpoints .* needs contiguous_memory_optimization"):
        zero_impl.ZeroConfig(number_checkpoints=4)
    with pytest.raises(ValueError, match="ZeroConfig.number_checkpoints must be an integer >= 1"):
        zero_impl.ZeroConfig(contiguous_memory_optimization=True, number_checkpoints=0)
    with pytest.raises(ValueError, match="ZeroConfig.partition_activations must be true or false"):
        zero_impl.ZeroConfig(partition_activations="yes")


# -- MD's mechanics and the errors, in one process ----------------------------------------------
class Blocks(nn.Module):
    """Layers of a ModuleList, each under torch's reentrant checkpoint when `recompute`."""

    def __init__(self, layers: int = 3, width: int = 12, recompute: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers))
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=True) if self.recompute else layer(x)
        return x.square().mean()


def _blocks_run(steps: int = 3, recompute: bool = True, **zero_r) -> tuple[dict, zero_impl.ZeroEngine, list]:
    model = Blocks(recompute=recompute).double()
    engine = zero_impl.initialize(model, zero_impl.ZeroConfig(precision="fp64", **zero_r),
                                  optimizer=lambda g: torch.optim.AdamW(g, lr=1e-2))
    inside = []
    for step in range(steps):
        x = torch.randn(5, 12, generator=torch.Generator().manual_seed(step), dtype=torch.float64, requires_grad=True)
        loss = engine(x)
        if engine.activations is not None:  # where each checkpoint of this step is kept
            arena = engine.activations.arenas["device"]
            lo, hi = arena.data.data_ptr(), arena.data.data_ptr() + arena.nbytes
            parts = [ref().part for ref in engine.activations.live.values() if ref() is not None]
            inside.append([(p.untyped_storage().data_ptr() == lo, lo <= p.data_ptr() < hi) for p in parts])
        engine.backward(loss)
        engine.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, engine, inside


def test_md_keeps_a_steps_checkpoints_in_its_arena():
    plain, _, _ = _blocks_run()
    params, engine, inside = _blocks_run(contiguous_memory_optimization=True)
    assert all(torch.equal(plain[k], params[k]) for k in plain)
    # every step: three checkpoints (the layers' inputs, 5 x 12 float64), all in the arena's storage
    assert [len(step) for step in inside] == [3, 3, 3]
    assert all(same and within for step in inside for same, within in step)
    stats = engine.stats()
    assert stats["buffers"]["md_arena_device"] == stats["buffer_limits"]["md_arena_device"] == 3 * 5 * 12 * FP64
    assert stats["activations"]["checkpoints"] == 9 and stats["activations"]["held_checkpoints"] == 0
    assert stats["activations"]["kept_bytes"] == {"device": 0, "host": 0}  # all released after backward
    with pytest.raises(RuntimeError, match=r"ZeroConfig.number_checkpoints \(2\) is too small"):
        _blocks_run(contiguous_memory_optimization=True, number_checkpoints=2)


def test_zero_r_needs_recomputation_and_pa_an_mp_group():
    with pytest.raises(ValueError, match="ZeroConfig.contiguous_memory_optimization acts on activation checkpoints"):
        _blocks_run(recompute=False, contiguous_memory_optimization=True)
    with pytest.raises(ValueError, match="ZeroConfig.partition_activations .* pass mp_group"):
        zero_impl.initialize(Blocks(), zero_impl.ZeroConfig(partition_activations=True),
                             optimizer=lambda g: torch.optim.AdamW(g))


def _pa_without_recompute() -> str:
    try:
        _train(2, dict(NONE, partition_activations=True), recompute=False)
    except ValueError as e:
        return str(e)
    return "no error"


def test_pa_without_recomputation_names_the_key():
    messages = spawn(_pa_without_recompute, WORLD, timeout=120)
    assert all(m.startswith("ZeroConfig.partition_activations acts on activation checkpoints") for m in messages)


# -- TP 2 x DP 2 on megatron's GPT ------------------------------------------------------------
@pytest.mark.parametrize("stage,configs", [(1, ("C1", "C2")), (2, ("Pa", "C3", "C4", "C5")), (3, ("Pa",))])
def test_zero_r_trains_bitwise_like_without(stage, configs):
    base = run(stage)
    for config in configs:
        assert _bitwise_equal(base, run(stage, config)), config
        assert run(stage, config)[0]["stats"]["zero_r_config"] == (None if config == "Pa" else config)
    assert base[0]["stats"]["zero_r_config"] is None


def test_pa_divides_saved_checkpoints_by_mp():
    layers, checkpoint = SHAPE.layers, SBH * FP64
    base, pa, c5, c3 = run(2), run(2, "Pa"), run(2, "C5"), run(2, "C3")
    for b, p, c, md in zip(base, pa, c5, c3):
        # census 1: storages autograd is handed for backward; census 2: live storages after forward
        # (on the CPU, Pa+cpu's host slices are live storages too; MD's arena replaces the checkpoints)
        assert b["saved_bytes"] - p["saved_bytes"] == layers * checkpoint * (TP - 1) // TP
        assert b["live_after_forward"] - p["live_after_forward"] == layers * checkpoint * (TP - 1) // TP
        assert c["live_after_forward"] == p["live_after_forward"] and md["live_after_forward"] == b["live_after_forward"]
        # the engine's accounting: Pa keeps L slices on the device; Pa+cpu on the host, none on the device
        assert p["kept_after_forward"] == [{"device": layers * checkpoint // TP, "host": 0}] * STEPS
        assert c["kept_after_forward"] == [{"device": 0, "host": layers * checkpoint // TP}] * STEPS
        assert c["stats"]["activations"]["peak_kept_bytes"]["device"] == 0
        # every host slice was back on the device before its layer's recomputation needed it
        acts = c["stats"]["activations"]
        assert acts["prefetched"] == acts["checkpoints"] == layers * STEPS and acts["on_demand"] == 0
        assert p["stats"]["activations"]["held_checkpoints"] == 0  # all released after backward


def test_pa_traffic_is_sbh_per_layer_under_a_tenth_of_mp():
    base, pa = run(2), run(2, "Pa")
    for b, p in zip(base, pa):
        # one all-gather of a checkpoint (s·b·h elements, output convention) per layer and recomputation
        assert p["activation_elements"] == [SHAPE.layers * SBH] * STEPS
        by_kind = p["stats"]["comm"]["last_step"]["by_purpose"]["activations"]
        assert by_kind == {"calls": SHAPE.layers, "elements": SHAPE.layers * SBH,
                           "bytes": SHAPE.layers * SBH * FP64}
        assert b["activation_elements"] == [0] * STEPS
        # megatron's own TP traffic: per layer 2 all-reduces forward, 2 recomputing, 2 backward (12 sbh)
        assert b["mp_elements"] == p["mp_elements"] >= 12 * SHAPE.layers * SBH
        assert p["activation_elements"][0] / p["mp_elements"] < 0.1


def test_pa_equals_megatrons_distribute_saved_activations():
    """megatron-core's own Pa (TransformerConfig.distribute_saved_activations) keeps and gathers
    exactly what ours does and trains alike; its gathers bypass the engine's ledger."""
    ours, megatron = run(2, "Pa"), run(2, None, True)
    assert _bitwise_equal(ours, megatron)
    for o, m in zip(ours, megatron):
        assert o["saved_bytes"] == m["saved_bytes"]
        assert m["megatron_gathers"] == STEPS * SHAPE.layers * SBH and o["megatron_gathers"] == 0
        assert m["activation_elements"] == [0] * STEPS   # invisible to engine.stats()


@pytest.mark.parametrize("stage,config", [(1, "C2"), (2, "C4"), (2, "C5")])
def test_buffers_stay_within_their_configured_sizes(stage, config):
    for r in run(stage, config):
        buffers, limits = r["stats"]["buffers"], r["stats"]["buffer_limits"]
        assert buffers.keys() == limits.keys()
        assert all(0 <= buffers[k] <= limits[k] for k in buffers), (buffers, limits)
        assert buffers["pa_gather"] == SBH * FP64            # one gathered checkpoint, reused by every layer
        assert buffers["norm"] == 2 * FP64
        # allgather_bucket_size=600 bounds the gathers in flight; a larger bucket goes alone (limits)
        assert buffers["allgather"] > 0 and (stage == 1 or buffers["grad_staging"] > 0)
        arena = "md_arena_host" if config == "C5" else "md_arena_device"
        assert buffers[arena] == SHAPE.layers * SBH * FP64 // TP
    assert run(stage, config)[0]["arena_hits"] == [True] * SHAPE.layers  # the step's checkpoints in the arena
