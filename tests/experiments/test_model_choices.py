"""The Llama / MPT model keys (model.ffn_hidden, kv_heads, bias, position, mlp, norm,
tie_embeddings): checked before anything runs, built by megatron-core, trained, simulated, planned,
and priced by the activation model as megatron's own layers keep their tensors. Their parameter
counts are checked against megatron-core's GPT in test_megatron_tp.py."""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments.analysis.activations import layer_activation_bytes, score_buffer_bytes, score_working_bytes
from experiments.launch import spawn
from experiments.models.gpt_shape import GPTShape, parameter_count, parameters_per_tp_rank
from experiments.points import ConfigError, _layer_shape, expand, load_model, predicted_memory_bytes, shape_of

REPO = Path(__file__).resolve().parents[2]
LLAMA_KEYS = ["model.ffn_hidden=96", "model.kv_heads=2", "model.bias=false", "model.position=rope",
              "model.mlp=swiglu", "model.norm=rmsnorm", "model.tie_embeddings=false"]


def _tiny_point(compose, *overrides):
    return expand(compose("experiment=fig4", "model=tiny_s", "stage=2", "gpus=2", "tp=1", "micro_batch=2", *overrides))[0]


# -- validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("override, message", [
    ("model.mlp=relu", r"model.mlp must be one of \['gelu', 'swiglu'\], got 'relu'"),
    ("model.position=alibi", r"model.position must be one of \['learned', 'rope'\], got 'alibi'"),
    ("model.norm=batchnorm", r"model.norm must be one of \['layernorm', 'rmsnorm'\], got 'batchnorm'"),
    ("model.kv_heads=3", r"model.kv_heads \(3\) must divide model.heads \(4\)"),
    ("model.kv_heads=0", r"model.kv_heads must be a positive integer or null, got 0"),
    ("model.ffn_hidden=-8", r"model.ffn_hidden must be a positive integer or null, got -8"),
])
def test_bad_model_values_are_one_line_errors(compose, override, message):
    with pytest.raises(ConfigError, match=message):
        _tiny_point(compose, override)


def test_tp_must_divide_the_kv_heads_and_the_mlp_width(compose):
    with pytest.raises(ConfigError, match=r"tensor-parallel size 2 must divide model.kv_heads \(1\)"):
        _tiny_point(compose, "model.kv_heads=1", "tp=2")
    with pytest.raises(ConfigError, match=r"tensor-parallel size 2 must divide model.ffn_hidden \(97\)"):
        _tiny_point(compose, "model.ffn_hidden=97", "tp=2")
    assert _tiny_point(compose, "model.kv_heads=2", "model.ffn_hidden=96", "tp=2").tp == 2


def test_a_bad_value_stops_train_py_with_one_line_and_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "experiments/train.py", "model=tiny_s", "model.mlp=geglu",
                          f"results_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].endswith("model.mlp must be one of ['gelu', 'swiglu'], got 'geglu'")
    assert not list(tmp_path.rglob("*.json"))


# -- defaults: today's GPT, today's ids ---------------------------------------------------------
def test_default_keys_keep_point_ids_and_the_shape(compose):
    point = _tiny_point(compose)
    assert {k: point.model[k] for k in ("ffn_hidden", "kv_heads", "bias", "position", "mlp", "norm",
                                          "tie_embeddings")} == \
        {"ffn_hidden": None, "kv_heads": None, "bias": True, "position": "learned", "mlp": "gelu", "norm": "layernorm",
         "tie_embeddings": True}
    # the id of before the keys existed: the hash without them at their defaults
    before = dict(point.as_dict(), model={k: v for k, v in point.model.items()
                                          if k in ("name", "layers", "hidden", "heads", "seq_len", "vocab_size",
                                                   "label", "source")})
    assert type(point)(**before).point_id == point.point_id
    assert type(point)(**before).shape == point.shape == GPTShape(2, 64, 4, 64, 1000)
    # the same shape said explicitly is the same point; another choice is another point, named for it
    assert _tiny_point(compose, "model.ffn_hidden=256", "model.kv_heads=4").shape.ffn == point.shape.ffn
    llama = _tiny_point(compose, *LLAMA_KEYS)
    assert llama.point_id != point.point_id and llama.model["name"].startswith("tiny_s@ffn_hidden96-kv_heads2")


def test_model_configs_of_the_development_set():
    llama = shape_of(load_model("llama3_8b"))
    assert parameter_count(llama) == 8_030_261_248      # Meta's count (test_megatron_tp.py)
    assert (llama.query_groups, llama.ffn, llama.seq_len, llama.tie_embeddings) == (8, 14336, 8192, False)
    # MPT: the development set's num_params at seq_len 2048 (results/external/llm_foundry_a100_fsdp.csv)
    # are GPT-2's count, biases included, of the unpadded vocabulary (Megatron pads 50368 to 50432)
    llm_foundry = {"mpt_125m": 125311488, "mpt_1b": 1315950592, "mpt_7b": 6658859008, "mpt_70b": 64862437376}
    for name, count in llm_foundry.items():
        shape = shape_of(load_model(name))
        assert (shape.bias, shape.position, shape.mlp, shape.norm, shape.tie_embeddings, shape.ffn, shape.seq_len) == \
            (True, "learned", "gelu", "layernorm", True, 4 * shape.hidden, 2048)
        # the benchmark's MPT keeps configuration_mpt.py's no_bias: False (the yamls do not set it)
        assert parameter_count(shape) - 64 * shape.hidden == count


# -- the activation model against what megatron's layer keeps ------------------------------------
def _saved_bytes(shape: GPTShape, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the distinct storages autograd saves in one forward of one megatron-core
    transformer layer (local spec, `dtype`, micro-batch 2), parameters and the mask left out."""
    from experiments.models.megatron_gpt import build_gpt, initialize_parallel
    initialize_parallel(1)
    model = build_gpt(shape, dtype=dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    mask = torch.ones(1, 1, shape.seq_len, shape.seq_len, dtype=torch.bool).triu(1)
    rope = model.rotary_pos_emb(shape.seq_len) if shape.position == "rope" else None
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() != mask.untyped_storage().data_ptr():
            saved[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.decoder.layers[0](torch.randn(shape.seq_len, 2, shape.hidden, dtype=dtype, requires_grad=True),
                                attention_mask=mask, rotary_pos_emb=rope)
    return sum(saved.values())


BASE = GPTShape(layers=1, hidden=64, heads=4, seq_len=32, vocab_size=256)


@pytest.mark.parametrize("choice", [{}, dict(mlp="swiglu"), dict(mlp="swiglu", ffn_hidden=96), dict(ffn_hidden=96),
                                    dict(kv_heads=2), dict(position="rope"), dict(position="rope", kv_heads=2),
                                    dict(norm="rmsnorm"), dict(bias=False),
                                    dict(ffn_hidden=96, kv_heads=2, bias=False, position="rope", mlp="swiglu",
                                         norm="rmsnorm", tie_embeddings=False)],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()) or "gpt2")
def test_layer_activations_are_what_megatrons_layer_keeps(choice):
    shape = dataclasses.replace(BASE, **choice)
    measured = spawn(_saved_bytes, 1, shape, timeout=120)[0]
    predicted = layer_activation_bytes(shape.seq_len, 2, shape.hidden, shape.heads, bytes_per_element=4,
                                       dropout=False, **_layer_shape(shape, "local"))
    # beyond the model: rotary embeddings' cos and sin of Q and K, 4 x s x head dim, per layer
    rope = 4 * shape.seq_len * (shape.hidden // shape.heads) * 4 if shape.position == "rope" else 0
    assert measured - rope == pytest.approx(predicted, rel=0.01), (measured, predicted)


# RMSNorm is left out: on the CPU torch's bf16 RMSNorm keeps fp32 copies of its input, which the
# model does not count (a CPU path; activations.py says so)
@pytest.mark.parametrize("choice", [{}, dict(ffn_hidden=96, kv_heads=2, bias=False, mlp="swiglu")],
                         ids=["gpt2", "gqa-swiglu"])
def test_at_16_bits_the_layer_also_keeps_its_fp32_softmax_output(choice):
    """bf16: megatron's softmax runs in fp32 and saves its fp32 output beside the bf16
    probabilities the context bmm saves, 4 + 2 bytes a score (kept_per_score), where the paper's
    fused fp16 kernel keeps 2. The seq 128 shape makes the s x s part most of the layer."""
    shape = dataclasses.replace(BASE, seq_len=128, **choice)
    measured = spawn(_saved_bytes, 1, shape, torch.bfloat16, timeout=120)[0]
    predicted = layer_activation_bytes(shape.seq_len, 2, shape.hidden, shape.heads, bytes_per_element=2,
                                       dropout=False, **_layer_shape(shape, "local"))
    scores = shape.heads * shape.seq_len ** 2 * 2
    assert measured == pytest.approx(predicted, rel=0.01), (measured, predicted)
    # without the fp32 output the model would be short by 4 bytes a score: more than 1%
    assert abs(measured - (predicted - 4 * scores)) > 0.05 * measured


def _score_peak(shape: GPTShape, dtype: torch.dtype) -> int:
    """The most bytes of score-sized storages ([.., s, s] of a·s²·b elements, and megatron's
    flat score buffer) alive at once in one forward and backward of one megatron-core layer
    (local spec, micro-batch 2), from a fresh process (the buffer not yet allocated)."""
    import weakref
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.weak import WeakIdKeyDictionary
    from experiments.models.megatron_gpt import build_gpt, initialize_parallel
    initialize_parallel(1)
    model = build_gpt(shape, dtype=dtype).to(dtype)  # the engine casts the norms to the training dtype
    s, numel = shape.seq_len, shape.heads * shape.seq_len ** 2 * 2
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
    rope = model.rotary_pos_emb(s) if shape.position == "rope" else None

    class Scores(TorchDispatchMode):
        live, peak, seen = 0, 0, WeakIdKeyDictionary()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                st = t.untyped_storage() if isinstance(t, torch.Tensor) else None
                if st is None or st in self.seen or t.numel() != numel or not (t.dim() == 1 or t.shape[-2:] == (s, s)):
                    continue
                self.seen[st] = True
                self.live += st.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(st, self._free, st.nbytes())
            return out

        def _free(self, nbytes):
            self.live -= nbytes

    counter = Scores()
    with counter:
        out, _ = model.decoder.layers[0](torch.randn(s, 2, shape.hidden, dtype=dtype, requires_grad=True),
                                         attention_mask=mask, rotary_pos_emb=rope)
        out.float().square().mean().backward()
    return counter.peak


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("choice", [{}, dict(ffn_hidden=96, kv_heads=2, bias=False, position="rope", mlp="swiglu",
                                             norm="rmsnorm", tie_embeddings=False)], ids=["gpt2", "llama"])
def test_attention_score_working_set_is_what_megatrons_layer_holds(choice, dtype):
    """The local attention's s x s tensors at their peak, the score buffer included: 14·a·s²·b
    bytes in bf16 (12 of the working set, at the probabilities' cast and again at the softmax's
    backward, + the 2-byte buffer), 20 in fp32 (16 at the in-place mask's backward + 4): the
    Korthikanti count keeps p·a·s²·b of them, the softmax output."""
    shape = dataclasses.replace(BASE, **choice)
    p = torch.empty(0, dtype=dtype).element_size()
    measured = spawn(_score_peak, 1, shape, dtype, timeout=120)[0]
    a_s2_b = shape.heads * shape.seq_len ** 2 * 2
    expected = score_working_bytes(shape.seq_len, 2, shape.heads, bytes_per_element=p) + \
        score_buffer_bytes(shape.seq_len, 2, shape.heads, bytes_per_element=p)
    assert measured == expected == a_s2_b * (14 if p == 2 else 20)


def test_default_activation_numbers_are_unchanged():
    """GPT-2's shape passes no shape arguments (bit-identical numbers); the same shape passed
    explicitly gives the same bytes."""
    assert _layer_shape(GPTShape(32, 4096, 32), "local") == {}
    explicit = layer_activation_bytes(1024, 4, 4096, 32, 2, kv_hidden=4096, ffn=16384)
    assert explicit == layer_activation_bytes(1024, 4, 4096, 32, 2) == 1024 * 4 * 4096 * (10 + 24 / 2) \
        + 32 * 1024 * 1024 * 4 * 7 / 2


def test_memory_model_prices_llama_states_and_units(compose):
    point = expand(compose("experiment=fig4", "model=llama3_8b", "stage=3", "gpus=8", "tp=2", "micro_batch=1",
                           "cluster=dgx_h100"))[0]
    memory = predicted_memory_bytes(point, "bf16")
    psi = parameters_per_tp_rank(point.shape, 2)
    # bf16: parameters 2 B, gradients 4 B (reduce dtype fp32), Adam 12 B, all over DP 4 at stage 3
    assert memory["terms"]["model_states"]["total"] == pytest.approx(18 * psi / 4)
    # stage 3 gathers the root (word embeddings and the untied output layer, V·h/t each) and two layers
    h, layer = 4096, (4096 * (4096 + 2 * 1024) + 4096 ** 2 + 3 * 4096 * 14336) / 2 + 2 * 4096
    root = 2 * 128256 * h / 2 + h
    assert memory["terms"]["buffers"]["gathered_units"] == pytest.approx((root + 2 * layer) * 2)


# -- real run, simulation, plan -----------------------------------------------------------------
def test_a_llama_like_tiny_model_trains_on_cpu(tmp_path):
    out = subprocess.run([sys.executable, "experiments/train.py", "model=tiny_s", "gpus=1", "stage=2", "train.steps=2",
                          "train.warmup_steps=0", "train.lr=3e-3", *LLAMA_KEYS, f"results_dir={tmp_path}"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    [record] = [json.loads(p.read_text()) for p in tmp_path.rglob("*.json")]
    shape = GPTShape(2, 64, 4, 64, 1000, ffn_hidden=96, kv_heads=2, bias=False, position="rope", mlp="swiglu",
                     norm="rmsnorm", tie_embeddings=False)
    assert record["status"] == "ok"
    # the engine's count of the model megatron built = the closed form
    assert record["params_per_gpu"] == record["params"] == parameter_count(shape) == 192_832
    assert record["model"]["mlp"] == "swiglu" and all(math.isfinite(x) for x in record["losses"])


def test_llama3_8b_simulates_and_plans(tmp_path):
    sim = subprocess.run([sys.executable, "experiments/train.py", "model=llama3_8b", "model.layers=2", "stage=3",
                          "gpus=8", "micro_batch=1", "simulate=true", "cluster=dgx_h100", f"results_dir={tmp_path}"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert sim.returncode == 0, sim.stderr
    [record] = [json.loads(p.read_text()) for p in tmp_path.rglob("simulated/*.json")]
    shape = dataclasses.replace(shape_of(load_model("llama3_8b")), layers=2)
    assert record["status"] == "ok" and record["params"] == parameter_count(shape)
    assert record["memory"]["predicted"]["params"] == pytest.approx(parameters_per_tp_rank(shape, 1) * 2 / 8)
    plan = subprocess.run([sys.executable, "experiments/plan.py", "model=llama3_8b", "cluster=dgx_h100", "gpus=8",
                           "confirm=1", "max_simulations=1", f"results_dir={tmp_path}"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert plan.returncode == 0, plan.stderr
    assert "**Plan: llama3_8b (8.03B parameters) on 8 GPUs of dgx_h100**" in plan.stdout
    assert "model=llama3_8b stage=" in plan.stdout   # its rows' commands start from the config


# -- layer specs --------------------------------------------------------------------------------
def test_rmsnorm_local_spec_names_torch_norms_and_leaves_megatrons_global_alone(monkeypatch):
    """megatron's local RMSNorm spec sets backends.LNImpl, which every later LayerNorm spec would
    take (where Apex imports, its FusedLayerNorm): restored; the final norm is the layers' own
    (megatron's default final norm is Apex's, which refuses RMSNorm)."""
    from megatron.core.models import backends
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from experiments.models.megatron_gpt import gpt_layer_spec
    sentinel = type("FusedLayerNormStandIn", (), {})
    monkeypatch.setattr(backends, "LNImpl", sentinel)
    spec = gpt_layer_spec("local", dataclasses.replace(BASE, layers=3, norm="rmsnorm"))
    assert backends.LNImpl is sentinel
    assert len(spec.layer_specs) == 3 and spec.layer_norm is WrappedTorchNorm
    assert spec.layer_specs[0].submodules.input_layernorm is WrappedTorchNorm
    assert gpt_layer_spec("local", BASE) == gpt_layer_spec("local")   # LayerNorm: megatron's spec, as before


def test_transformer_engine_spec_takes_the_choices_from_the_config(monkeypatch):
    """TE's modules read normalization, num_query_groups, gated_linear_unit and add_bias_linear
    from the TransformerConfig: the spec is TE's own for every shape."""
    import types
    from megatron.core.models.gpt import gpt_layer_specs
    from experiments.models.megatron_gpt import gpt_layer_spec, transformer_config
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    te_spec = object()
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", lambda *a, **k: te_spec)
    llama = dataclasses.replace(BASE, ffn_hidden=96, kv_heads=2, bias=False, position="rope", mlp="swiglu",
                                norm="rmsnorm", tie_embeddings=False)
    assert gpt_layer_spec("transformer_engine", llama) is te_spec
    config = transformer_config(llama, 1, False, torch.float32)
    assert (config.normalization, config.num_query_groups, config.ffn_hidden_size, config.gated_linear_unit,
            config.activation_func, config.add_bias_linear) == ("RMSNorm", 2, 96, True, torch.nn.functional.silu, False)
    default = transformer_config(BASE, 1, False, torch.float32)
    assert (default.normalization, default.num_query_groups, default.ffn_hidden_size, default.gated_linear_unit,
            default.add_bias_linear) == ("LayerNorm", 4, 256, False, True)


def test_a_plans_folder_names_the_choices_off_its_model_config():
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from experiments.points import CONF_DIR
    from experiments.schema import register
    from experiments.sweeps.plan import plan_name
    register()

    def name(*overrides):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = hydra_compose(config_name="plan", overrides=["model=gpt_7b", "cluster=dgx_h100", *overrides])
            return plan_name(cfg, "dgx_h100", "gpt_7b")
    assert name() == "gpt_7b-dgx_h100-g8"
    assert name("model.mlp=swiglu", "model.kv_heads=8") == "gpt_7b-l32-h4096-a32-s1024-kv_heads8-mlpswiglu-dgx_h100-g8"


def test_llama_and_mpt_recipes_count_no_dropout_and_te_keeps_no_scores(compose):
    s, b, h, a = 8192, 1, 4096, 32
    unfused = layer_activation_bytes(s, b, h, a, dropout=False)
    fused = layer_activation_bytes(s, b, h, a, dropout=False, fused_attention=True)
    # the local path's fp32 softmax output and 16-bit probabilities, (4 + p)·a·s²·b, for the lse
    assert unfused - fused == pytest.approx(a * s * s * b * (4 + 2) - 4 * a * s * b)
    llama = expand(compose("model=llama3_8b", "gpus=8", "micro_batch=1"))[0]
    gpt = expand(compose("model=gpt_7b", "gpus=8", "micro_batch=1"))[0]
    with_masks = predicted_memory_bytes(gpt, "fp16")["activations"]
    without = predicted_memory_bytes(gpt, "fp16", dropout=False)["activations"]
    assert with_masks > without                          # GPT-2's recipe keeps its dropout masks ...
    assert predicted_memory_bytes(llama, "fp16")["activations"] == predicted_memory_bytes(llama, "fp16", dropout=False)["activations"]
