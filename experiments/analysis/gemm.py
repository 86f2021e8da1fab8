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

A third loss, for short k, on the Ampere profiles (`k_tile`, `stages`) [assumption]: each
tile's main loop walks k in steps of k_tile through a pipeline of `stages` shared-memory
buffers, filled before the first multiply and drained after the last: stages - 1 steps without
math in all (the fill and the drain together, not at each end), so a tile's math is
(k / k_tile) / (k / k_tile + stages - 1) of its time. The numbers are CUTLASS's sm80 fp16
tensor-op default (include/cutlass/gemm/device/default_gemm_configuration.h,
DefaultGemmConfiguration<OpClassTensorOp, Sm80, half_t, ...>): threadblock k = 64 (128 x 256 x 64),
kStages = 3. The development set's GEMMs ran cuBLAS on CUDA 11.8, not CUTLASS's default, and
cuBLAS's sm80 kernels' k step and depth are not published: the term is this model's assumption,
held only by the validation's fit at short k. At k = 64 (attention's scores at head size 64) that is 1/3; at TP 8's projection
(k = h/8 = 128 at h 1024) 1/2; at k = 4096, 0.97. The V100 profiles keep their derived ceiling
without it (their ceiling is derived from DeepBench through the two losses above).

Memory-bound GEMMs (small k: the attention's batched products, MP 128's thin slices) are not
this module's business: the kernel's time is the larger of its FLOP time at this efficiency and
its bytes at the HBM rate (kernels.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import ceil

TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64))  # cuBLAS's Volta-era tile shapes
# Ampere's fp16 tensor-op tiles add 256 x 64 and 64 x 256 (CUTLASS 2.x's sm80 default
# threadblock shapes, include/cutlass/gemm/device/default_gemm_configuration.h and the sm80
# profiler set: 256x128, 128x256, 256x64, 64x256, 128x128, 128x64, 64x128, 64x64)
TILES_SM80 = ((256, 128), (128, 256), (256, 64), (64, 256), (128, 128), (128, 64), (64, 128), (64, 64))
TILES_BY_COMPUTE_CAPABILITY = {70: TILES, 80: TILES_SM80, 90: TILES}   # Hopper: left as before (not modelled here)
# the main loop's k step and pipeline depth by compute capability (module docstring); Volta: none
K_PIPELINE_BY_COMPUTE_CAPABILITY = {80: (64, 3)}
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
    tiles: tuple[tuple[int, int], ...] = TILES
    k_tile: int | None = None     # the main loop's k step (None: no pipeline fill and drain)
    stages: int = 1               # its shared-memory pipeline depth

    def pipeline_efficiency(self, k: int) -> float:
        """The fraction of a tile's run that multiplies: (k / k_tile) / (k / k_tile + stages - 1), the
        fill and drain costing stages - 1 k steps in all [assumption: module docstring]."""
        if self.k_tile is None:
            return 1.0
        steps = ceil(k / self.k_tile)
        return steps / (steps + self.stages - 1)

    def efficiency(self, m: int, n: int, k: int) -> float:
        return self.ceiling * self.pipeline_efficiency(k) * max(tile_efficiency(m, n, tm, tn, self.sms)
                                                                for tm, tn in self.tiles)
