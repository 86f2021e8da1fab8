"""Megatron's initialization by parameter role, identical for eager and meta-device builds.

Every parameter is drawn from (seed, its qualified name) with megatron's init method for its
role, whole (TP=1 shape) on every TP rank, which keeps its slice (experiments/models/megatron_gpt.py).
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from megatron.core import parallel_state

import zero_impl
from helpers import gather_tp
from experiments.launch import spawn
from experiments.models.megatron_gpt import INIT_STD, ParamRole, transformer_config, build_gpt, init_parameter, initialize_parallel, megatron_param_init_fn, param_role
from experiments.models.gpt_shape import GPTShape

pytestmark = pytest.mark.numerical  # make test-matrix reruns these under every CPU setting

SHAPE = GPTShape(layers=2, hidden=16, heads=4, seq_len=8, vocab_size=256)  # vocab: one padding for TP <= 2
SEED = 7


def _eager_and_meta(tp: int, persistence_threshold: int) -> dict:
    """The eager build, and the meta build materialized unit by unit by stage 3, both gathered
    over TP; the global RNG is left in different states before each, which must not matter."""
    dp_group, tp_group = initialize_parallel(tp)
    torch.manual_seed(123)
    eager = build_gpt(SHAPE, seed=SEED)
    local = {n: p.detach().clone() for n, p in eager.named_parameters()}
    torch.manual_seed(456)
    torch.rand(1000)
    with torch.device("meta"):
        meta = build_gpt(SHAPE, seed=SEED)
    assert all(p.is_meta for p in meta.parameters())
    engine = zero_impl.initialize(
        meta, zero_impl.ZeroConfig(stage=3, stage3_param_persistence_threshold=persistence_threshold),
        optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-3), dp_group=dp_group, mp_group=tp_group,
        param_init_fn=megatron_param_init_fn(meta, SEED))
    return {"eager": gather_tp(eager, local, tp_group), "meta": gather_tp(meta, engine.full_parameters(), tp_group),
            "local": local, "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "sharded": {n for n, p in eager.named_parameters() if getattr(p, "tensor_model_parallel", False)}}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.fixture(scope="module")
def tp1():
    return spawn(_eager_and_meta, 1, 1, 0, timeout=120)[0]


# world 2 / TP 2: DP 1; world 4 / TP 2: DP 2 (stage 3 shards over DP); persistence threshold 16:
# biases and LayerNorms form the persistent unit, so a module's parameters fall in two units.
@pytest.mark.parametrize("world,tp,threshold", [(1, 1, 16), (2, 2, 0), (4, 2, 16)])
def test_meta_build_through_stage3_equals_eager_build(world, tp, threshold, tp1):
    results = spawn(_eager_and_meta, world, tp, threshold, timeout=180)
    for r in results:
        assert _equal(r["meta"], r["eager"])     # bitwise, gathered over TP
        assert _equal(r["eager"], tp1["eager"])  # any TP degree starts from the TP=1 model
    if tp == 2:
        first, second = results[0], results[1]
        assert (first["tp_rank"], second["tp_rank"]) == (0, 1)
        for name in first["local"]:
            same = torch.equal(first["local"][name], second["local"][name])
            if name not in first["sharded"]:
                assert same, name                # duplicated parameters: one value on every TP rank
            elif name.endswith("weight"):
                assert not same, name            # the TP slices of a drawn weight differ
        qkv = tp1["eager"]["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert not torch.equal(qkv[: qkv.shape[0] // 2], qkv[qkv.shape[0] // 2:])


def _train_build(tp: int) -> bool:
    """run/build.py's build_model: stage 3 above META_BUILD_PARAMS (lowered to 0 here) builds on the meta
    device and hands stage 3 its param_init_fn; the result equals its eager build."""
    from experiments.run import build
    dp_group, tp_group = initialize_parallel(tp)
    build.META_BUILD_PARAMS = 0
    point = SimpleNamespace(stage=3, shape=SHAPE, tp=tp, train={"recompute": False, "seed": SEED, "layer_spec": "local"})
    meta, init_fn = build.build_model(point, torch.device("cpu"))
    assert init_fn is not None and all(p.is_meta for p in meta.parameters())
    engine = zero_impl.initialize(meta, zero_impl.ZeroConfig(stage=3), optimizer=lambda g: torch.optim.AdamW(g),
                                  dp_group=dp_group, mp_group=tp_group, param_init_fn=init_fn)
    point.stage = 2
    eager, none = build.build_model(point, torch.device("cpu"))
    assert none is None
    return _equal(gather_tp(meta, engine.full_parameters(), tp_group),
                  gather_tp(eager, {n: p.detach() for n, p in eager.named_parameters()}, tp_group))


def test_train_meta_build_equals_its_eager_build():
    assert all(spawn(_train_build, 2, 2, timeout=180))


def _statistics() -> dict:
    initialize_parallel(1)
    model = build_gpt(GPTShape(layers=4, hidden=128, heads=4, seq_len=64, vocab_size=256), seed=SEED)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_init_statistics_by_role():
    """Weights ~ N(0, 0.02), the row-parallel outputs (linear_proj, linear_fc2) ~
    N(0, 0.02/sqrt(2·layers)), biases 0, LayerNorms weight 1 bias 0 (megatron-core 0.16's
    init_method, output_layer_init_method, embedding_init_method)."""
    params = spawn(_statistics, 1, timeout=120)[0]
    layers, drawn = 4, 0
    for name, t in params.items():
        if name.endswith("bias"):
            assert torch.equal(t, torch.zeros_like(t)), name
        elif "layernorm" in name:
            assert torch.equal(t, torch.ones_like(t)), name
        else:
            output = name.endswith(("linear_proj.weight", "linear_fc2.weight"))
            expected = INIT_STD / math.sqrt(2 * layers) if output else INIT_STD
            assert t.std().item() == pytest.approx(expected, rel=0.05), name  # >= 8192 draws: ~1% error
            assert abs(t.mean().item()) < expected / 10, name
            drawn += 1
    assert drawn == 2 + 4 * layers  # 2 embeddings; QKV, projection, FC1, FC2 per layer


# The Transformer Engine spec's names (its LayerNorms fused into the next linear layer) and the
# local spec's parameter of the same role.
TE_TO_LOCAL = {
    "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": "decoder.layers.0.input_layernorm.weight",
    "decoder.layers.0.self_attention.linear_qkv.layer_norm_bias": "decoder.layers.0.input_layernorm.bias",
    "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": "decoder.layers.0.pre_mlp_layernorm.weight",
    "decoder.layers.0.mlp.linear_fc1.layer_norm_bias": "decoder.layers.0.pre_mlp_layernorm.bias",
    "decoder.layers.0.self_attention.linear_qkv.weight": "decoder.layers.0.self_attention.linear_qkv.weight",
    "decoder.layers.0.self_attention.linear_qkv.bias": "decoder.layers.0.self_attention.linear_qkv.bias",
    "decoder.layers.0.self_attention.linear_proj.weight": "decoder.layers.0.self_attention.linear_proj.weight",
    "decoder.layers.0.mlp.linear_fc1.weight": "decoder.layers.0.mlp.linear_fc1.weight",
    "decoder.layers.0.mlp.linear_fc2.weight": "decoder.layers.0.mlp.linear_fc2.weight",
    "decoder.layers.0.mlp.linear_fc2.bias": "decoder.layers.0.mlp.linear_fc2.bias",
}

EXPECTED_ROLES = {
    "embedding.word_embeddings.weight": ParamRole("normal", "embedding_init_method", 0),
    "embedding.position_embeddings.weight": ParamRole("normal", "embedding_init_method", None),
    "decoder.layers.0.input_layernorm.weight": ParamRole("ones"),
    "decoder.layers.0.input_layernorm.bias": ParamRole("zeros"),
    "decoder.layers.0.self_attention.linear_qkv.weight": ParamRole("normal", "init_method", 0),
    "decoder.layers.0.self_attention.linear_qkv.bias": ParamRole("zeros", None, 0),
    "decoder.layers.0.self_attention.linear_proj.weight": ParamRole("normal", "output_layer_init_method", 1),
    "decoder.layers.0.self_attention.linear_proj.bias": ParamRole("zeros"),
    "decoder.layers.0.mlp.linear_fc1.weight": ParamRole("normal", "init_method", 0),
    "decoder.layers.0.mlp.linear_fc2.weight": ParamRole("normal", "output_layer_init_method", 1),
    "decoder.final_layernorm.weight": ParamRole("ones"),
    "decoder.final_layernorm.bias": ParamRole("zeros"),
}


def test_roles_of_local_spec_parameters():
    for name, role in EXPECTED_ROLES.items():
        assert param_role(name) == role, name
    with pytest.raises(KeyError, match="no initialization role"):
        param_role("decoder.layers.0.self_attention.some_new_thing.weight")


def test_transformer_engine_names_get_the_local_specs_init():
    """The TE spec's fused LayerNorm (`linear_qkv.layer_norm_weight`) is a norm (1, not the 1.0
    fill of every weight of a class whose name contains "norm"), its QKV/FC1 weight a
    column-parallel N(0, 0.02) weight; applied to tensors, both specs' names give the same values."""
    config = transformer_config(GPTShape(layers=4, hidden=64, heads=4), 1, False, torch.float32)
    for te, local in TE_TO_LOCAL.items():
        assert param_role(te) == param_role(local), te
        shape = (64,) if te.rsplit(".", 1)[-1] in ("layer_norm_weight", "layer_norm_bias", "bias") else (64, 64)
        a, b = torch.full(shape, 5.0), torch.full(shape, 5.0)
        init_parameter(a, te, config, SEED, tp_rank=0, tp_size=1)
        init_parameter(b, local, config, SEED, tp_rank=0, tp_size=1)
        if param_role(te).fill == "normal":
            assert te == local and torch.equal(a, b)  # same name in both specs: same draw
            expected = INIT_STD / math.sqrt(8) if te.endswith(("linear_proj.weight", "linear_fc2.weight")) else INIT_STD
            assert a.std().item() == pytest.approx(expected, rel=0.1), te
        else:
            assert torch.equal(a, b), te
            assert torch.equal(a, torch.ones(shape) if param_role(te).fill == "ones" else torch.zeros(shape)), te
