"""A GPT's shape and what follows from it in closed form: parameter counts (all TP ranks, one
TP rank), Megatron's padded vocabulary, the normal draws of its initialization. No megatron-core
import: the suite validates points and prices plans with these before it builds any model
(experiments/models/megatron_gpt.py builds it)."""
from __future__ import annotations

from dataclasses import dataclass

VOCAB_SIZE = 50257          # GPT-2's BPE vocabulary, as in the paper's runs
VOCAB_MULTIPLE = 128        # Megatron's --make-vocab-size-divisible-by default, times TP
LAYER_SPECS = ("local", "transformer_engine")  # train.layer_spec


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


def normal_draws_per_rank(shape: GPTShape, tp: int) -> int:
    """Normal values one rank draws to initialize the model: every drawn weight whole, in its
    TP=1 shape, at any TP degree (`init_parameter`): the embeddings V·h + s·h (V padded for the
    TP degree) and per layer 12h² (QKV 3h², projection h², MLP 8h²)."""
    h = shape.hidden
    return padded_vocab_size(shape.vocab_size, tp) * h + shape.seq_len * h + shape.layers * 12 * h * h


def narayanan_eq2(shape: GPTShape) -> float:
    """Narayanan et al. 2021, Eq. 2: P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))."""
    l, h = shape.layers, shape.hidden
    return 12 * l * h * h * (1 + 13 / (12 * h) + (shape.vocab_size + shape.seq_len) / (12 * l * h))
