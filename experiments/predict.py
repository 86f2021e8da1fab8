"""The step-time model on any point, or on every point of a paper experiment; nothing is run.

    python experiments/predict.py model=gpt_1.3b gpus=64 stage=2 micro_batch=8
    python experiments/predict.py model.layers=48 model.hidden=4096 model.heads=32 gpus=128 tp=8 system=megatron2019 stage=0
    python experiments/predict.py experiment=fig2                 # the paper's Figure 2, as a table
    python experiments/predict.py experiment=fig4 format=json     # one JSON object per point
    python experiments/predict.py model=fig2_100b gpus=400 tp=16 format=kernels   # the kernels, FLOPs, bytes

It prints the step time, the TFLOPs/GPU (Narayanan Eq. 3) and the breakdown by term
(experiments/analysis/step_time.py). A point is run by `system=` (megatron2019, deepspeed2020,
pytorch_ddp, megatron_ds2023, zero_repro; default zero_repro); a paper experiment's points by
the system the paper ran each with, unless `system=` says otherwise. `cluster=` picks the profile
(dgx2_v100, dgx2h_v100, dgx_h100, dgx_a100, dgx_a100_800g; `local` once `make calibrate` has
measured this machine). megatron_ds2023 on dgx_a100 is the pair checked against measured A100 steps
(results/reference/reports/validation.md):

    python experiments/predict.py system=megatron_ds2023 cluster=dgx_a100 model.layers=24 model.hidden=1024 model.heads=16 gpus=8 tp=8 stage=0 micro_batch=2

Bad input is one line on stderr and exit code 2, before anything is predicted.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra
from omegaconf import DictConfig, OmegaConf

from experiments.analysis import step_time as st
from experiments.analysis.calibrated import cluster_hardware
from experiments.analysis.hardware import PROFILES, Hardware
from experiments.analysis.systems import SYSTEMS
from experiments.cli import preflight_or_exit
from experiments.points import ConfigError, Point, expand
from experiments.schema import SweepConfig, register

register()
FORMATS = ("table", "json", "kernels")   # kernels: one layer's and the head's kernel list
POINT_DEFAULTS = {"stage": 2, "gpus": 16, "tp": 1, "micro_batch": 8}   # a point's axes not given
PAPER_RUNS = ("fig2", "fig3", "fig4", "fig6", "fig7", "fig8", "table2")  # ran by the paper's systems; the rest by this engine


def _points(cfg: DictConfig) -> list[Point]:
    """The experiment's points, or the one point the overrides describe (points.expand checks them)."""
    base = {"train": cfg.train, "zero": cfg.zero, "cluster": cfg.cluster, "dry_run": True}
    given = {axis: cfg[axis] for axis in POINT_DEFAULTS if cfg[axis] is not None}
    if cfg.get("experiment") is not None:   # a given axis replaces the experiment's, as in sweep.py
        sweep = OmegaConf.merge(OmegaConf.structured(SweepConfig), {**base, **given, "experiment": cfg.experiment})
    else:
        point = {"model": cfg.model.name, **POINT_DEFAULTS, **given}
        sweep = OmegaConf.merge(OmegaConf.structured(SweepConfig),
                                {**base, "model": cfg.model, "experiment": {"name": "predict", "points": [point]}})
    return expand(sweep)


def targets(cfg: DictConfig) -> list[tuple[Point, st.StepInputs, str, str]]:
    """(point, inputs, system, ZeRO-R config) for every prediction; ConfigError on bad input."""
    from experiments.reports.predictions import paper_inputs, paper_system
    if cfg.format not in FORMATS:
        raise ConfigError(f"format must be one of {list(FORMATS)}, got {cfg.format!r}")
    if cfg.system is not None and cfg.system not in SYSTEMS:
        raise ConfigError(f"system must be one of {list(SYSTEMS)}, got {cfg.system!r}")
    if cluster_hardware(OmegaConf.to_container(cfg.cluster)) is None:
        raise ConfigError(f"cluster={cfg.cluster.name} has no step-time profile: use one of {list(PROFILES)}, or "
                          "cluster=local after `make calibrate`")
    out = []
    for point in _points(cfg):
        if cfg.get("experiment") is not None and cfg.experiment.name in PAPER_RUNS:
            paper = paper_system(point)
            x, system, zero_r = paper_inputs(point), cfg.system or paper["system"], paper["zero_r"]
        else:
            system = cfg.system or "zero_repro"
            x = st.point_inputs(point, system)
            zero_r = "Pa+cpu" if x.pa_cpu else "Pa" if x.pa else "-"
        if point.stage not in SYSTEMS[system].stages:
            raise ConfigError(f"point ({point.describe()}): stage must be one of {list(SYSTEMS[system].stages)} "
                              f"for system={system}, got {point.stage}")
        out.append((point, x, system, zero_r))
    return out


def prediction_row(point: Point, x: st.StepInputs, system: str, zero_r: str, hw: Hardware) -> dict:
    """One point's JSON object: the point, its series, and the prediction with its terms."""
    from experiments.models.gpt_shape import parameter_count
    pred = st.predict(x, hw, system)
    return {"model": point.model["name"], "label": point.model.get("label", ""),
            "params": parameter_count(point.shape, point.tp), "gpus": point.gpus, "tp": point.tp, "dp": point.dp,
            "stage": point.stage, "micro_batch": point.micro_batch, "system": system,
            "series": "baseline" if point.note.startswith("Baseline") else "ZeRO", "note": point.note,
            "zero_r": zero_r, **pred.as_dict()}


def _table(rows: list[dict]) -> str:
    columns = ("series", "model", "label", "gpus", "tp", "dp", "stage", "micro_batch", "zero_r", "system",
               "tflops_per_gpu_predicted", "step_s", "dominant")
    lines = [[str(c) for c in columns] + [f"{t} s" for t in st.TERMS]]
    for r in rows:
        lines.append([f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in columns]
                     + [f"{r['terms'][t]:.3f}" for t in st.TERMS])
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in lines)


def _kernels_text(kernels: list[dict]) -> str:
    lines = [f"{'phase':<10}{'kernel':<38}{'GFLOP':>10}{'MB':>10}{'GEMM eff':>10}{'us':>10}"]
    for k in kernels:
        eff = f"{k['gemm_efficiency']:.3f}" if k["gemm_efficiency"] is not None else "-"
        lines.append(f"{k['phase']:<10}{k['kernel']:<38}{k['gflops']:10.2f}{k['mb']:10.2f}{eff:>10}{k['us']:10.1f}")
    return "\n".join(lines)


def _point_text(r: dict) -> str:
    head = (f"{r['model']} ({r['params'] / 1e9:.2f}B params): {r['gpus']} GPUs, TP {r['tp']}, DP {r['dp']}, "
            f"stage {r['stage']}, micro-batch {r['micro_batch']}, system {r['system']}, on {r['hardware']}\n"
            f"step {r['step_s']:.3f} s, {r['tflops_per_gpu_predicted']:.1f} TFLOPs/GPU (dominant: {r['dominant']})")
    terms = [f"  {t:<22}{r['terms'][t]:10.4f} s {100 * r['terms'][t] / r['step_s']:5.1f}%" for t in st.TERMS]
    if r.get("dp_param_after_step_s"):   # of dp_comm_exposed: the post-step parameter all-gathers
        terms.insert(st.TERMS.index("dp_comm_exposed") + 1,
                     f"    post-step gather    {r['dp_param_after_step_exposed_s']:10.4f} s exposed of "
                     f"{r['dp_param_after_step_s']:.4f} s")
    return "\n".join([head, *terms])


@hydra.main(config_path="../conf", config_name="predict", version_base="1.3")
def main(cfg: DictConfig) -> None:
    hw = cluster_hardware(OmegaConf.to_container(cfg.cluster))
    rows = [prediction_row(*target, hw) for target in targets(cfg)]
    experiment = cfg.get("experiment") is not None
    if cfg.format == "json":
        print(json.dumps(rows if experiment else rows[0], indent=1, default=list))
    elif cfg.format == "kernels":
        for (point, x, system, _), row in zip(targets(cfg), rows):
            print(f"{point.describe()}: one layer and the head, per GPU, on {hw.name}, as {system} runs them")
            print(_kernels_text(st.kernel_table(x, hw, system)))
    else:
        print(_table(rows) if experiment else _point_text(rows[0]))


def _validate(cfg: DictConfig, remote: bool) -> None:
    hw = cluster_hardware(OmegaConf.to_container(cfg.cluster)) if cfg.format in FORMATS else None
    for point, x, system, _ in targets(cfg):
        try:   # a calibrated profile knows only the worlds it measured
            st.predict(x, hw, system)
        except ValueError as e:
            raise ConfigError(f"point ({point.describe()}) on cluster={cfg.cluster.name}: {e}") from None


if __name__ == "__main__":
    preflight_or_exit("predict", sys.argv[1:], _validate)
    main()
