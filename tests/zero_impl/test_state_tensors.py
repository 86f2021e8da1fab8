"""ZeroEngine.state_tensors() names every tensor the engine keeps: after initialize, after a
forward and after each step, each live storage that zero_impl's own code allocated is under one
of its kinds, for stages 0-3 and for ZeRO-R (Pa, Pa+cpu, MD). A storage the engine allocates
and keeps without saying so, the kind the suite's storage tracker would miss, fails the test.
"""
from __future__ import annotations

import sys
import time
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import zero_impl
from experiments.launch import spawn
from experiments.models.megatron_gpt import build_gpt, initialize_parallel, lm_inputs
from experiments.models.gpt_shape import GPTShape
from experiments.models.tiny_gpt import lm_loss, synthetic_tokens
from helpers import adamw, global_batch, make_model, param_groups

ZERO_IMPL = str(Path(zero_impl.__file__).resolve().parent) + "/"
TORCH = str(Path(torch.__file__).resolve().parent) + "/"


class EngineAllocations(TorchDispatchMode):
    """Every storage an op creates while zero_impl's code is its innermost caller outside torch
    (torch's optimizers and autograd run on the engine's behalf), held weakly."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[weakref.ref, str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename.startswith(TORCH) or frame.f_code.co_filename == __file__):
            frame = frame.f_back
        if frame is not None and frame.f_code.co_filename.startswith(ZERO_IMPL):
            where = f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name} ({func})"
            for t in torch.utils._pytree.tree_leaves(out):
                if torch.is_tensor(t):
                    storage = t.untyped_storage()
                    known = self.storages.get(storage._cdata)
                    if known is None or known[0]() is None:  # a freed storage's address is reused
                        self.storages[storage._cdata] = (weakref.ref(storage), where)
        return out

    def unaccounted(self, engine: zero_impl.ZeroEngine, settle_s: float = 10.0) -> list[str]:
        """Where each live storage (with bytes) the engine allocated and state_tensors() omits came
        from, once it has stayed live for settle_s. A synchronous gloo collective returns when its
        work completes, but the backend's worker thread drops its reference to the work (and the
        tensors in it) only after that (ProcessGroupGloo::runLoop resets workInProgress_ after
        execute): on a loaded machine the norm's all-reduce buffer can outlive engine.step() by a
        moment. A storage the engine keeps is still live after any wait."""
        held = {t.untyped_storage()._cdata for tensors in engine.state_tensors().values() for t in tensors}
        deadline = time.monotonic() + settle_s
        while True:
            live = sorted(where for key, (ref, where) in self.storages.items()
                          if ref() is not None and key not in held and ref().nbytes())
            if not live or time.monotonic() > deadline:
                return live
            time.sleep(0.01)


def assert_kinds_disjoint(engine: zero_impl.ZeroEngine) -> None:
    state = engine.state_tensors()
    assert tuple(state) == zero_impl.STATE_KINDS
    kind_of: dict[int, str] = {}
    for kind, tensors in state.items():
        for t in tensors:
            assert kind_of.setdefault(t.untyped_storage()._cdata, kind) == kind, "a storage under two kinds"


def _stages(precision: str) -> dict:
    out = {}
    for stage in (0, 1, 2, 3):
        model = make_model()
        census = EngineAllocations()
        with census:
            engine = zero_impl.initialize(model, zero_impl.ZeroConfig(stage=stage, precision=precision,
                                                                      reduce_bucket_size=500, grad_accum_steps=2),
                                          optimizer=adamw, param_groups=param_groups(model))
            missing = {"initialize": census.unaccounted(engine)}
            for step in range(2):
                batch = global_batch(step, dist.get_world_size(), 2)
                for k in range(2):
                    tokens = batch[k, dist.get_rank()]
                    engine.backward(lm_loss(engine(tokens), tokens))
                    engine.step()
                missing[f"step {step + 1}"] = census.unaccounted(engine)
        assert_kinds_disjoint(engine)
        memory, state = engine.memory(), engine.state_tensors()
        out[stage] = {"missing": missing, "states": len(state["optimizer_states"]), "grads": memory["grads"],
                      "grad_storages": sum(t.untyped_storage().nbytes() for t in state["grads"])}
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_every_kept_allocation_of_stages_0_to_3_has_a_kind(precision):
    """Two ranks, two accumulated micro-batches per step, buckets small enough for several:
    nothing the engine keeps after initialize or a step is missing from state_tensors()."""
    for stage, r in spawn(_stages, 2, precision, timeout=180)[0].items():
        assert all(not where for where in r["missing"].values()), (stage, r["missing"])
        assert r["states"] > 0 and r["grads"] == r["grad_storages"] > 0, (stage, r)


SHAPE = GPTShape(layers=3, hidden=16, heads=4, seq_len=8, vocab_size=256)
ZERO_R = {"Pa": {"partition_activations": True},
          "Pa+cpu": {"partition_activations": True, "cpu_checkpointing": True},
          "Pa+MD": {"partition_activations": True, "contiguous_memory_optimization": True},
          "Pa+cpu+MD": {"partition_activations": True, "cpu_checkpointing": True,
                        "contiguous_memory_optimization": True}}


def _zero_r() -> dict:
    from megatron.core import tensor_parallel
    warnings.filterwarnings("ignore")
    dp_group, tp_group = initialize_parallel(2)
    out = {}
    for name, switches in ZERO_R.items():
        model = build_gpt(SHAPE, recompute=True).double()
        census = EngineAllocations()
        with census:
            engine = zero_impl.initialize(model, zero_impl.ZeroConfig(stage=2, precision="fp64", **switches),
                                          optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-3),
                                          dp_group=dp_group, mp_group=tp_group)
            missing, kept = {"initialize": census.unaccounted(engine)}, {}
            for step in range(2):
                inputs = lm_inputs(synthetic_tokens(2, SHAPE.seq_len + 1, SHAPE.vocab_size, seed=step))
                labels = inputs.pop("labels")
                logits = engine(**inputs)
                missing[f"forward {step + 1}"] = census.unaccounted(engine)
                kept[step] = {k: len(v) for k, v in engine.state_tensors().items()}
                logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
                engine.backward(loss)
                engine.step()
                missing[f"step {step + 1}"] = census.unaccounted(engine)
        assert_kinds_disjoint(engine)
        step_scalars = len(engine.sharded_optimizer.state_tensors()["buffers"])  # the norm...: not ZeRO-R's
        out[name] = {"missing": missing, "kept": kept, "buffers": len(engine.state_tensors()["buffers"]) - step_scalars}
    return out


def test_every_kept_allocation_of_zero_r_has_a_kind():
    """megatron's GPT at TP 2 with a reentrant checkpoint per layer: after forward, the kept
    slices (on the device, in host memory with Pa+cpu, in MD's arena) are checkpoints; after
    the step, the gather and prefetch pools are buffers; nothing is missing anywhere."""
    for name, r in spawn(_zero_r, 2, timeout=300)[0].items():
        assert all(not where for where in r["missing"].values()), (name, r["missing"])
        kept = r["kept"][1]
        host = "cpu" in name
        assert (kept["host_checkpoints"] > 0) == host and (kept["checkpoints"] > 0) == (not host), (name, kept)
        assert r["buffers"] == (2 if host else 1), (name, r)  # one gather buffer, one prefetch buffer with cpu
