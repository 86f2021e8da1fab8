"""The suite's one Hydra compose, as a fixture: `compose("experiment=fig4", "dry_run=true")`
gives the sweep config exactly as `experiments/sweep.py` would see it from the command line.

pytest puts this folder on sys.path (rootdir conftest, prepend import mode), so the tests in
tests/zero_impl/ and tests/experiments/ import `helpers` and `slurm_harness` from here.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import pytest
from hydra import compose as hydra_compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from experiments.points import CONF_DIR
from experiments.schema import register


def compose_sweep(*overrides: str) -> DictConfig:
    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="sweep", overrides=list(overrides))


@pytest.fixture
def compose() -> Callable[..., DictConfig]:
    return compose_sweep


@pytest.fixture(autouse=True)
def restore_environment():
    """Every test leaves os.environ as it found it. Code that runs as one rank of a launcher sets
    RANK/WORLD_SIZE in its process (experiments/sweeps/slurm_job.py); called in-process by a test,
    that would reach every later subprocess of the same xdist worker (`train.py gpus=1` then sees
    a launcher of 2 ranks: a verdict that depends on which tests ran before)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# A developer's own `make calibrate` profile (results/calibration/<host>.yaml) must change no
# verdict: the suite sees an empty calibration folder (tests that need a profile write their own).
os.environ["ZERO_REPRO_CALIBRATION_DIR"] = str(Path(__file__).resolve().parent / ".no_calibration")


# `make test-timing`: the suite's duration by tier, written where README.md pastes it from
# (ZERO_REPRO_TIMING=<file.md>; a plain `make test` writes nothing).
TIERS = (("every test", None), ("marked slow", "slow"), ("marked slurm (a real Slurm)", "slurm"),
         ("marked numerical", "numerical"))
_timing: dict = {"began": None, "tests": []}


def pytest_sessionstart(session) -> None:
    _timing["began"] = time.monotonic()


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" or (report.when == "setup" and report.skipped):
        _timing["tests"].append((set(report.keywords), report.outcome, report.duration))


def pytest_terminal_summary(terminalreporter) -> None:
    path = os.environ.get("ZERO_REPRO_TIMING")
    if not path or _timing["began"] is None:
        return
    wall = time.monotonic() - _timing["began"]
    workers = getattr(terminalreporter.config.option, "numprocesses", None) or 1
    lines = ["| tier | tests | passed | skipped | their time, summed (min) |", "|---|---|---|---|---|"]
    for name, marker in TIERS:
        chosen = [t for t in _timing["tests"] if marker is None or marker in t[0]]
        lines.append(f"| {name} | {len(chosen)} | {sum(t[1] == 'passed' for t in chosen)} "
                     f"| {sum(t[1] == 'skipped' for t in chosen)} | {sum(t[2] for t in chosen) / 60:.1f} |")
    lines.append(f"| wall clock, {workers} workers, {os.cpu_count()} cores | | | | {wall / 60:.1f} |")
    Path(path).write_text("\n".join(lines) + "\n")
