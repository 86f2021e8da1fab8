"""ZeroConfig.force_collectives: a world of one sends every collective through its backend.

Without it a world of one issues nothing (a local copy stands for each collective); with it,
one GPU runs NCCL's streams and waits as a real world does (make gpu-check). Here on gloo at
world 1: the calls reach torch.distributed, counted there and in the ledger, and the training
is bit for bit the one without them (a sum over one rank, a gather of one shard, is a copy).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch.distributed as dist

import zero_impl
from helpers import adamw, make_model, max_abs_diff, zero_run
from experiments.launch import spawn

COLLECTIVES = ("all_reduce", "reduce_scatter_single", "all_gather_single")
LEDGER_KIND = {"all_reduce": "all_reduce", "reduce_scatter_single": "reduce_scatter",
               "all_gather_single": "all_gather"}
USED = {0: {"all_reduce"}, 1: set(COLLECTIVES), 2: set(COLLECTIVES), 3: set(COLLECTIVES)}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_world_of_one_issues_collectives_with_identical_results(stage):
    local, forced = spawn(_local_and_forced, 1, stage, timeout=120)[0]
    assert not any(local["dist_calls"].values()) and local["ledger_calls"] == {}
    assert {name for name, n in forced["dist_calls"].items() if n} == USED[stage]
    for name in USED[stage]:  # every call the ledger counts really went to torch.distributed
        assert forced["ledger_calls"][LEDGER_KIND[name]] == forced["dist_calls"][name]
    assert max_abs_diff(local["params"], forced["params"]) == 0.0
    assert local["losses"] == forced["losses"] and local["norms"] == forced["norms"]


def _local_and_forced(stage: int) -> tuple[dict, dict]:
    return tuple(_counted_run(stage, force) for force in (False, True))


def _counted_run(stage: int, force: bool) -> dict:
    calls = dict.fromkeys(COLLECTIVES, 0)
    saved = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name):
        def call(*args, **kwargs):  # the engine's calls only (zero_run all-reduces its losses itself)
            calls[name] += sys._getframe(1).f_code.co_filename.endswith(os.path.join("zero_impl", "comm.py"))
            return saved[name](*args, **kwargs)
        return call

    for name in COLLECTIVES:
        setattr(dist, name, counting(name))
    try:
        out = zero_run(3, 2, stage=stage, precision="fp64", reduce_bucket_size=500, clip_grad_norm=0.28,
                       force_collectives=force)
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    by_kind = out["stats"]["comm"]["total"]["by_kind"]
    return {"params": out["params"], "losses": out["losses"], "norms": out["norms"], "dist_calls": calls,
            "ledger_calls": {kind: row["calls"] for kind, row in by_kind.items() if row["calls"]}}


def test_force_collectives_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="force_collectives"):
        zero_impl.initialize(make_model(), zero_impl.ZeroConfig(stage=2, force_collectives=True), adamw)
    with pytest.raises(ValueError, match="force_collectives must be true or false"):
        zero_impl.ZeroConfig(force_collectives="yes")
