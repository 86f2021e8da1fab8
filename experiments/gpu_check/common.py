"""What every `make gpu-check` row shares: the point a row trains, a call that cannot raise,
deterministic kernels, how far one run ends from another, the data-parallel traffic of a step,
and the verdict and error cells of the table."""
from __future__ import annotations

import math
import os
import traceback

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from experiments.points import CONF_DIR
from experiments.points import point_from_train_config
from experiments.schema import register

SKIPPED = "gpu-check: skipped, no CUDA device here (torch.cuda.is_available() is False)"
BUDGET_S = 470  # the whole check, start-ups included
# Every collective through the backend even at world 1 (zero_impl.comm.Communicator): on one GPU
# NCCL's streams, events and waits then run as at any world size.
FORCE = "zero.force_collectives=true"


def make_point(*overrides: str):
    """A point of experiments/train.py from its Hydra overrides, validated as train.py does."""
    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return point_from_train_config(compose("train", overrides=["experiment_name=gpu_check", "gpus=1", *overrides]))


def deterministic(nan_fill: bool) -> None:
    """Deterministic kernels in this rank (cuBLAS workspace pinned, before the first cuBLAS
    handle), so that runs differing only in how values move (collectives or local copies, where
    checkpoints live) can be compared bit for bit. warn_only: ops without a deterministic kernel
    warn (the rows that compare bitwise name them) instead of raising. `nan_fill`: every
    torch.empty is filled with NaN, so a buffer read before a collective (or copy) wrote it
    turns the loss into NaN; off where a row times steps (the fills would blur the timings)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = nan_fill


def attempt(fn, *args) -> dict:
    try:
        return {"ok": True, "value": fn(*args)}
    except Exception:
        return {"ok": False, "error": traceback.format_exc()}


def parity_distance(reference: dict, other: dict) -> dict[str, float]:
    """How far `other`'s run ends from `reference`'s: the L2 distance of the final parameters
    relative to the reference's update (final - initial), the largest element difference, and
    the largest loss difference over the steps. Runs that do not match in shape are infinitely far."""
    ref, oth = reference["final"], other["final"]
    if ref.keys() != oth.keys() or any(ref[n].shape != oth[n].shape for n in ref) or \
            len(reference["losses"]) != len(other["losses"]):
        return {"update_rel": math.inf, "max_abs": math.inf, "loss_abs": math.inf}
    squared = sum(float(((oth[n].double() - ref[n].double()) ** 2).sum()) for n in ref)
    update = sum(float(((ref[n].double() - reference["initial"][n].double()) ** 2).sum()) for n in ref)
    return {"update_rel": math.sqrt(squared / update) if update else (0.0 if squared == 0 else math.inf),
            "max_abs": max((float((oth[n].double() - ref[n].double()).abs().max()) for n in ref), default=0.0),
            "loss_abs": max((abs(a - b) for a, b in zip(reference["losses"], other["losses"])), default=0.0)}


def dp_traffic(stats: dict, stage: int) -> tuple[float, bool]:
    """The last step's data-parallel traffic in units of Ψ (this rank's parameters), from an
    engine's stats: the elements handed to the gradient and parameter collectives (the norm's
    scalars and Pa's gathers left out), and whether it is the paper's 2Ψ (stages 0-2) or 3Ψ
    (stage 3, less the root's second gather that stage3_keep_root saves) up to the padding of
    the flat buffers. Zero when no collective ran."""
    by_purpose = stats["comm"]["last_step"]["by_purpose"]
    elements = sum(by_purpose.get(p, {}).get("elements", 0) for p in ("grads", "params"))
    k, padding = (3 if stage == 3 else 2), stats["padded_psi"] / stats["psi"]
    ratio = elements / stats["psi"]
    kept = stats.get("stage3", {}).get("root_kept_elements", 0)  # counted back in, in whole elements
    return ratio, k <= (elements + kept) / stats["psi"] <= k * padding * (1 + 1e-9)


def verdict(*checks: bool) -> str:
    return "PASS" if all(checks) else "FAIL"


def safe_row(name: str, make_row, *args) -> tuple[str, str, str, str]:
    """make_row(*args), or a FAIL row saying why it could not be built."""
    try:
        return make_row(*args)
    except Exception:
        return name, error_line(traceback.format_exc()), "a row", "FAIL"


def error_line(error: str) -> str:
    return error.strip().splitlines()[-1][:200].replace("|", "/")
