"""Model FLOPs per iteration: the one formula behind every throughput number in the suite.

Narayanan et al. 2021, Eq. 3 (the convention of Megatron-LM's and Megatron-DeepSpeed's
throughput calculators):

    F = 24 · c · B · s · l · h² · (1 + s/(6h) + V/(16·l·h))

B global batch (sequences), s sequence length, l layers, h hidden size, V vocabulary (padded, as
the logit GEMM computes it), c = 4 with activation recomputation (forward, recomputed forward,
backward = 2 forwards) and 3 without. Attention is counted in full (no causal halving). The
V/(16lh) term is the logit layer's forward and backward, 6·B·s·h·V, never recomputed; the
convention keeps it for c = 3 too, where it counts 4.5·B·s·h·V, so numbers stay comparable with
Megatron's and the paper's.

For another block (grouped-query attention, an MLP of another width, SwiGLU's three matrices)
24·h² becomes 2·W, W the weights a layer multiplies a token by (QKV h·(h + 2·g·h/a), projection h²,
MLP 2·h·f or 3·h·f): the same convention, 2 FLOPs per weight and token, counted c times.
"""
from __future__ import annotations


def recompute_factor(recompute: bool) -> int:
    return 4 if recompute else 3


def layer_weights(hidden: int, heads: int | None = None, kv_heads: int | None = None, ffn_hidden: int | None = None,
                  swiglu: bool = False) -> int:
    """The weights a layer multiplies each token by (module docstring); 12·h² for GPT-2's."""
    h = hidden
    kv = h if not heads or not kv_heads else kv_heads * (h // heads)
    ffn = ffn_hidden or 4 * h
    return h * (h + 2 * kv) + h * h + (3 if swiglu else 2) * h * ffn


def model_flops_per_iteration(*, batch: int, seq_len: int, layers: int, hidden: int, vocab: int,
                              recompute: bool, weights_per_layer: int | None = None) -> float:
    """Model FLOPs of one training iteration on a global batch of `batch` sequences;
    weights_per_layer: layer_weights of another block (None: GPT-2's, 12·h²)."""
    c = recompute_factor(recompute)
    s, l, h = seq_len, layers, hidden
    w = 12 * h * h if weights_per_layer is None else weights_per_layer
    return c * batch * s * l * (2 * w + 4 * s * h) + 1.5 * c * batch * s * h * vocab


def tflops_per_gpu(flops_per_iteration: float, seconds_per_iteration: float, gpus: int) -> float:
    return flops_per_iteration / (seconds_per_iteration * gpus * 1e12)
