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
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import warnings

import torch
import torch.distributed as dist

with warnings.catch_warnings():  # megatron-core announces every optional CUDA kernel it falls back from
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

from .megatron_cpu import apply_cpu_workarounds

VOCAB_SIZE = 50257          # GPT-2's BPE vocabulary, as in the paper's runs
VOCAB_MULTIPLE = 128        # Megatron's --make-vocab-size-divisible-by default, times TP
INIT_STD = 0.02


@dataclass(frozen=True)
class GPTShape:
    """A GPT-2-like shape: the columns of the paper's Table 4 and appendix tables."""

    layers: int
    hidden: int
    heads: int
    seq_len: int = 1024
    vocab_size: int = VOCAB_SIZE

    def check_tp(self, tp: int) -> None:
        """Megatron's constraints: TP divides the heads and the hidden size."""
        if self.heads % tp or self.hidden % tp:
            raise ValueError(f"tensor-parallel size {tp} must divide heads ({self.heads}) and hidden ({self.hidden})")
        if self.hidden % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide hidden ({self.hidden})")


def padded_vocab_size(vocab_size: int, tp: int = 1) -> int:
    """Megatron pads the vocabulary to a multiple of 128 x TP so each TP slice is aligned."""
    multiple = VOCAB_MULTIPLE * tp
    return -(-vocab_size // multiple) * multiple


def parameter_count(shape: GPTShape, tp: int = 1) -> int:
    """Parameters of the whole model (all TP ranks together), in closed form.

    Embeddings V·h + s·h (output layer tied to the input embedding), per layer 12h² + 13h
    (QKV 3h² + 3h, projection h² + h, MLP 8h² + 5h, two LayerNorms 4h), final LayerNorm 2h.
    Checked against megatron-core built on the meta device in the tests.
    """
    h = shape.hidden
    return padded_vocab_size(shape.vocab_size, tp) * h + shape.seq_len * h + shape.layers * (12 * h * h + 13 * h) + 2 * h


def parameters_per_tp_rank(shape: GPTShape, tp: int) -> int:
    """Parameters one TP rank holds: its 1/tp of the sharded ones (word embeddings, QKV weight
    and bias, projection weight, MLP weights and first bias) plus a copy of the rest (position
    embeddings, LayerNorms, the row-parallel layers' biases)."""
    h, l = shape.hidden, shape.layers
    duplicated = shape.seq_len * h + l * 6 * h + 2 * h
    return (parameter_count(shape, tp) - duplicated) // tp + duplicated


def narayanan_eq2(shape: GPTShape) -> float:
    """Narayanan et al. 2021, Eq. 2: P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))."""
    l, h = shape.layers, shape.hidden
    return 12 * l * h * h * (1 + 13 / (12 * h) + (shape.vocab_size + shape.seq_len) / (12 * l * h))


def initialize_parallel(tp: int, seed: int = 1234) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Set up megatron-core's TP x DP groups on the running world; returns (dp_group, tp_group)."""
    world = dist.get_world_size()
    if world % tp:
        raise ValueError(f"world size {world} is not divisible by tensor-parallel size {tp}")
    apply_cpu_workarounds()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return parallel_state.get_data_parallel_group(), parallel_state.get_tensor_model_parallel_group()


def build_gpt(shape: GPTShape, *, recompute: bool = False) -> GPTModel:
    """megatron-core GPTModel of `shape` for the current TP degree, fp32, no dropout.

    recompute: activation recomputation with one checkpoint per layer, as the paper trains.
    Uses the Transformer Engine layer spec on GPU when it is installed, the local spec otherwise.
    Built under `torch.device("meta")`, no memory is allocated (for counting, or for stage 3's
    unit-by-unit materialization with `init_megatron_params`).
    """
    tp = parallel_state.get_tensor_model_parallel_world_size()
    shape.check_tp(tp)
    with warnings.catch_warnings():  # megatron 0.16 warns about a CUDA-graph default it sets itself
        warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)
        config = _transformer_config(shape, tp, recompute)
    return GPTModel(config=config, transformer_layer_spec=_layer_spec(),
                    vocab_size=padded_vocab_size(shape.vocab_size, tp), max_sequence_length=shape.seq_len,
                    position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True)


def _transformer_config(shape: GPTShape, tp: int, recompute: bool) -> TransformerConfig:
    return TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        tensor_model_parallel_size=tp, use_cpu_initialization=True, init_method_std=INIT_STD,
        hidden_dropout=0.0, attention_dropout=0.0,
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None)


def _layer_spec():
    if torch.cuda.is_available():
        try:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
            import transformer_engine  # noqa: F401
            return get_gpt_layer_with_transformer_engine_spec()
        except ImportError:
            pass
    return get_gpt_layer_local_spec()


@torch.no_grad()
def init_megatron_params(module: torch.nn.Module) -> None:
    """Megatron's initialization for a module's own parameters (for meta-device builds): weights
    ~ N(0, 0.02), output projections of each layer scaled by 1/sqrt(2·layers), biases 0,
    LayerNorm weights 1. Seed every rank alike."""
    config = getattr(module, "config", None)
    layers = config.num_layers if config is not None else 1
    for name, p in module.named_parameters(recurse=False):
        if "norm" in type(module).__name__.lower() and name == "weight":
            p.fill_(1.0)
        elif p.dim() == 1:
            p.zero_()
        else:
            scaled = type(module).__name__ == "RowParallelLinear"
            p.normal_(0.0, INIT_STD / math.sqrt(2 * layers) if scaled else INIT_STD)


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
