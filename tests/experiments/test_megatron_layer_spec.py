"""The model's layer spec is a config choice (train.layer_spec, `local` by default, never
switched by what is importable), and megatron's fp16/bf16 flags follow the training dtype."""
from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from megatron.core.models.gpt import gpt_layer_specs

from experiments.launch import spawn
from experiments.models.megatron_gpt import transformer_config, build_gpt, gpt_layer_spec, initialize_parallel
from experiments.models.gpt_shape import GPTShape
from experiments.points import ConfigError, expand

SHAPE = GPTShape(layers=1, hidden=16, heads=4, seq_len=8, vocab_size=256)


def test_local_spec_even_where_transformer_engine_imports(monkeypatch):
    # what an NGC image looks like to the old code: CUDA and an importable transformer_engine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    te_spec = object()
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", lambda *a, **k: te_spec)
    assert gpt_layer_spec() == gpt_layer_specs.get_gpt_layer_local_spec()
    assert gpt_layer_spec("local") is not te_spec
    assert gpt_layer_spec("transformer_engine") is te_spec  # asked for by name


def test_transformer_engine_spec_without_transformer_engine_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import fails
    with pytest.raises(ValueError, match="transformer_engine: Transformer Engine does not import"):
        gpt_layer_spec("transformer_engine")
    with pytest.raises(ValueError, match=r"layer_spec must be one of \['local', 'transformer_engine'\], got 'te'"):
        gpt_layer_spec("te")


def test_layer_spec_config_is_checked_before_anything_runs(compose, monkeypatch):
    with pytest.raises(ConfigError, match=r"train.layer_spec must be one of \['local', 'transformer_engine'\], got 'te'"):
        expand(compose("experiment=fig4", "train.layer_spec=te"))
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError, match="train.layer_spec=transformer_engine needs Transformer Engine"):
        expand(compose("experiment=fig4", "train.layer_spec=transformer_engine"))


def test_default_layer_spec_keeps_point_ids_and_is_in_the_config(compose):
    [local] = expand(compose("model=tiny_s", "stage=2", "gpus=2", "tp=1", "micro_batch=2", "experiment=fig4"))[:1]
    assert local.train["layer_spec"] == "local"  # recorded: a record's config is point.as_dict()
    te = dict(local.as_dict(), train={**local.train, "layer_spec": "transformer_engine"})
    assert type(local)(**te).point_id != local.point_id
    # the id is the one of before layer_spec existed: the hash without the key at its default
    before = dict(local.as_dict(), train={k: v for k, v in local.train.items() if k != "layer_spec"})
    assert type(local)(**before).point_id == local.point_id


@pytest.mark.parametrize("dtype, fp16, bf16", [(torch.float32, False, False), (torch.float16, True, False),
                                               (torch.bfloat16, False, True)])
def test_megatron_precision_flags_follow_the_dtype(dtype, fp16, bf16):
    config = transformer_config(SHAPE, 1, False, dtype)
    assert (config.fp16, config.bf16, config.attention_softmax_in_fp32, config.params_dtype) == (fp16, bf16, True, dtype)


class SoftmaxInputs(TorchFunctionMode):
    """The dtypes softmax is computed in."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[torch.dtype] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (F.softmax, torch.softmax, torch.Tensor.softmax):
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def _built_softmax(dtype: torch.dtype) -> dict:
    initialize_parallel(1)
    model = build_gpt(SHAPE, dtype=dtype)
    softmax = model.decoder.layers[0].self_attention.core_attention.scale_mask_softmax
    with SoftmaxInputs() as seen:
        out = softmax(torch.randn(1, 4, 8, 8).to(dtype), torch.ones(1, 1, 8, 8, dtype=torch.bool).triu(1))
    return {"flags": (softmax.input_in_fp16, softmax.input_in_bf16), "computed_in": seen.dtypes, "out": out.dtype,
            "te_modules": sorted({type(m).__module__ for m in model.modules() if "transformer_engine" in type(m).__module__})}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_softmax_upcasts_the_scores(dtype):
    built = spawn(_built_softmax, 1, dtype, timeout=120)[0]
    assert built["flags"] == (dtype == torch.float16, dtype == torch.bfloat16)
    assert built["computed_in"] == [torch.float32] and built["out"] == dtype  # upcast, then back to the dtype
    assert built["te_modules"] == []
