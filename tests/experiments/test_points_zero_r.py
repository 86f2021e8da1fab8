"""ZeRO-R in the suite's configs: the paper's experiments run their Table 3 configurations,
bad ZeRO-R settings are refused by name, point ids stay stable, and a CPU point records its
configuration and Pa's traffic (the library side is tests/zero_impl/test_zero_r.py)."""
from __future__ import annotations

import pytest

from zero_impl import ZERO_R_CONFIGS, zero_r_config

NONE = {"partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False}


@pytest.mark.parametrize("experiment", ["fig2", "fig6", "fig7", "fig8"])
def test_paper_experiments_run_their_table3_configurations(compose, experiment):
    from experiments.points import expand
    cfg = compose(f"experiment={experiment}", "dry_run=true")
    specs, points = list(cfg.experiment.points), expand(cfg)
    assert len(specs) == len(points) and "not implemented" not in cfg.experiment.description
    for spec, point in zip(specs, points):
        switches = {k: point.zero[k] for k in NONE}
        if not spec.zero_r and spec.note.endswith(" no MD"):  # fig7's MD-off twins: their configuration less MD
            assert experiment == "fig7" and zero_r_config(point.stage, **switches) is None
            config = spec.note.removesuffix(" no MD")
            assert {"stage": point.stage, **switches} == dict(ZERO_R_CONFIGS[config], contiguous_memory_optimization=False)
            continue
        if not spec.zero_r:  # Figure 2's Megatron baselines
            assert spec.note == "Baseline" and switches == NONE and point.stage == 0
            continue
        assert experiment == "fig2" or spec.note.startswith(spec.zero_r)   # the row the mapping gives it
        assert {"stage": point.stage, **switches} == ZERO_R_CONFIGS[spec.zero_r]
        assert zero_r_config(point.stage, **switches) == spec.zero_r
        assert point.train["recompute"] and (point.tp > 1 or not switches["partition_activations"])


def test_point_validation_names_the_key(compose):
    from omegaconf import OmegaConf
    from experiments.points import ConfigError, expand
    with pytest.raises(ConfigError, match=r"zero.contiguous_memory_optimization \(zero_r C1\) acts on activation "
                                          r"checkpoints: it needs train.recompute=true"):
        expand(compose("experiment=fig6", "train.recompute=false"))
    with pytest.raises(ConfigError, match="zero.cpu_checkpointing .* needs partition_activations=true"):
        expand(compose("zero.cpu_checkpointing=true"))
    with pytest.raises(ConfigError, match="zero.partition_activations acts on .* needs train.recompute=true"):
        expand(compose("zero.partition_activations=true", "train.recompute=false"))
    for zero_r, stage, message in (("C9", 1, r"zero_r must be one of \['C1', 'C2', 'C3', 'C4', 'C5'\]"),
                                   ("C1", 2, r"C1 is stage 1 \(Table 3\), the point says stage 2")):
        cfg = compose("experiment=fig6")
        from experiments.schema import PointSpec
        cfg.experiment.points = [OmegaConf.structured(PointSpec(model="tiny_s", stage=stage, gpus=2, tp=2,
                                                                 micro_batch=2, zero_r=zero_r))]
        with pytest.raises(ConfigError, match=message):
            expand(cfg)


def test_point_ids_without_zero_r_are_unchanged(compose):
    """Knobs added after the first records stay out of a point's hash at the values that behave
    as the engine did before them (no ZeRO-R, the whole-shard optimizer step): such a point keeps
    the id it had before they existed; any other value gets another id, the chunked step's
    default included (its peak may differ from an earlier record's)."""
    import dataclasses
    from experiments.points import LATER_KNOB_DEFAULTS, expand
    for point in expand(compose("model=tiny_s")):
        before = dataclasses.replace(point, zero={k: v for k, v in point.zero.items() if k not in LATER_KNOB_DEFAULTS})
        as_before = dataclasses.replace(point, zero=dict(point.zero, **LATER_KNOB_DEFAULTS))
        assert as_before.point_id == before.point_id != point.point_id
        assert dataclasses.replace(as_before, zero=dict(as_before.zero, partition_activations=True)).point_id \
            != as_before.point_id


def test_a_cpu_point_records_its_configuration(compose, tmp_path):
    """A TP 2 point of the CPU suite through train.py with C4's switches: the record says C4,
    carries Pa's traffic, and autograd's census of saved bytes shows the slices (tiny_s: 2
    layers, s·b·h = 64·2·64, fp32: the C4 run saves 2 x 64·2·64·4 / 2 bytes less)."""
    from experiments import sweep
    from experiments.records import load_records
    common = ["model=tiny_s", "gpus=2", "tp=2", "micro_batch=2", "train.warmup_steps=0", "train.steps=2",
              f"results_dir={tmp_path}"]
    for switches in ([], ["stage=2", "zero.partition_activations=true", "zero.contiguous_memory_optimization=true"]):
        assert sweep.run_sweep(compose(*common, *(switches or ["stage=2"]))) == 0
    records = {r["zero_r_config"]: r for r in load_records(tmp_path, "cpu_default")}
    assert set(records) == {None, "C4"} and all(r["status"] == "ok" for r in records.values())
    sbh = 64 * 2 * 64
    c4, plain = records["C4"], records[None]
    assert c4["comm"]["by_purpose"]["activations"] == {"calls": 2, "elements": 2 * sbh, "bytes": 2 * sbh * 4}
    assert "activations" not in plain["comm"]["by_purpose"]
    saved = plain["memory"]["measured"]["activations_saved"] - c4["memory"]["measured"]["activations_saved"]
    assert saved == 2 * sbh * 4 // 2
