"""No command rewrites a committed file: a user's run writes under a folder git ignores, and the
committed reference set (results/reference/) changes only through the Makefile's reference
targets, which say so in their names."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from experiments import bench_proxies
from experiments.analysis.calibrated import CALIBRATION_DIR
from experiments.points import CONF_DIR
from experiments.reports import host_ops
from experiments.schema import register

REPO = Path(__file__).resolve().parents[2]


def _git(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    if done.returncode == 128:  # no git, or not a checkout
        pytest.skip("not a git checkout")
    return done


def _app_default(config: str, key: str) -> Path:
    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return REPO / compose(config_name=config)[key]


def default_outputs() -> dict[str, Path]:
    """Where each command writes when it is given no path."""
    return {"make proxies (bench_proxies)": bench_proxies.DEFAULT_OUT,
            "host_ops --time": host_ops.TIMED_OUT,
            "make calibrate": CALIBRATION_DIR / "host.yaml",  # default_path() without the suite's own folder
            **{f"{app}.py results_dir": _app_default(app, "results_dir") for app in ("sweep", "train", "plan")},
            "report.py out_dir": _app_default("report", "out_dir")}


def test_every_command_writes_under_an_ignored_folder_by_default():
    for command, path in default_outputs().items():
        where = path.relative_to(REPO)
        if not where.suffix:  # a folder: what lands in it (a folder may not exist yet, so no trailing-slash match)
            where = where / "written.json"
        assert _git("check-ignore", "--no-index", "-q", str(where)).returncode == 0, f"{command} writes {where}, not ignored"
        assert not _git("ls-files", str(where)).stdout, f"{command} writes {where}, which git tracks"


# Targets that regenerate a committed file, by name: make reference*, and make test-timing (the
# README's table of test durations, results/reference/reports/test_suite.md).
def _writes_committed(target: str) -> bool:
    return target.startswith("reference") or target == "test-timing"


def test_only_the_reference_targets_touch_the_committed_results():
    makefile = (REPO / "Makefile").read_text()
    phony = next(line for line in makefile.splitlines() if line.startswith(".PHONY:")).split()[1:]
    assert {"reference", "reference-plans", "reference-proxies", "reference-bench", "reference-host-time"} <= set(phony)
    for target in phony:
        if _writes_committed(target):
            continue
        # -n prints the recipe of the target and of what it needs, running nothing
        done = subprocess.run(["make", "-n", "-o", "setup", target], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert "results/reference" not in done.stdout, f"make {target} writes under results/reference:\n{done.stdout}"
    for target in ("reference-proxies", "reference-bench"):  # the committed tables keep DeepSpeed's rows
        recipe = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True).stdout
        assert "[test,compare]" in recipe and "results/reference/bench/" in recipe and "reports.pasted" in recipe
