"""A GEMM's efficiency on a GPU from tile and wave quantization over its SMs.

cuBLAS splits the output (m x n) of a GEMM into tiles, one thread block each, and runs the
tiles in waves of one block per SM (NVIDIA, "Matrix Multiplication Background User's Guide"
§3.1, §3.2). Two losses follow from the shape alone:

- tile quantization: the tiles cover ceil(m/tm)·tm x ceil(n/tn)·tn, more than m x n when the
  shape is not a multiple of the tile; the extra is computed and thrown away;
- wave quantization: the last wave of ceil(tiles/SMs) runs with only some SMs busy.

A full tile on a full wave reaches the large-GEMM ceiling (a sourced fraction of peak). Tiles
smaller than 128 x 128 reuse each loaded operand less: a tile loads (tm + tn)·k operands for
2·tm·tn·k FLOPs, so its FLOPs per load scale as tm·tn/(tm + tn). We take 128 x 128 as the
smallest tile that reaches the ceiling and scale smaller tiles by that reuse (64 x 64: 1/2),
an assumption of this model (the guide: "larger tiles ... more data reuse"), not a measurement.
cuBLAS's heuristic picks the tile; we take the best candidate, as a heuristic that picks well.

Memory-bound GEMMs (small k: the attention's batched products, MP 128's thin slices) are not
this module's business: the kernel's time is the larger of its FLOP time at this efficiency and
its bytes at the HBM rate (kernels.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import ceil

TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64))  # cuBLAS's Volta-era tile shapes
FULL_REUSE_TILE = (128, 128)


def tile_reuse(tm: int, tn: int) -> float:
    """A tile's operand reuse, relative to the smallest tile that reaches the ceiling (<= 1)."""
    full = FULL_REUSE_TILE[0] * FULL_REUSE_TILE[1] / sum(FULL_REUSE_TILE)
    return min(1.0, tm * tn / (tm + tn) / full)


def tile_efficiency(m: int, n: int, tm: int, tn: int, sms: int) -> float:
    """Useful fraction of the SM-time a GEMM's m x n output takes in tm x tn tiles on `sms` SMs:
    reuse x tile quantization x wave quantization."""
    rows, cols = ceil(m / tm), ceil(n / tn)
    tiles = rows * cols
    waves = ceil(tiles / sms)
    return tile_reuse(tm, tn) * (m * n) / (rows * tm * cols * tn) * tiles / (waves * sms)


@dataclass(frozen=True)
class TileWaveGemm:
    """GemmModel of a GPU: `ceiling` (the large-GEMM fraction of peak) x the best tile's
    quantization efficiency over `sms` SMs."""

    sms: int
    ceiling: float

    def efficiency(self, m: int, n: int, k: int) -> float:
        return self.ceiling * max(tile_efficiency(m, n, tm, tn, self.sms) for tm, tn in TILES)
