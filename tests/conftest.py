"""The suite's one Hydra compose, as a fixture: `compose("experiment=fig4", "dry_run=true")`
gives the sweep config exactly as `experiments/sweep.py` would see it from the command line.

pytest puts this folder on sys.path (rootdir conftest, prepend import mode), so the tests in
tests/zero_impl/ and tests/experiments/ import `helpers` and `slurm_harness` from here.
"""
from __future__ import annotations

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
