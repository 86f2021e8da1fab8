"""A minimal GPT-2 in plain PyTorch (nanoGPT's shape) for tests and engine benchmarks.

The suite's benchmark model is megatron-core's GPT (megatron_gpt.py); this one needs nothing but
torch, has tied input/output embeddings (one Parameter used in two places) and a ModuleList of
blocks, which is what the engine's tests and stage-3 units need.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class TinyGPTConfig:
    vocab_size: int = 67
    seq_len: int = 16
    hidden: int = 10
    layers: int = 2
    heads: int = 2


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        # No qkv bias: the key bias has an identically zero gradient (softmax ignores a shift), so
        # Adam would turn its round-off noise into full-size updates and runs that differ only
        # in summation order would drift apart for no reason worth measuring.
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.attn_out = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (z.view(b, t, self.heads, h // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(y.transpose(1, 2).reshape(b, t, h))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """GPT-2: token + learned position embeddings, blocks, final LayerNorm, tied output layer."""

    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg.hidden, cfg.heads) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        for p in self.parameters():  # GPT-2 init, so tiny models train like real ones
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # tied: the embedding is used twice


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, averaged over the batch's positions."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32)), tokens[:, 1:].reshape(-1))


def synthetic_tokens(batch: int, seq_len: int, vocab: int, seed: int) -> torch.Tensor:
    """Deterministic token batch: the same seed gives the same tokens on every machine."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq_len), generator=g)
