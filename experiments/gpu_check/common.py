"""What every `make gpu-check` row shares: the point a row trains, a call that cannot raise, and
the verdict and error cells of the table."""
from __future__ import annotations

import traceback

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from experiments.points import CONF_DIR
from experiments.run.real import point_from_train_config
from experiments.schema import register

SKIPPED = "gpu-check: skipped, no CUDA device here (torch.cuda.is_available() is False)"
BUDGET_S = 470  # the whole check, start-ups included


def make_point(*overrides: str):
    """A point of experiments/train.py from its Hydra overrides, validated as train.py does."""
    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return point_from_train_config(compose("train", overrides=["experiment_name=gpu_check", "gpus=1", *overrides]))


def attempt(fn, *args) -> dict:
    try:
        return {"ok": True, "value": fn(*args)}
    except Exception:
        return {"ok": False, "error": traceback.format_exc()}


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
