"""One CPU rank's compute, measured: GEMM throughput by shape, streaming bandwidth, and the time
a tiny op costs through the dispatcher and autograd (the per-kernel floor).

Every number is the median of `repeats` timings (>= `min_s` each, long enough for the timer's
resolution) on this thread's CPU clock (time.thread_time): the ranks compute on one thread
each, and on a shared machine a wall clock would measure whoever else ran on the core too (the
load, not the core: 3x apart between two runs here). What other processes take from the ranks
is the sweep's wall clock's business, not this profile's (see the prediction check's notes).
"""
from __future__ import annotations

import itertools
import statistics
import time
from typing import Callable

import torch

from experiments.models.gpt_shape import padded_vocab_size
from experiments.points import load_model

SQUARE_SIZES = (32, 64, 128, 256, 512, 1024)


def median_seconds(fn: Callable[[], object], *, repeats: int = 9, min_s: float = 0.005) -> float:
    """Median thread CPU seconds per call of fn, over `repeats` timings of enough calls to last min_s."""
    clock = time.thread_time
    fn()  # warm: first-call allocation and dispatch caches
    began, calls = clock(), 0
    while clock() - began < min_s / 4:
        fn()
        calls += 1
    n = max(1, round(min_s / ((clock() - began) / calls)))
    samples = []
    for _ in range(repeats):
        began = clock()
        for _ in range(n):
            fn()
        samples.append((clock() - began) / n)
    return statistics.median(samples)


def sweep_gemm_shapes(models: list[str], micro_batch: int, tp: int = 1) -> list[tuple[int, int, int, int]]:
    """The (batch, m, n, k) GEMMs (batch x (m x k @ k x n)) one TP rank runs for these models:
    each linear layer's forward (T x in @ in x out), input gradient (T x out @ out x in) and
    weight gradient (out x T @ T x in), T = micro_batch x seq tokens; and attention's batched
    scores (s x d @ d x s) and context (s x s @ s x d) over micro_batch x heads/tp, with the
    shapes of their backward products."""
    shapes: set[tuple[int, int, int, int]] = set()
    for name in models:
        m = load_model(name)
        h, s, heads = m["hidden"], m["seq_len"], m["heads"]
        tokens, v, d = micro_batch * s, padded_vocab_size(m["vocab_size"], tp), h // heads
        for fan_in, fan_out in ((h, 3 * h // tp), (h // tp, h), (h, 4 * h // tp), (4 * h // tp, h), (h, v // tp)):
            shapes |= {(1, tokens, fan_out, fan_in), (1, tokens, fan_in, fan_out), (1, fan_out, fan_in, tokens)}
        shapes |= {(micro_batch * heads // tp, s, s, d), (micro_batch * heads // tp, s, d, s)}
    return sorted(shapes)


def measure_gemms(shapes: list[tuple[int, int, int, int]], pool_bytes: int = 64 * 2 ** 20) -> list[dict]:
    """Per shape: its median time and the rate it reaches once the call's own dispatch is taken
    off (a 1 x 1 x 1 product through the same path: the step-time model adds a per-kernel floor
    itself, and counting it here too would count it twice). fp32, the CPU sweep's precision.

    Operands rotate through copies filling `pool_bytes`, far more than the core's L2, so each call
    reads them from memory as a training step does (every weight and activation is touched once
    per pass, with the whole model's state in between): the same GEMM on operands hot in L2 runs
    1.3-2x faster here, and a table of hot rates predicted the tiny_l step's GEMMs 2x too fast.
    A batched product is listed as the (batch·m, n, k) GEMM, as the GemmModel protocol asks it."""
    one, out1 = torch.ones(1, 1, 1), torch.empty(1, 1, 1)
    dispatch_s = median_seconds(lambda: torch.bmm(one, one, out=out1))
    rows = []
    for batch, m, n, k in shapes:
        copies = max(1, pool_bytes // (4 * batch * (m * k + k * n + m * n)))
        pool = [(torch.randn(batch, m, k), torch.randn(batch, k, n), torch.empty(batch, m, n)) for _ in range(copies)]
        turn = itertools.cycle(pool)

        def gemm() -> None:
            a, b, out = next(turn)
            torch.bmm(a, b, out=out)
        seconds = median_seconds(gemm)
        rows.append({"m": batch * m, "n": n, "k": k, "batch": batch, "seconds": seconds,
                     "flops_per_s": 2.0 * batch * m * n * k / max(seconds - dispatch_s, seconds / 10)})
    return rows


def measure_stream_bytes_per_s(nbytes: int) -> float:
    """Streaming bandwidth of an elementwise op (out = a + b: reads 2, writes 1 array of nbytes)."""
    a, b = torch.rand(nbytes // 4), torch.rand(nbytes // 4)
    out = torch.empty_like(a)
    return 3 * nbytes / median_seconds(lambda: torch.add(a, b, out=out), repeats=5, min_s=0.02)


def measure_op_floor() -> dict[str, float]:
    """The per-op floor: a one-element op's forward through autograd (recording its node), and
    its backward per node, timed over a chain so that backward's own start-up is shared."""
    x = torch.ones(1, requires_grad=True)
    forward_s = median_seconds(lambda: x * 1.5)
    chain = 200

    def backward() -> None:
        y = x
        for _ in range(chain):
            y = y * 1.5
        y.backward()
    with_backward = median_seconds(backward, repeats=9, min_s=0.01)
    return {"forward_s": forward_s, "backward_s": max(with_backward / chain - forward_s, 0.0)}
