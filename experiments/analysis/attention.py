"""Fused attention kernels: their FLOPs, counted as their authors' benchmark counts them, and
the rate those authors measured them at on each GPU, by head dimension and sequence length.

FLOPs (Dao-AILab/flash-attention benchmarks/benchmark_flash_attention.py @ 60499ab, `flops`): a
forward pass of `batch_heads` heads, sequence s and head dimension d is 4·batch_heads·s²·d,
halved with a causal mask; its backward 2.5x that (the recomputation inside it not counted).

Rates (MEASURED, TFLOPs/s in that convention): forward + backward, causal, fp16, at 2048 hidden
(32 heads of 64 or 16 of 128) and 16k tokens (batch x length), the lengths 512-16k: the bar
labels of flash-attention's figures at commit 4f285b3 ("FlashAttention-2 release", 2023-07-17;
Dao 2023, arXiv 2307.08691), panels (c) and (d) of each: assets/flash2_a100_fwd_bwd_benchmark.png
on an NVIDIA A100 80GB SXM4 (compute capability 80) and assets/flash2_h100_fwd_bwd_benchmark.png
on an H100 80GB SXM5 (90). Only these forward + backward figures are published with their
numbers, so a forward kernel and a backward kernel are each priced at the combined rate
[assumption: their sum is what was measured; the split between them is not].

- "flash2": FlashAttention-2's CUDA kernel, the figure's "FlashAttention-2" series;
- "flash_triton": the Triton kernel llm-foundry's MPT runs with attn_impl=triton
  (llmfoundry/models/layers/flash_attn_triton.py, byte for byte the kernel of flash-attention's
  flash_attn/flash_attn_triton.py @ eff9fe6), whose authors state "Overall Triton forward +
  backward is slightly slower than CUDA forward + backward", the CUDA kernel being FlashAttention
  v1: priced at the figure's "FlashAttention" (v1) series [assumption: "slightly" not quantified;
  on the H100 unmeasured: llm-foundry's Hopper build of the kernel runs one pipeline stage, and
  the gap to v1 may be wider there]. The A100 figure's "FlashAttention Triton" series is OpenAI's
  triton.ops flash attention (the benchmark imports it), not this kernel: not used.

Between measured lengths the rate is interpolated in log2(s); outside them it stays at the nearest
measured length's [assumption: the curves have flattened by 16k]. The A100 40 GB has the 80 GB
part's SMs and clocks: the same rates [assumption: the kernel is compute bound].
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from math import log2

from experiments.analysis.hardware import Hardware

BACKWARD_FLOPS_FACTOR = 2.5   # benchmark_flash_attention.py: a backward pass counts 2.5 forwards

# (compute capability, implementation, head dimension) -> {sequence length: TFLOPs/s}, forward +
# backward, causal (module docstring)
MEASURED: dict[tuple[int, str, int], dict[int, float]] = {
    (80, "flash2", 64): {512: 88, 1024: 119, 2048: 140, 4096: 156, 8192: 165, 16384: 171},
    (80, "flash2", 128): {512: 99, 1024: 133, 2048: 155, 4096: 173, 8192: 182, 16384: 189},
    (80, "flash_triton", 64): {512: 58, 1024: 70, 2048: 77, 4096: 87, 8192: 92, 16384: 97},
    (80, "flash_triton", 128): {512: 55, 1024: 62, 2048: 69, 4096: 76, 8192: 80, 16384: 83},
    (90, "flash2", 64): {512: 141, 1024: 192, 2048: 232, 4096: 257, 8192: 273, 16384: 284},
    (90, "flash2", 128): {512: 163, 1024: 221, 2048: 265, 4096: 294, 8192: 308, 16384: 328},
    (90, "flash_triton", 64): {512: 104, 1024: 123, 2048: 136, 4096: 138, 8192: 149, 16384: 156},
    (90, "flash_triton", 128): {512: 98, 1024: 109, 2048: 108, 4096: 126, 8192: 135, 16384: 137},
}


def attention_flops(batch_heads: int, seq_len: int, head_dim: int, causal: bool, direction: str) -> float:
    """The kernel's FLOPs in its authors' convention (module docstring)."""
    forward = 4.0 * batch_heads * seq_len ** 2 * head_dim / (2 if causal else 1)
    return forward * (BACKWARD_FLOPS_FACTOR if direction == "backward" else 1.0)


@dataclass(frozen=True)
class AttentionCall:
    """One fused attention kernel as a layer calls it: which kernel, at what shape, which pass."""

    implementation: str
    head_dim: int
    seq_len: int
    causal: bool
    direction: str

    def flops_per_s(self, hw: Hardware) -> float:
        """The measured rate on hw's GPU (MEASURED; forward and backward alike), interpolated in
        log2(sequence length); ValueError where nobody measured this kernel on this GPU at this
        head dimension."""
        table = MEASURED.get((hw.compute_capability, self.implementation, self.head_dim))
        if table is None or not self.causal:
            raise ValueError(f"no measured rate of {self.implementation} attention ({'causal' if self.causal else 'non-causal'}, "
                             f"head dimension {self.head_dim}) on {hw.name} (attention.MEASURED)")
        lengths = sorted(table)
        if self.seq_len <= lengths[0]:
            return table[lengths[0]] * 1e12
        if self.seq_len >= lengths[-1]:
            return table[lengths[-1]] * 1e12
        i = bisect_left(lengths, self.seq_len)
        lo, hi = lengths[i - 1], lengths[i]
        w = (log2(self.seq_len) - log2(lo)) / (log2(hi) - log2(lo))
        return (table[lo] * (1 - w) + table[hi] * w) * 1e12
