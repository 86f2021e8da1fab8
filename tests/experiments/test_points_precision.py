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


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_predicted_model_states_take_the_engines_bytes_per_element(compose, precision):
    """Table 1's prediction at the engine's own dtypes: bf16 keeps fp32 gradients (G = 4, not the
    paper's fp16 2), fp32 has no separate master (K = 8)."""
    import zero_impl
    from experiments.models.gpt_shape import parameters_per_tp_rank
    from experiments.points import expand, predicted_model_state_bytes
    point = expand(compose("model=tiny_s", "stage=2", "gpus=[4]", "dry_run=true"))[0]
    predicted, psi = predicted_model_state_bytes(point, precision), parameters_per_tp_rank(point.shape, point.tp)
    engine = zero_impl.initialize(torch.nn.Linear(8, 8), zero_impl.ZeroConfig(stage=2, precision=precision),
                                  optimizer=lambda groups: torch.optim.AdamW(groups))
    engine.backward(engine(torch.randn(2, 8, dtype=zero_impl.DTYPES[precision])).float().square().mean())
    engine.step()   # Adam's moments exist from here on
    per = engine.bytes_per_param()
    engine.close()
    assert per["grads"] == {"fp16": 2, "bf16": 4, "fp32": 4}[precision]
    assert predicted["params"] == psi * per["params"]                        # replicated at stage 2
    assert predicted["grads"] == pytest.approx(psi * per["grads"] / 4)       # partitioned over DP 4
    assert predicted["optimizer_states"] == pytest.approx(psi * per["optimizer_states"] / 4)
