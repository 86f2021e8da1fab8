"""The benchmark model: megatron-core's GPT with Megatron tensor parallelism (the one module here
that imports megatron-core).

    dp_group, tp_group = initialize_parallel(tp=2)          # after torch.distributed is up
    model = build_gpt(GPTShape(layers=24, hidden=1024, heads=16), recompute=True)
    engine = zero_impl.initialize(model, config, optimizer, dp_group=dp_group, mp_group=tp_group)
    loss = gpt_loss(engine, tokens)                         # tokens: [batch, seq_len + 1]

World = TP x DP: megatron-core's parallel_state lays out tensor-parallel groups of consecutive
ranks; ZeRO shards over its data-parallel group, and the engine's global norm counts parameters
duplicated across TP ranks (LayerNorms, position embeddings, biases of row-parallel layers)
once.

Initialization (one design for eager and meta-device builds): every parameter is drawn by
megatron's own init method for its role, from a generator seeded by (seed, its qualified name),
as megatron's CPU initialization draws it: the full TP=1-shaped weight on every TP rank, which
keeps its slice (`_initialize_affine_weight_cpu`), here in chunks of rows on the parameter's own
device (`init_parameter`). Roles (`param_role`, by attribute name, for
the local and the Transformer Engine layer specs alike):

    word / position embeddings          config.embedding_init_method   (N(0, 0.02))
    linear_qkv, linear_fc1 weights      config.init_method             (N(0, 0.02)), column-parallel
    linear_proj, linear_fc2 weights     config.output_layer_init_method (N(0, 0.02/sqrt(2·layers))), row-parallel
    biases (also TE's layer_norm_bias)  0
    LayerNorm weights (also TE's        1 (0 with config.layernorm_zero_centered_gamma)
      layer_norm_weight)

So a parameter's value depends only on the seed, its name and the model's shape: not on the
order parameters are built in, nor on the TP degree (the TP shards gathered equal the TP=1
weight and differ from each other), nor on eager vs meta construction. `build_gpt` builds
eagerly with megatron's own draw switched off and then draws every parameter by name
(`init_megatron_params`); a model built under `torch.device("meta")` is materialized module by
module by stage 3 with `megatron_param_init_fn(model, seed)`, which draws the same values.
Megatron's model-parallel RNG tracker (per-TP-rank streams) is left to dropout inside TP regions.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

with warnings.catch_warnings():  # megatron-core announces every optional CUDA kernel it falls back from
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

from .gpt_shape import LAYER_SPECS, GPTShape, padded_vocab_size
from .megatron_cpu import apply_cpu_workarounds

INIT_STD = 0.02
INIT_SEED = 1234            # the default seed of the weights (initialize_parallel's default too)


def initialize_parallel(tp: int, seed: int = 1234, timeout_s: float = 1800.0) -> tuple[dist.ProcessGroup,
                                                                                     dist.ProcessGroup]:
    """Set up megatron-core's TP x DP groups on the running world; returns (dp_group, tp_group).
    timeout_s: how long a collective of these groups may wait before NCCL's watchdog aborts it
    (megatron's default is 30 minutes; a point passes its train.timeout_s, as the default group)."""
    world = dist.get_world_size()
    if world % tp:
        raise ValueError(f"world size {world} is not divisible by tensor-parallel size {tp}")
    apply_cpu_workarounds()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False,
                                             distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)))
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return parallel_state.get_data_parallel_group(), parallel_state.get_tensor_model_parallel_group()


def build_gpt(shape: GPTShape, *, recompute: bool = False, seed: int = INIT_SEED,
              dtype: torch.dtype = torch.float32, layer_spec: str = "local", dropout: float = 0.0) -> GPTModel:
    """megatron-core GPTModel of `shape` for the current TP degree, no dropout (`dropout`: its
    hidden and attention dropout, as Megatron trains by default at 0.1; for counting what it issues).

    dtype: megatron's params_dtype, the dtype its linear layers and embeddings are built in;
    build in the training dtype so the model never exists in fp32 at full size (its LayerNorms
    stay fp32 and are cast by the engine). Each weight is still drawn in fp32 and rounded.
    In fp16/bf16 megatron's softmax upcasts the attention scores to fp32 (its fp16/bf16 flags).
    recompute: activation recomputation with one checkpoint per layer, as the paper trains.
    seed: the weights' seed; each parameter is drawn from (seed, its name) (module docstring).
    layer_spec: one of LAYER_SPECS (`gpt_layer_spec`).
    Built on the default device: under `torch.device("cuda", i)` the weights are allocated and
    drawn on that GPU; under `torch.device("meta")` no memory is allocated and nothing is drawn
    (for counting, or for stage 3's unit-by-unit materialization with `megatron_param_init_fn`).
    """
    tp = parallel_state.get_tensor_model_parallel_world_size()
    shape.check()
    shape.check_tp(tp)
    with warnings.catch_warnings():  # megatron 0.16 warns about a CUDA-graph default it sets itself
        warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)
        config = transformer_config(shape, tp, recompute, dtype, dropout)
    # Megatron's own draw (in construction order, from the global generator) would be
    # overwritten: build with no-op init methods (its CPU initialization still allocates each
    # weight and marks its TP attributes), then draw every parameter by name.
    methods = {k: getattr(config, k) for k in _INIT_METHODS}
    for k in _INIT_METHODS:
        setattr(config, k, _skip_init)
    try:
        model = GPTModel(config=config, transformer_layer_spec=gpt_layer_spec(layer_spec, shape),
                         vocab_size=padded_vocab_size(shape.vocab_size, tp), max_sequence_length=shape.seq_len,
                         position_embedding_type=POSITION_EMBEDDING_TYPES[shape.position],
                         share_embeddings_and_output_weights=shape.tie_embeddings)
    finally:
        for k, method in methods.items():
            setattr(config, k, method)
    init_megatron_params(model, seed)  # no-op for parameters on the meta device
    return model


_INIT_METHODS = ("init_method", "output_layer_init_method", "embedding_init_method")
POSITION_EMBEDDING_TYPES = {"learned": "learned_absolute", "rope": "rope"}   # model.position -> GPTModel's
NORMALIZATIONS = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}             # model.norm -> TransformerConfig's


def _skip_init(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def transformer_config(shape: GPTShape, tp: int, recompute: bool, dtype: torch.dtype,
                       dropout: float = 0.0) -> TransformerConfig:
    """megatron-core's TransformerConfig for `shape` at TP `tp`, as build_gpt builds it."""
    # fp16/bf16 as Megatron trains: its softmax then runs on scores upcast to fp32
    # (attention_softmax_in_fp32), and returns probabilities in the training dtype
    return TransformerConfig(params_dtype=dtype, fp16=dtype == torch.float16, bf16=dtype == torch.bfloat16,
        attention_softmax_in_fp32=True,
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        # the Llama / MPT choices (GPTShape's defaults are megatron's: GPT-2's model)
        num_query_groups=shape.kv_heads, ffn_hidden_size=shape.ffn, add_bias_linear=shape.bias,
        normalization=NORMALIZATIONS[shape.norm],
        **({"gated_linear_unit": True, "activation_func": F.silu} if shape.mlp == "swiglu" else {}),
        # megatron's "CPU" initialization allocates on the default device (no device= of its own)
        tensor_model_parallel_size=tp, use_cpu_initialization=True, init_method_std=INIT_STD,
        hidden_dropout=dropout, attention_dropout=dropout,
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None)


def gpt_layer_spec(name: str = "local", shape: GPTShape | None = None):
    """megatron-core's transformer layer spec `name`, one of LAYER_SPECS: "local" is megatron's
    own modules, the model every CPU test checks; "transformer_engine" is TE's fused modules, as
    in NGC images, only when asked for (never because TE happens to be importable).

    With model.norm=rmsnorm the local spec's norms are megatron's WrappedTorchNorm
    (torch.nn.RMSNorm), the final one included: a block spec naming it, since megatron's
    default final norm is Apex's FusedLayerNorm where Apex imports, which refuses RMSNorm.
    megatron's local RMSNorm spec also sets a module-global (backends.LNImpl) that later
    LayerNorm specs would inherit: restored here. TE's modules read the config's normalization."""
    if name == "local":
        if shape is None or shape.norm != "rmsnorm":
            return get_gpt_layer_local_spec()
        from megatron.core.models import backends
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
        saved = backends.LNImpl
        try:
            layer = get_gpt_layer_local_spec(normalization="RMSNorm")
        finally:
            backends.LNImpl = saved
        return TransformerBlockSubmodules(layer_specs=[layer] * shape.layers,
                                          layer_norm=layer.submodules.input_layernorm)
    if name != "transformer_engine":
        raise ValueError(f"layer_spec must be one of {list(LAYER_SPECS)}, got {name!r}")
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    except ImportError as e:
        raise ValueError(f"layer_spec transformer_engine: Transformer Engine does not import here ({e})") from None
    return get_gpt_layer_with_transformer_engine_spec()


# -- initialization by parameter role ----------------------------------------------------------
@dataclass(frozen=True)
class ParamRole:
    """How megatron initializes one parameter.

    fill: "normal" (drawn by the config's `init`), "ones" (norm scales) or "zeros" (biases).
    init: the TransformerConfig attribute holding the init method, for "normal".
    partition_dim: the dimension TP shards the parameter along; None when every TP rank holds
        all of it (megatron's `partition_dim`, where its `tensor_model_parallel` is True).
    """

    fill: str
    init: str | None = None
    partition_dim: int | None = None


# Owners (the attribute holding the parameter's module) -> role of their "weight" and "bias";
# megatron-core 0.16: attention.py passes output_layer_init_method to linear_proj, mlp.py to
# linear_fc2, init_method to linear_qkv / linear_fc1 / the output layer, and
# language_model_embedding.py embedding_init_method to both embeddings.
_COLUMN_PARALLEL = {"linear_qkv", "linear_q", "linear_kv", "linear_fc1", "output_layer"}
_ROW_PARALLEL = {"linear_proj", "linear_fc2"}
_VOCAB_PARALLEL = {"word_embeddings"}
_SERIAL_EMBEDDINGS = {"position_embeddings", "tokentype_embeddings"}


def param_role(name: str) -> ParamRole:
    """The role of a GPTModel parameter from its qualified name, for the local layer spec
    (`...input_layernorm.weight`, `...self_attention.linear_qkv.weight`) and the Transformer
    Engine spec, whose LayerNorms are fused into the next linear layer
    (`...linear_qkv.layer_norm_weight`, `...mlp.linear_fc1.layer_norm_bias`)."""
    parts = name.split(".")
    attr, owner = parts[-1], (parts[-2] if len(parts) > 1 else "")
    if attr == "layer_norm_weight":
        return ParamRole("ones")
    if attr == "layer_norm_bias":
        return ParamRole("zeros")
    if owner.endswith("norm"):  # input_layernorm, pre_mlp_layernorm, final_layernorm, q/k_layernorm
        if attr in ("weight", "bias"):
            return ParamRole("ones" if attr == "weight" else "zeros")
    elif owner in _COLUMN_PARALLEL:
        if attr == "weight":
            return ParamRole("normal", "init_method", 0)
        if attr == "bias":
            return ParamRole("zeros", None, 0)
    elif owner in _ROW_PARALLEL:
        if attr == "weight":
            return ParamRole("normal", "output_layer_init_method", 1)
        if attr == "bias":
            return ParamRole("zeros")  # added after the all-reduce: every TP rank holds all of it
    elif owner in _VOCAB_PARALLEL and attr == "weight":
        return ParamRole("normal", "embedding_init_method", 0)
    elif owner in _SERIAL_EMBEDDINGS and attr == "weight":
        return ParamRole("normal", "embedding_init_method")
    raise KeyError(f"no initialization role for parameter {name!r}")


def parameter_seed(seed: int, name: str) -> int:
    """The generator seed of one parameter: a hash of (seed, qualified name), 63 bits."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


# One chunk of a weight's draw: 64 MB of fp32, all that initializing a parameter holds beyond it.
DRAW_CHUNK_ELEMENTS = 2 ** 24


@torch.no_grad()
def init_parameter(param: torch.Tensor, name: str, config: TransformerConfig, seed: int,
                   tp_rank: int | None = None, tp_size: int | None = None) -> None:
    """Initialize one parameter (this TP rank's part of it) in place, by its role.

    A drawn parameter is drawn whole, in its TP=1 shape, with megatron's init method for the
    role, on the parameter's own device (a GPU's for a model built there), from that device's
    generator seeded by `parameter_seed(seed, name)`: chunks of whole rows in a fixed order,
    each TP rank keeping the rows or columns of its slice as megatron's
    `_initialize_affine_weight_cpu` splits the weight (`_slice_pieces`). Memory beyond the
    parameter is one chunk, not the full weight. On the CPU the values are bit for bit those of
    one draw of the full weight, megatron's CPU initialization (`_row_chunks`); on a GPU they
    come from its Philox generator: the same on every rank of a job (same chunks, same order).
    """
    role = param_role(name)
    if role.fill == "ones":
        param.fill_(0.0 if config.layernorm_zero_centered_gamma else 1.0)
        return
    if role.fill == "zeros":
        param.zero_()
        return
    if tp_rank is None or tp_size is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if getattr(param, "tensor_model_parallel", False) and param.partition_dim != role.partition_dim:
        raise ValueError(f"{name}: megatron shards it along dim {param.partition_dim}, its role says "
                         f"{role.partition_dim}")
    if param.dim() != 2:
        raise ValueError(f"{name}: a drawn parameter is a 2-D weight, this one has shape {tuple(param.shape)}")
    dim = role.partition_dim
    rows, cols = param.shape
    if dim is not None:  # (start, end, local start) along dim of the full weight's pieces this rank keeps
        pieces = _slice_pieces(param.shape[dim] * tp_size, param.shape[dim], getattr(param, "partition_stride", 1),
                               tp_rank, tp_size)
        rows, cols = (rows * tp_size, cols) if dim == 0 else (rows, cols * tp_size)
    init_method = getattr(config, role.init)
    device = param.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        generator = torch.cuda.default_generators[device.index] if device.type == "cuda" else torch.default_generator
        generator.manual_seed(parameter_seed(seed, name))
        for r0, r1 in _row_chunks(rows, cols):
            chunk = torch.empty(r1 - r0, cols, dtype=torch.float32, device=device)
            init_method(chunk)  # drawn in fp32 and rounded once to the parameter's dtype, as megatron does
            if dim is None:
                param[r0:r1].copy_(chunk)
            elif dim == 1:
                for f0, f1, local in pieces:
                    param[r0:r1, local:local + f1 - f0].copy_(chunk[:, f0:f1])
            else:
                for f0, f1, local in pieces:
                    a, b = max(f0, r0), min(f1, r1)
                    if a < b:
                        param[local + a - f0:local + b - f0].copy_(chunk[a - r0:b - r0])


def _slice_pieces(full: int, per_partition: int, stride: int, tp_rank: int, tp_size: int) -> list[tuple[int, int, int]]:
    """Megatron's split of a dimension of `full` (`_initialize_affine_weight_cpu`): pieces of
    per_partition / stride, dealt round-robin to the TP ranks; this rank's as (start, end, start
    in its slice)."""
    size = per_partition // stride
    return [(p * size, (p + 1) * size, (p // tp_size) * size) for p in range(tp_rank, full // size, tp_size)]


def _row_chunks(rows: int, cols: int) -> list[tuple[int, int]]:
    """Row ranges of a (rows, cols) weight, about DRAW_CHUNK_ELEMENTS each, drawn in order. torch's
    CPU normal_ fills blocks of 16 values and redraws the last 16 of a draw whose size is not a
    multiple of 16: chunks of a multiple of 16 elements, and a last one of at least 16, give the
    values of one draw of the whole weight."""
    step = 16 // math.gcd(cols, 16)  # rows per multiple of 16 elements
    per_chunk = max(step, DRAW_CHUNK_ELEMENTS // cols // step * step)
    chunks, r0 = [], 0
    while r0 < rows:
        r1 = min(rows, r0 + per_chunk)
        if 0 < (rows - r1) * cols < 16:  # a short tail joins this last chunk
            r1 = rows
        chunks.append((r0, r1))
        r0 = r1
    return chunks


def init_megatron_params(model: torch.nn.Module, seed: int = INIT_SEED) -> None:
    """(Re)initialize every parameter of `model` not on the meta device, by role and name."""
    fn = megatron_param_init_fn(model, seed)
    for module in model.modules():
        fn(module)


def megatron_param_init_fn(model: torch.nn.Module, seed: int = INIT_SEED) -> Callable[[torch.nn.Module], None]:
    """stage 3's `param_init_fn` for `model` built on the meta device: initializes a module's
    own parameters that are no longer on the meta device, each once (a module whose parameters
    fall in two units is called twice: once its first ones are materialized, and they may be
    sharded and released when the second are), with the values an eager build has."""
    config = model.config
    prefixes = {id(m): name for name, m in model.named_modules()}
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    done: set[str] = set()

    def init(module: torch.nn.Module) -> None:
        prefix = prefixes[id(module)]
        for attr, p in module.named_parameters(recurse=False):
            name = f"{prefix}.{attr}" if prefix else attr
            if p.is_meta or name in done:
                continue
            init_parameter(p, name, config, seed, tp_rank, tp_size)
            done.add(name)

    return init


def lm_inputs(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Megatron GPT keyword inputs for next-token prediction on tokens [batch, seq_len + 1]."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    s = inputs.shape[1]
    return {"input_ids": inputs, "labels": labels,
            "position_ids": torch.arange(s, device=tokens.device).unsqueeze(0).expand_as(inputs),
            # True = masked (megatron's convention); explicit, since its default mask is CUDA-only
            "attention_mask": torch.ones(1, 1, s, s, dtype=torch.bool, device=tokens.device).triu(1)}


def gpt_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of `model` (a GPTModel or an engine wrapping one)."""
    return model(**lm_inputs(tokens)).float().mean()
