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
