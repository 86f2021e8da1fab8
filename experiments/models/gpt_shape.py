"""A GPT's shape and what follows from it in closed form: parameter counts (all TP ranks, one
TP rank), Megatron's padded vocabulary, the normal draws of its initialization. No megatron-core
import: the suite validates points and prices plans with these before it builds any model
(experiments/models/megatron_gpt.py builds it)."""
from __future__ import annotations

from dataclasses import dataclass

VOCAB_SIZE = 50257          # GPT-2's BPE vocabulary, as in the paper's runs
VOCAB_MULTIPLE = 128        # Megatron's --make-vocab-size-divisible-by default, times TP
LAYER_SPECS = ("local", "transformer_engine")  # train.layer_spec
POSITIONS = ("learned", "rope")     # model.position: learned absolute embeddings, or rotary (no parameters)
MLPS = ("gelu", "swiglu")           # model.mlp: GeLU, or SwiGLU (a gated linear unit, fc1 twice as wide)
NORMS = ("layernorm", "rmsnorm")    # model.norm: RMSNorm has a weight and no bias


@dataclass(frozen=True)
class GPTShape:
    """A GPT shape: the columns of the paper's Table 4 and appendix tables, then the choices
    that make it Llama- or MPT-like, each defaulting to GPT-2's (the paper's model):

    ffn_hidden: the MLP's width (None: 4 x hidden); kv_heads: grouped-query attention's key/value
    heads (None: heads, multi-head attention); bias: biases in the linear layers; position:
    one of POSITIONS; mlp: one of MLPS; norm: one of NORMS; tie_embeddings: the output layer
    is the input embedding (False: an output layer of its own, V x h)."""

    layers: int
    hidden: int
    heads: int
    seq_len: int = 1024
    vocab_size: int = VOCAB_SIZE
    ffn_hidden: int | None = None
    kv_heads: int | None = None
    bias: bool = True
    position: str = "learned"
    mlp: str = "gelu"
    norm: str = "layernorm"
    tie_embeddings: bool = True

    @property
    def ffn(self) -> int:
        """The MLP's width: ffn_hidden, or 4 x hidden."""
        return 4 * self.hidden if self.ffn_hidden is None else self.ffn_hidden

    @property
    def query_groups(self) -> int:
        """Key/value heads (megatron's num_query_groups): kv_heads, or heads."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def kv_hidden(self) -> int:
        """Width of K (and of V): query_groups x head dim."""
        return self.query_groups * (self.hidden // self.heads)

    def check(self) -> None:
        """The shape's own constraints (no TP): each choice one of its values, the heads divide
        hidden, the key/value heads divide the heads."""
        for key, allowed in (("position", POSITIONS), ("mlp", MLPS), ("norm", NORMS)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"model.{key} must be one of {list(allowed)}, got {getattr(self, key)!r}")
        for key in ("layers", "hidden", "heads", "seq_len", "vocab_size", "ffn_hidden", "kv_heads"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"model.{key} must be a positive integer{' or null' if key in ('ffn_hidden', 'kv_heads') else ''}, "
                                 f"got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide hidden ({self.hidden})")
        if self.heads % self.query_groups:
            raise ValueError(f"model.kv_heads ({self.query_groups}) must divide model.heads ({self.heads})")

    def check_tp(self, tp: int) -> None:
        """Megatron's constraints: TP divides the heads, the hidden size, the key/value heads
        and the MLP's width."""
        if self.heads % tp or self.hidden % tp:
            raise ValueError(f"tensor-parallel size {tp} must divide heads ({self.heads}) and hidden ({self.hidden})")
        if self.hidden % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide hidden ({self.hidden})")
        if self.query_groups % tp:
            raise ValueError(f"tensor-parallel size {tp} must divide model.kv_heads ({self.query_groups})")
        if self.ffn % tp:
            raise ValueError(f"tensor-parallel size {tp} must divide model.ffn_hidden ({self.ffn})")


def padded_vocab_size(vocab_size: int, tp: int = 1) -> int:
    """Megatron pads the vocabulary to a multiple of 128 x TP so each TP slice is aligned."""
    multiple = VOCAB_MULTIPLE * tp
    return -(-vocab_size // multiple) * multiple


def _norm_params(shape: GPTShape) -> int:
    """One LayerNorm: weight and bias, 2h; one RMSNorm: weight, h."""
    return shape.hidden * (2 if shape.norm == "layernorm" else 1)


def layer_parameters(shape: GPTShape) -> tuple[int, int]:
    """One transformer layer's parameters, (sharded over TP, held whole by every TP rank):
    QKV h·(h + 2·kv) (+ its bias h + 2·kv), projection h² (+ bias h, replicated), FC1 h·f·g
    (+ bias f·g; g = 2 for SwiGLU's gate and up), FC2 f·h (+ bias h, replicated), two norms
    (kv = kv_heads x head dim, f = the MLP's width)."""
    h, kv, f = shape.hidden, shape.kv_hidden, shape.ffn
    glu = 2 if shape.mlp == "swiglu" else 1
    sharded = h * (h + 2 * kv) + h * h + h * f * glu + f * h
    duplicated = 2 * _norm_params(shape)
    if shape.bias:
        sharded += h + 2 * kv + f * glu
        duplicated += 2 * h
    return sharded, duplicated


def root_parameters(shape: GPTShape, tp: int = 1) -> tuple[int, int]:
    """Parameters outside the layers, (sharded, duplicated): word embeddings V·h (and an output
    layer V·h when untied), position embeddings s·h when learned, the final norm."""
    vh = padded_vocab_size(shape.vocab_size, tp) * shape.hidden
    sharded = vh * (1 if shape.tie_embeddings else 2)
    duplicated = _norm_params(shape) + (shape.seq_len * shape.hidden if shape.position == "learned" else 0)
    return sharded, duplicated


def parameter_count(shape: GPTShape, tp: int = 1) -> int:
    """Parameters of the whole model (all TP ranks together), in closed form.

    GPT-2's shape (the defaults): embeddings V·h + s·h (output layer tied to the input
    embedding), per layer 12h² + 13h (QKV 3h² + 3h, projection h² + h, MLP 8h² + 5h, two
    LayerNorms 4h), final LayerNorm 2h. Other shapes: `layer_parameters`, `root_parameters`.
    Checked against megatron-core built on the meta device in the tests.
    """
    layer, layer_dup = layer_parameters(shape)
    root, root_dup = root_parameters(shape, tp)
    return root + root_dup + shape.layers * (layer + layer_dup)


def parameters_per_tp_rank(shape: GPTShape, tp: int) -> int:
    """Parameters one TP rank holds: its 1/tp of the sharded ones (word embeddings and an
    untied output layer, QKV weight and bias, projection weight, MLP weights and first bias)
    plus a copy of the rest (position embeddings, norms, the row-parallel layers' biases)."""
    layer, layer_dup = layer_parameters(shape)
    root, root_dup = root_parameters(shape, tp)
    return (root + shape.layers * layer) // tp + root_dup + shape.layers * layer_dup


def normal_draws_per_rank(shape: GPTShape, tp: int) -> int:
    """Normal values one rank draws to initialize the model: every drawn weight whole, in its
    TP=1 shape, at any TP degree (`init_parameter`): the embeddings V·h (twice when untied) +
    s·h when learned (V padded for the TP degree) and per layer its weights (12h² for GPT-2:
    QKV 3h², projection h², MLP 8h²)."""
    h, kv, f = shape.hidden, shape.kv_hidden, shape.ffn
    glu = 2 if shape.mlp == "swiglu" else 1
    embeddings = padded_vocab_size(shape.vocab_size, tp) * h * (1 if shape.tie_embeddings else 2)
    positions = shape.seq_len * h if shape.position == "learned" else 0
    return embeddings + positions + shape.layers * (h * (h + 2 * kv) + h * h + h * f * glu + f * h)


def narayanan_eq2(shape: GPTShape) -> float:
    """Narayanan et al. 2021, Eq. 2: P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))."""
    l, h = shape.layers, shape.hidden
    return 12 * l * h * h * (1 + 13 / (12 * h) + (shape.vocab_size + shape.seq_len) / (12 * l * h))
