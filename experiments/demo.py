"""A one-minute tour of the engine: stages 0-2 on local CPU ranks, what each keeps and sends.

    python -m experiments.demo [--world 2] [--steps 20]

Trains a small GPT with bf16 parameters and AdamW at every stage and prints, per rank, the
final loss, the elements communicated per step beside the paper's 2Ψ, and model-state memory
measured from the engine's tensors beside the paper's prediction.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import zero_impl
from zero_impl.launch import spawn
from zero_impl.tiny_gpt import TinyGPT, TinyGPTConfig, lm_loss, synthetic_tokens

MODEL = TinyGPTConfig(vocab_size=512, seq_len=64, hidden=64, layers=4, heads=4)


def train(stage: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(MODEL)
    engine = zero_impl.initialize(model, zero_impl.ZeroConfig(stage=stage, precision="bf16", clip_grad_norm=1.0,
                                                              reduce_bucket_size=20_000),
                                  optimizer=lambda groups: torch.optim.AdamW(groups, lr=3e-3))
    rank = dist.get_rank()
    for step in range(steps):
        tokens = synthetic_tokens(8, MODEL.seq_len, MODEL.vocab_size, seed=step % 4 * 100 + rank)
        loss = lm_loss(engine(tokens), tokens)
        engine.backward(loss)
        engine.step()
    stats = engine.stats()
    return {"loss": loss.item(), "psi": stats["psi"], "comm": stats["comm"]["last_step"]["elements"],
            "measured": stats["memory"]["measured"]["total"], "predicted": stats["memory"]["predicted"]["total"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(f"{args.world} CPU ranks (gloo), bf16 parameters, AdamW; memory is model states per rank")
    print("| stage | final loss | Ψ | elements/step | /Ψ | memory measured (KB) | predicted (KB) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for stage in (0, 1, 2):
        r = spawn(train, args.world, stage, args.steps, timeout=600)[0]
        print(f"| {stage} | {r['loss']:.3f} | {r['psi']:,} | {r['comm']:,} | {r['comm'] / r['psi']:.2f} "
              f"| {r['measured'] / 1e3:.1f} | {r['predicted'] / 1e3:.1f} |")


if __name__ == "__main__":
    main()
