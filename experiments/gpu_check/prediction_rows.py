"""`make gpu-check`'s step-time model rows (issue 21): the device's measured GEMM curve beside
the profile's predicted one, and the 1.3B point's measured step time beside the prediction
(experiments/analysis/step_time.py, system zero_repro: this engine as the check ran it).

The profile is the device's: an H100 or H200 gets `dgx_h100` (an H200's compute is an H100's;
its HBM, 4.8 TB/s, is faster than the profile's 3.35), a V100 `dgx2_v100`; a CPU rehearsal this
host's calibrated profile (`make calibrate`). With no profile the rows say so. The rows print
the numbers side by side: a model that misses is information, not a failed check; they FAIL
only when nothing was measured or nothing predicted.
"""
from __future__ import annotations

import time

import torch

from experiments.analysis import calibrated, hardware, step_time as st
from experiments.analysis.hardware import Hardware
from experiments.gpu_check.common import error_line, verdict
from experiments.run.record import build_record
from zero_impl.config import DTYPES

GPU_SIZES = (512, 1024, 2048, 4096, 8192)   # square bf16/fp16 GEMMs: wave-quantized to full-device sizes
CPU_SIZES = (64, 128, 256, 512)             # a rehearsal: the sizes one CPU thread runs in a moment


def device_hardware() -> Hardware | None:
    """This device's profile (module docstring), or None."""
    if not torch.cuda.is_available():
        path = calibrated.default_path()
        return calibrated.load_calibrated(path) if path.exists() else None
    name = torch.cuda.get_device_name()
    return hardware.profile("dgx_h100" if "H100" in name or "H200" in name else "dgx2_v100" if "V100" in name else "")


def gemm_curve(precision: str) -> list[tuple[int, float]]:
    """(size, FLOP/s) of square GEMMs on this rank's device: the median of 5 timings, each a
    batch of calls between CUDA events (host clock on CPU). Runs inside a spawned rank."""
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", DTYPES[precision]) if cuda else ("cpu", torch.float32)
    out = []
    for n in GPU_SIZES if cuda else CPU_SIZES:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        calls = max(3, int(2e11 / (2 * n ** 3))) if cuda else max(3, int(2e9 / (2 * n ** 3)))
        a @ b  # warm: cuBLAS picks its kernel, the first call's workspace
        samples = []
        for _ in range(5):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(calls):
                    a @ b
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3 / calls)
            else:
                began = time.perf_counter()
                for _ in range(calls):
                    a @ b
                samples.append((time.perf_counter() - began) / calls)
        out.append((n, 2.0 * n ** 3 / sorted(samples)[2]))
    return out


def gemm_row(outcome: dict, hw: Hardware | None, precision: str) -> tuple[str, str, str, str]:
    """The measured GEMM curve beside peak x the profile's efficiency at each size."""
    name = f"GEMM curve ({precision if torch.cuda.is_available() else 'fp32'}) vs the step-time model"
    if not outcome["ok"]:
        return name, error_line(outcome["error"]), "measured", "FAIL"
    measured = ", ".join(f"{n}: {r / 1e12:.3g}" for n, r in outcome["value"])
    if hw is None:
        return name, f"TFLOP/s by size {measured}", "no profile for this device", "PASS"
    predicted = ", ".join(f"{n}: {hw.peak_flops * hw.gemm.efficiency(n, n, n) / 1e12:.3g}" for n, _ in outcome["value"])
    return name, f"TFLOP/s by size {measured}", f"{hw.name} predicts {predicted}", "PASS"


def step_row(outcome: dict, point, precision: str, hw: Hardware | None) -> tuple[str, str, str, str]:
    """The trained point's measured step time beside the model's prediction and its terms."""
    name = f"{point.model['name']} step time vs the step-time model (zero_repro)"
    if not outcome["ok"]:
        return name, error_line(outcome["error"]), "a measured step", "FAIL"
    r = build_record(point, precision, "gpu_check", "ok", [outcome["value"]], None, time.strftime("%FT%T"))
    measured = f"{r['step_time_s'] * 1e3:.1f} ms/step ({r['tflops_per_gpu']:.3g} TFLOPs/GPU)"
    if hw is None:
        return name, measured, "no profile for this device", "PASS"
    p = st.predict(st.inputs_from_record(r), hw, system="zero_repro")
    terms = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in p.terms.items() if v > 0)
    expected = (f"{hw.name}: {p.step_s * 1e3:.1f} ms/step ({p.tflops_per_gpu:.3g} TFLOPs/GPU), "
                f"ratio {p.step_s / r['step_time_s']:.2f}; ms by term: {terms}")
    return name, measured, expected, verdict(p.step_s > 0)
