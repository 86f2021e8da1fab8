"""Model-state memory: the paper's formulas (Table 1, Table 2).

Ψ is the number of parameters; a device holds (bytes per element) x Ψ of each kind, divided by
the data-parallel degree Nd once that kind is partitioned:

    stage 0 (baseline)  (P + G + K) Ψ
    stage 1 (Pos)       (P + G) Ψ + K Ψ / Nd
    stage 2 (Pos+g)     P Ψ + (G + K) Ψ / Nd
    stage 3 (Pos+g+p)   (P + G + K) Ψ / Nd

with P = G = 2 (fp16) and K = 12 (fp32 master, momentum and variance) in the paper.
"""
from __future__ import annotations

PAPER_BYTES = {"param_bytes": 2, "grad_bytes": 2, "optimizer_bytes": 12}


def model_state_bytes(psi: float, stage: int, nd: int, *, param_bytes: float = 2, grad_bytes: float = 2,
                      optimizer_bytes: float = 12) -> dict[str, float]:
    """Predicted model-state bytes per device by kind, and their total."""
    out = {
        "params": psi * param_bytes / (nd if stage >= 3 else 1),
        "grads": psi * grad_bytes / (nd if stage >= 2 else 1),
        "optimizer_states": psi * optimizer_bytes / (nd if stage >= 1 else 1),
    }
    out["total"] = sum(out.values())
    return out


def max_params(device_bytes: float, stage: int, nd: int, mp: int = 1, **bytes_per_element) -> float:
    """Largest Ψ whose model states fit in `device_bytes` per device (Table 2's analysis):
    with model parallelism each device holds 1/mp of the model."""
    per_param = model_state_bytes(1.0, stage, nd, **(bytes_per_element or PAPER_BYTES))["total"]
    return device_bytes * mp / per_param


def optimizer_step_bytes(owned: float, *, chunk: float | None, grad_bytes: int, master_bytes: int = 4,
                         foreach: bool = True) -> float:
    """Temporaries of the optimizer step (zero_impl/optimizer.py) over `owned` master elements
    per device, updated `chunk` elements at a time (None: all at once): the gradients' copy in
    the masters' dtype where the two differ, and a foreach Adam's square root of every second
    moment it updates (torch's pick for CUDA tensors; the single-tensor loop holds one tensor's)."""
    n = owned if chunk is None else min(owned, chunk)
    return n * ((master_bytes if grad_bytes != master_bytes else 0) + (master_bytes if foreach else 0))


def predicted_for_engine(stats: dict) -> dict[str, float]:
    """Table 1's prediction for the configuration an engine reports in `engine.stats()`."""
    per = stats["bytes_per_param"]
    return model_state_bytes(stats["psi"], stats["stage"], stats["dp_size"], param_bytes=per["params"],
                             grad_bytes=per["grads"], optimizer_bytes=per["optimizer_states"])
