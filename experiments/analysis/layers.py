"""Whose layer a system runs (System.layer): each code base's layer and head kernel lists, and
one micro-batch's kernels by phase.

- megatron2019: Megatron-LM 2019's unfused GPT-2 layer (kernels.py), the ZeRO paper's;
- megatron_ds2023: Megatron-DeepSpeed 2023's fused layer (kernels.py), the development set's;
- torch_block: a pre-norm block in plain PyTorch with the shape's options (torch_block.py):
  llm-foundry's MPT, Llama-shaped blocks.
"""
from __future__ import annotations

from experiments.analysis import kernels as kn
from experiments.analysis import torch_block as tb

LAYERS = {"megatron2019": (kn.layer_forward, kn.layer_backward, kn.head_forward, kn.head_backward),
          "megatron_ds2023": (kn.layer_forward_fused, kn.layer_backward_fused, kn.head_forward_fused,
                              kn.head_backward_fused),
          "torch_block": (tb.block_forward, tb.block_backward, tb.head_forward, tb.head_backward)}


def step_kernels(x: kn.LayerShape, layers: int, recompute: bool,
                 layer: str = "megatron2019") -> dict[str, list[tuple[kn.Kernel, int]]]:
    """One micro-batch's kernels by phase, each with how many times it runs: forward, the
    recomputed forward (empty without recomputation), backward; `layer`: whose code (LAYERS)."""
    forward, backward, head_fwd, head_bwd = LAYERS[layer]
    fwd, bwd = forward(x), backward(x)
    return {"forward": [(k, layers) for k in fwd] + [(k, 1) for k in head_fwd(x)],
            "recompute": [(k, layers) for k in fwd] if recompute else [],
            "backward": [(k, layers) for k in bwd] + [(k, 1) for k in head_bwd(x)]}
