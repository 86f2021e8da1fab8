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
"""
from __future__ import annotations


def recompute_factor(recompute: bool) -> int:
    return 4 if recompute else 3


def model_flops_per_iteration(*, batch: int, seq_len: int, layers: int, hidden: int, vocab: int,
                              recompute: bool) -> float:
    """Model FLOPs of one training iteration on a global batch of `batch` sequences."""
    c = recompute_factor(recompute)
    s, l, h = seq_len, layers, hidden
    return 24 * c * batch * s * l * h * h * (1 + s / (6 * h) + vocab / (16 * l * h))


def tflops_per_gpu(flops_per_iteration: float, seconds_per_iteration: float, gpus: int) -> float:
    return flops_per_iteration / (seconds_per_iteration * gpus * 1e12)
