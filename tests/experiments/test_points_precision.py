"""train.precision=auto on CUDA decides by the current device's compute capability (mocked
here: the suite has no GPU)."""
from __future__ import annotations

import pytest
import torch

from experiments.points import resolve_precision


@pytest.mark.parametrize("capability, expected", [((7, 0), "fp16"), ((7, 5), "fp16"), ((8, 0), "bf16"),
                                                  ((9, 0), "bf16")])
def test_auto_precision_by_compute_capability_of_the_current_device(monkeypatch, capability, expected):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # set_device(local rank 3) ran before
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # as on sm_70: emulated bf16
    assert resolve_precision("auto") == expected
    assert asked == [3]  # the current device, never device 0 or the default (None)


def test_explicit_and_cpu_precisions(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_precision("auto") == "fp32"
    assert [resolve_precision(p) for p in ("fp16", "bf16", "fp32")] == ["fp16", "bf16", "fp32"]


def test_a_rank_resolves_its_precision_after_set_device(compose, monkeypatch, tmp_path):
    from experiments.points import expand
    from experiments.run import real

    calls = []

    class Stop(Exception):
        pass

    def init_process_group(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(real, "resolve_precision", lambda p: calls.append(("resolve_precision", p)) or "bf16")
    monkeypatch.setattr(real.dist, "init_process_group", init_process_group)
    monkeypatch.delenv("ZERO_REPRO_STOP_FILE", raising=False)
    for key, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}.items():
        monkeypatch.setenv(key, value)
    [point] = expand(compose("experiment=cpu_default", "model=tiny_s", "stage=2", "gpus=4", "tp=1", "micro_batch=2"))[:1]
    with pytest.raises(Stop):
        real.run_as_rank(point, tmp_path, "torchrun")
    assert calls == [("set_device", 3), ("resolve_precision", "auto")]
