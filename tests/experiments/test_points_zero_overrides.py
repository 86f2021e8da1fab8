"""A point's own zero overrides (the optimizer step's chunking, experiments/points.py): the paper's
baselines step the whole shard, overrides are checked by name, sizes are integers."""
from __future__ import annotations

import pytest

import zero_impl


def test_paper_baselines_step_the_whole_shard(compose):
    """The paper's baselines are modelled with the whole model in one update (a point's own zero
    override); Table 2 searches each one a second time with the default chunked update, and
    every other point keeps the default."""
    from experiments.points import expand
    for experiment in ("fig2", "fig4", "table2"):
        for point in expand(compose(f"experiment={experiment}", "dry_run=true")):
            whole = point.stage == 0 and "chunked step" not in point.note
            expected = None if whole else zero_impl.ZeroConfig.optimizer_bucket_size
            assert point.zero["optimizer_bucket_size"] == expected, (experiment, point.describe())
    table2 = expand(compose("experiment=table2", "dry_run=true"))
    assert sum("chunked step" in p.note for p in table2) == sum(p.stage == 0 for p in table2) // 2 == 5


@pytest.mark.parametrize("override,zero_r,message", [
    ({"bogus_size": 1}, "", r"zero override\(s\) \['bogus_size'\] are not a point's engine knobs; allowed: .*optimizer_bucket_size"),
    ({"optimizer_bucket_size": 0}, "", r"point \(fig4_1.38b, stage 0\): zero.optimizer_bucket_size must be an integer >= 1, got 0"),
    ({"stage": 3}, "", r"\['stage'\] are not a point's engine knobs"),
    ({"grad_accum_steps": 2}, "", r"\['grad_accum_steps'\] are not a point's engine knobs"),  # a train.* setting
    ({"contiguous_memory_optimization": False}, "C3", r"zero_r C3 sets the ZeRO-R switches"),
])
def test_a_points_zero_override_is_checked_by_name(compose, override, zero_r, message):
    from experiments.points import ConfigError, expand
    cfg = _table2_with_first_point(compose, zero=override, **({"zero_r": zero_r, "stage": 2} if zero_r else {}))
    with pytest.raises(ConfigError, match=message):
        expand(cfg)


def test_a_points_sizes_are_integers_whatever_the_yaml_wrote(compose):
    from experiments.points import expand
    written, typed = (expand(_table2_with_first_point(compose, zero={"optimizer_bucket_size": v}))[0] for v in (2e7, 20000000))
    assert written.zero["optimizer_bucket_size"] == 20000000 and written.point_id == typed.point_id


def _table2_with_first_point(compose, **changes):
    from omegaconf import OmegaConf
    cfg = compose("experiment=table2", "dry_run=true")
    OmegaConf.update(cfg, "experiment.points", [dict(OmegaConf.to_container(cfg.experiment.points[0]), **changes)])
    return cfg


def test_stage3_keep_root_is_a_key_and_false_is_another_point(compose):
    """zero.stage3_keep_root=false (the paper's schedule, 3Ψ) is accepted from the command line and
    is another point than the default, whose id stays the one its committed records carry."""
    from experiments.points import expand
    default, kept, paper = (expand(compose("model=tiny_s", "stage=3", "gpus=2", *extra))[0]
                            for extra in ((), ("zero.stage3_keep_root=true",), ("zero.stage3_keep_root=false",)))
    assert default.zero["stage3_keep_root"] is True and paper.zero["stage3_keep_root"] is False
    assert default.point_id == kept.point_id != paper.point_id
    config = zero_impl.ZeroConfig(stage=3, **paper.zero)
    assert config.stage3_keep_root is False
