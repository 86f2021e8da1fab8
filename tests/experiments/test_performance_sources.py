"""docs/performance_sources.md lists every sourced constant of the step-time model as
experiments/analysis/hardware.py has it: value (from conf/cluster) and source text."""
from __future__ import annotations

from experiments.analysis.hardware import PROFILE_KEYS, PROFILES, SOURCES, load_cluster
from experiments.records import REPO


def test_every_profile_constant_and_its_source_is_on_the_page():
    page = (REPO / "docs" / "performance_sources.md").read_text()
    for name in PROFILES:
        conf = load_cluster(name)
        for key in PROFILE_KEYS:
            row = f"| `{key}` | {conf[key]:g} | {SOURCES[f'{name}.{key}'].replace('|', '/')} |"
            assert row in page, f"{name}.{key}: docs/performance_sources.md is stale"
    assert SOURCES["nccl"] in page
