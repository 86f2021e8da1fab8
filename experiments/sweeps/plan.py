"""Plan a run before booking the cluster: every configuration a user could run for one model on
`gpus` GPUs, its memory and its predicted speed, best first (experiments/plan.py is the CLI).

1. Candidates: ZeRO stage x TP degree (dividing the heads, the hidden size and the GPUs, within
   one node) x micro-batch x recomputation on/off x ZeRO-R (none; Pa and Pa+cpu where TP > 1,
   which act on the recomputation's checkpoints). A fixed global batch keeps the candidates
   whose micro-batch x DP divides it, accumulation filling the rest. A DeepSpeed JSON
   (deepspeed_config=) fixes what it sets (points.expand applies it).
2. Each is priced at once by the analytic memory model (points.predicted_memory_bytes, Table 2
   within a few percent of the simulated rank) and the step-time model (analysis/step_time.py,
   the same call as predict.py).
3. The analytic model prunes: a candidate above the device's limit by more than ANALYTIC_MARGIN
   is never simulated. The simulated rank confirms: in order of predicted speed, candidates
   are simulated at full world size (one rank on fake tensors, run/fake.py, `workers` at a
   time, as the `largest` search does) until `confirm` of them fit or `max_simulations` ran.
   Its event log is replayed through PyTorch's CUDA caching allocator (experiments/allocator):
   a confirmed row fits on the bytes the allocator would *reserve* (segments, cached and split
   blocks included) on the device less the CUDA context, so it rests on the real code path,
   not a ledger. Where torch's default allocator options do not fit and
   expandable_segments:True does, the row fits with that, and its commands set
   PYTORCH_CUDA_ALLOC_CONF. A row not replayed (most rows) fits on its tensor peak times the
   plan's reserve factor (reserve_factor: the largest reserved / tensor peak of its replayed
   rows that fit, at least 1), `reserved_source` analytic+margin; in a plan with no replayed row, on its tensor peak,
   `reserved_source` unconfirmed.
4. Rows: those that fit first (a simulated verdict over an analytic one), fastest first (tokens
   per second, the whole job's); then
   the rest by peak, so a user sees why. Each row carries the train.py overrides that run it
   (the same point, point_id and all) and the sbatch line, and the step-time model's expected
   error for its (TP, micro-batch) regime, its median miss on measured A100 steps
   (analysis/expected_error.py), where that was validated: system megatron_ds2023 on dgx_a100,
   TP within one node; elsewhere "not validated". Where the next rows are predicted within the
   model's p90 error on step-time ratios between TP degrees of the best, the plan says the model
   cannot order them.
"""
from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import json
import re
import shlex
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from experiments.analysis import step_time as st
from experiments.analysis.calibrated import cluster_hardware
from experiments.analysis.expected_error import expected_error, pair_ratio_p90
from experiments.models.gpt_shape import parameter_count
from experiments.analysis.hardware import load_cluster
from experiments.commands import python_command, train_command
from experiments.launch import default_workers
from experiments.points import (CONF_DIR, LATER_MODEL_DEFAULTS, SHAPE_KEYS, ConfigError, Point, available_models,
                                expand, load_model, predicted_memory_bytes, shaped_model, simulated_precision)
from experiments.run.record import verdict
from experiments.schema import ClusterConfig, ModelConfig, PlanConfig, SweepConfig, TrainSettings, ZeroSettings
from zero_impl import DeepSpeedConfig, DeepSpeedConfigError, parse_deepspeed

ANALYTIC_MARGIN = 0.10   # simulate candidates up to 10% over the limit analytically: the analytic model's error
ZERO_R = {"-": {}, "Pa": {"partition_activations": True},
          "Pa+cpu": {"partition_activations": True, "cpu_checkpointing": True}}
CSV_COLUMNS = ("rank", "stage", "tp", "dp", "micro_batch", "grad_accum", "global_batch", "recompute", "zero_r",
               "fits", "peak_gb", "reserved_gb", "reserved_source", "fragmentation", "alloc_conf", "peak_source", "limit_gb", "headroom_gb", "states_gb", "activations_gb", "peak_phase",
               "tflops_per_gpu_predicted", "tokens_per_s_predicted",
               "step_s_predicted", "dominant", "expected_error", "expected_error_regime", "point_id", "overrides",
               "command", "sbatch")


@dataclasses.dataclass
class Candidate:
    """One configuration: its point, its analytic peak and predicted step, and once simulated
    its simulated peak."""

    point: Point
    zero_r: str
    precision: str
    limit: float
    analytic: dict                 # points.predicted_memory_bytes: total and its parts
    step: st.StepTime | None
    simulated_peak: float | None = None
    reserved: dict | None = None   # the simulated record's memory.allocator: the caching allocator's replay
    simulation_error: str | None = None
    deepspeed_config: str = ""     # the JSON the plan was made under: the printed commands pass it on
    reserve_factor: float | None = None  # the plan's (reserve_factor()), for a row not replayed

    @property
    def analytic_peak(self) -> float:
        return self.analytic["total"]

    @property
    def tensor_peak(self) -> float:
        return self.analytic_peak if self.simulated_peak is None else self.simulated_peak

    @property
    def alloc_conf(self) -> str:
        """PYTORCH_CUDA_ALLOC_CONF the row runs with: expandable segments where only they fit."""
        r = self.reserved
        if r and r["oom"] and not r["expandable"]["oom"] and r["expandable"]["reserved_peak_bytes"] <= self.limit:
            return r["expandable"]["conf"]
        return r["conf"] if r else ""

    @property
    def replayed(self) -> dict | None:
        """The allocator's replay under alloc_conf (None: not simulated, or a record without one)."""
        r = self.reserved
        return None if r is None else r["expandable"] if self.alloc_conf != r["conf"] else r

    @property
    def reserved_source(self) -> str:
        """Where `peak` comes from: the allocator's replay, the tensor peak times the plan's reserve
        factor, or the tensor peak alone where the plan replayed nothing to take a factor from."""
        if self.replayed is not None:
            return "replayed"
        return "unconfirmed" if self.reserve_factor is None else "analytic+margin"

    @property
    def peak(self) -> float:
        """What must fit: the reserved peak (module docstring, 3.), or the tensor peak when unconfirmed.
        A replay that ran out of memory stopped at the device, short of what the run needs: the row
        shows its replay on an unbounded device (run/reserved.py: the cache's high-water mark with
        no retry, an upper reading), at least its tensors and over the limit, as the replay decided
        (else a row would not fit with headroom left, or reserve less than its tensors)."""
        replayed = self.replayed
        if replayed is not None and replayed["oom"]:
            unbounded = self.reserved.get("unbounded", {}).get("reserved_peak_bytes", 0)  # records before it had none
            return max(unbounded, self.tensor_peak, self.limit + 1)
        if replayed is not None:
            return replayed["reserved_peak_bytes"]
        return self.tensor_peak * (self.reserve_factor or 1.0)

    @property
    def fits(self) -> bool:
        replayed = self.replayed
        return self.simulation_error is None and self.peak <= self.limit and not (replayed and replayed["oom"])

    @property
    def speed(self) -> float:
        """Tokens per second predicted, the whole job (0 where the cluster has no step-time
        profile): what a user feels. TFLOPs/GPU would rank a run without recomputation below
        one with it, as Eq. 3 counts the recomputed forward's FLOPs."""
        return self.point.global_batch * self.point.shape.seq_len / self.step.step_s if self.step else 0.0

    @property
    def worth_simulating(self) -> bool:
        return self.simulated_peak is None and self.simulation_error is None \
            and self.analytic_peak <= self.limit * (1 + ANALYTIC_MARGIN)


def tp_degrees(cfg: DictConfig, gpus_per_node: int) -> list[int]:
    """TP degrees megatron can split the model by (heads and hidden) whose groups stay inside a
    node (TP groups are consecutive ranks: the degree divides the GPUs a node holds of the job);
    of those, the ones `tps` lists when it is given."""
    from experiments.points import shape_of
    shape = shape_of(OmegaConf.to_container(cfg.model))
    out = []
    for tp in range(1, min(gpus_per_node, cfg.gpus) + 1):
        try:
            shape.check_tp(tp)
        except ValueError:
            continue
        if min(cfg.gpus, gpus_per_node) % tp == 0 and (cfg.tps is None or tp in cfg.tps):
            out.append(tp)
    return out


def _cluster(cfg: DictConfig) -> dict:
    cluster = OmegaConf.to_container(cfg.cluster)
    for key in ("device_memory_gb", "gpus_per_node"):
        if cfg[key] is not None:
            cluster[key] = cfg[key]
    return cluster


def check_plan_config(cfg: DictConfig) -> None:
    """Reject a plan that cannot be made, naming the key (before anything is enumerated)."""
    cluster = _cluster(cfg)
    if cluster.get("device_memory_gb") is None:
        raise ConfigError(f"cluster={cluster['name']} has no device_memory_gb: give device_memory_gb=<GB per GPU>")
    if not cluster.get("gpus_per_node"):
        raise ConfigError(f"cluster={cluster['name']} has no gpus_per_node: give gpus_per_node=<GPUs per node>")
    for key in ("gpus", "confirm", "max_simulations", "top"):
        if isinstance(cfg[key], bool) or not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ConfigError(f"{key} must be a positive integer, got {cfg[key]!r}")
    per_node = cluster["gpus_per_node"]
    if cfg.gpus > per_node and cfg.gpus % per_node:
        raise ConfigError(f"gpus={cfg.gpus} is not a whole number of nodes of {per_node} GPUs (gpus_per_node): "
                          "slurm/launch.sh runs the same number of ranks on every node")
    if cfg.global_batch is not None and cfg.global_batch < 1:
        raise ConfigError(f"global_batch must be a positive integer, got {cfg.global_batch!r}")
    for key, allowed in (("stages", (0, 1, 2, 3)), ("recompute", (True, False))):
        if not cfg[key] or any(v not in allowed for v in cfg[key]):
            raise ConfigError(f"{key} must be a non-empty list of {list(allowed)}, got {list(cfg[key])}")
    if not cfg.micro_batches or any(isinstance(v, bool) or v < 1 for v in cfg.micro_batches):
        raise ConfigError(f"micro_batches must be a non-empty list of positive integers, got {list(cfg.micro_batches)}")
    if cfg.tps is not None and not tp_degrees(cfg, cluster["gpus_per_node"]):
        raise ConfigError(f"tps={list(cfg.tps)}: none splits {cfg.model.name} (heads {cfg.model.heads}) over gpus={cfg.gpus} "
                          f"within a node of {cluster['gpus_per_node']}")
    if cfg.system not in st.SYSTEMS:
        raise ConfigError(f"system must be one of {list(st.SYSTEMS)}, got {cfg.system!r}")


def experiment_name(cluster: dict) -> str:
    """The plan's points' experiment, per cluster: a point's id leaves the cluster out, and
    "auto" precision resolves by it (fp16 on V100, bf16 after), so a V100 plan's simulated
    record must never stand for an H100's. train.py writes the same folder for the same point."""
    return f"plan_{cluster['name']}"


@functools.cache
def _deepspeed(path: str) -> DeepSpeedConfig | None:
    """The plan's DeepSpeed JSON, read once (candidates and every printed command use it)."""
    if not path:
        return None
    try:
        return parse_deepspeed(path)
    except DeepSpeedConfigError as e:
        raise ConfigError(str(e)) from None


def candidate_points(cfg: DictConfig) -> list[tuple[Point, str]]:
    """Every configuration (module docstring, 1.) as a validated Point, with its ZeRO-R name. A
    DeepSpeed JSON's batch keys keep the TP degrees whose DP its batch rule divides, and its
    activation_checkpointing block the ZeRO-R configuration."""
    cluster = _cluster(cfg)
    tps = tp_degrees(cfg, cluster["gpus_per_node"])
    deepspeed = _deepspeed(cfg.deepspeed_config)
    if deepspeed is not None:
        if cfg.global_batch is not None and (deepspeed.train_batch_size or deepspeed.grad_accum_steps
                                             or deepspeed.micro_batch):
            raise ConfigError(f"global_batch={cfg.global_batch} and deepspeed_config {deepspeed.source}'s batch keys "
                              "(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps): "
                              "set the batch in one place")
        defaults = PlanConfig()
        fixed = [("stages", "zero_optimization.stage", True), ("micro_batches", "train_micro_batch_size_per_gpu",
                                                               deepspeed.micro_batch is not None or deepspeed.train_batch_size)]
        for key, deepspeed_key, sets in fixed:
            if sets and list(cfg[key]) != getattr(defaults, key):
                raise ConfigError(f"{key}={list(cfg[key])} and deepspeed_config {deepspeed.source}'s {deepspeed_key}: "
                                  "the JSON fixes it; drop one")
        tps = [tp for tp in tps if _batch_rule_holds(deepspeed, cfg.gpus // tp)]
        if not tps:
            raise ConfigError(f"deepspeed_config {deepspeed.source}: its train_batch_size divides no DP degree of "
                              f"{cfg.gpus} GPUs with TP in {tp_degrees(cfg, cluster['gpus_per_node'])}")
    out: dict[str, tuple[Point, str]] = {}
    for recompute in cfg.recompute:
        for zero_r, switches in ZERO_R.items():
            if switches and not recompute:
                continue  # Pa and Pa+cpu partition the recomputation's checkpoints
            if deepspeed is not None and any(getattr(deepspeed.zero, k) != switches.get(k, False)
                                             for k in ("partition_activations", "cpu_checkpointing")
                                             if k in deepspeed.decides):
                continue  # the JSON's activation_checkpointing block decides ZeRO-R (no block: the plan does)
            sweep = OmegaConf.merge(OmegaConf.structured(SweepConfig), {
                "model": cfg.model, "cluster": cluster, "dry_run": True,
                **({"deepspeed_config": cfg.deepspeed_config} if cfg.deepspeed_config else {}),
                "train": OmegaConf.merge(cfg.train, {"recompute": recompute}),
                "zero": OmegaConf.merge(cfg.zero, switches),
                "experiment": {"name": experiment_name(cluster), "grid": {
                    "model": [cfg.model.name], "stage": list(cfg.stages), "gpus": [cfg.gpus],
                    "tp": [tp for tp in tps if tp > 1 or not switches], "micro_batch": list(cfg.micro_batches)}}})
            if not sweep.experiment.grid.tp:
                continue
            for point in expand(sweep):
                # "auto" would hash by the host that computes the id (points.Point.point_id): the
                # plan runs on a login node, its points on GPU nodes; the cluster decides instead
                point = dataclasses.replace(point, train=dict(point.train, precision=simulated_precision(point)))
                if cfg.global_batch is not None:
                    per_step = point.micro_batch * point.dp
                    if cfg.global_batch % per_step:
                        continue
                    point = dataclasses.replace(point, train=dict(point.train, grad_accum_steps=cfg.global_batch // per_step))
                out.setdefault(point.point_id, (point, zero_r))
    if not out:
        why = [f"TP in {tps}", f"stages={list(cfg.stages)}", f"recompute={list(cfg.recompute)}"]
        if cfg.global_batch is not None:
            why.append(f"micro-batch x DP dividing global_batch={cfg.global_batch} (micro_batches={list(cfg.micro_batches)})")
        if deepspeed is not None and "partition_activations" in deepspeed.decides:
            why.append(f"deepspeed_config's ZeRO-R (Pa needs TP > 1 and recomputation)")
        raise ConfigError(f"no configuration of {cfg.model.name} on {cfg.gpus} GPUs is left: {'; '.join(why)}")
    return list(out.values())


def _batch_rule_holds(deepspeed: DeepSpeedConfig, dp: int) -> bool:
    try:
        deepspeed.batch_for(dp)
    except DeepSpeedConfigError:
        return False
    return True


def price(points: list[tuple[Point, str]], system: str) -> list[Candidate]:
    """Each point's analytic peak and predicted step (analysis/step_time.py, as predict.py)."""
    out = []
    hw = cluster_hardware(points[0][0].cluster) if points else None   # one cluster per plan
    for point, zero_r in points:
        precision = simulated_precision(point)
        v = verdict(point, 0)
        limit = v["device_bytes"] - v["cuda_reserve_bytes"]
        step = st.predict(st.point_inputs(point, system), hw, system) if hw and point.stage in st.SYSTEMS[system].stages else None
        out.append(Candidate(point, zero_r, precision, limit, predicted_memory_bytes(point, precision), step))
    return out


def ranked(candidates: list[Candidate]) -> list[Candidate]:
    """Fits first, fastest first (a simulated fit before an analytic one at the same speed),
    then the rest by peak."""
    return sorted(candidates, key=lambda c: (not c.fits, -c.speed if c.fits else c.peak, c.simulated_peak is None,
                                             c.point.tp, c.point.stage, c.peak))


def reserve_factor(candidates: list[Candidate]) -> float | None:
    """What a row not replayed multiplies its tensor peak by to stand for what the allocator
    reserves: the largest ratio of reserved to tensor peak among the plan's replayed rows that fit
    (None: none did), at least 1. Those that fit: their replay ran as a GPU would (freeing its
    cache and retrying where the device filled), so the ratio is what a fitting run reserves; one
    that ran out of memory stops at the device, and its unbounded replay never frees its cache,
    so neither says what a run needs. The largest, not a mean: the rows not replayed are other
    stages and micro-batches, whose fragmentation the plan did not measure."""
    ratios = [c.replayed["reserved_peak_bytes"] / c.simulated_peak
              for c in candidates if c.replayed and c.simulated_peak and c.fits]
    return max(1.0, *ratios) if ratios else None


def confirm(candidates: list[Candidate], results_dir: Path, *, wanted: int, max_simulations: int,
            workers: int, rank: int = 0, progress=None) -> int:
    """Simulate the fastest candidates worth it until `wanted` fit (module docstring, 3.); an
    existing simulated record of the same point is reused. Returns the simulations run."""
    from experiments.sweeps.simulated import done_record, run_simulated  # after the preflight: megatron-core
    ran = 0
    while True:
        queue = [c for c in sorted(candidates, key=lambda c: -c.speed) if c.worth_simulating]
        confirmed = sum(c.fits and c.simulated_peak is not None for c in candidates)
        if confirmed >= wanted or not queue or ran >= max_simulations:
            return ran
        batch = queue[:min(max(1, workers), max_simulations - ran, wanted - confirmed)]
        todo = []
        for c in batch:
            record = done_record(results_dir, c.point, rank)
            if record and record.get("memory", {}).get("peak_bytes"):
                c.simulated_peak = float(record["memory"]["peak_bytes"])
                c.reserved = record["memory"].get("allocator")
            else:
                todo.append(c)
        by_id = {c.point.point_id: c for c in todo}
        for record in run_simulated([c.point for c in todo], results_dir, rank=rank, workers=workers or None) if todo else []:
            c = by_id[record["point_id"]]
            peak = record.get("memory", {}).get("peak_bytes")
            if record["status"] in ("ok", "oom") and peak:
                c.simulated_peak = float(peak)
                c.reserved = record["memory"].get("allocator")
            else:
                c.simulation_error = (record.get("error") or record["status"]).strip().splitlines()[-1]
        ran += len(todo)
        if progress:
            progress(ran, sum(c.fits and c.simulated_peak is not None for c in candidates))


ALWAYS_SHOWN = ("recompute", "grad_accum_steps")   # train.* a reader looks for, printed even at their defaults


# a string Hydra would read as another type, so it is quoted even when its characters are plain
NOT_A_STRING = re.compile(r"(?i)true|false|null|[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?|[-+]?(inf|nan)")


def _hydra(key: str, value) -> str:
    """`key=value` as one shell word of a Hydra override. A string is quoted unless it is plain
    (word characters, dots, dashes, slashes) and would not read as a bool, null or number; in
    quotes a quote is escaped, and so is a backslash that would escape one (Hydra unescapes
    backslashes only before a quote)."""
    if isinstance(value, bool) or value is None:
        text = "null" if value is None else str(value).lower()
    elif isinstance(value, (list, tuple)):
        text = "[" + ",".join(_hydra("", v)[1:] for v in value) + "]"
    elif isinstance(value, str) and (not re.fullmatch(r"[\w.\-/]+", value) or NOT_A_STRING.fullmatch(value)):
        escaped = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, value).replace("'", "\\'")
        text = f"'{escaped}'"
    else:
        text = str(value)
    return shlex.quote(f"{key}={text}") if key else f"={text}"


def _base_model(point: Point, base_model: str | None) -> str:
    """The model config a command starts from: the plan's model= choice, else the point's model
    when a config of its name exists, else train.py's own default (every model key then differs)."""
    if base_model:
        return base_model
    if point.model["name"] in available_models():
        return point.model["name"]
    return next(d["model"] for d in OmegaConf.load(CONF_DIR / "train.yaml").defaults
                if isinstance(d, dict) and "model" in d)


def _defaults(point: Point, base_model: str) -> tuple[dict, dict, dict, dict]:
    """What train.py's config holds before any override: the base model's config, the
    schema's train.* and zero.*, the cluster's file."""
    cluster = OmegaConf.merge(OmegaConf.structured(ClusterConfig), load_cluster(point.cluster["name"]) or {})
    return (load_model(base_model), OmegaConf.to_container(OmegaConf.structured(TrainSettings)),
            OmegaConf.to_container(OmegaConf.structured(ZeroSettings)), OmegaConf.to_container(cluster))


def overrides(c: Candidate, base_model: str | None = None) -> str:
    """The overrides of train.py that run this candidate: the same point (point_id) as the plan's.
    Every model, train, zero and cluster value that differs from train.py's own is written (the
    model's against the config it starts from, _base_model); with a DeepSpeed JSON, the JSON
    passes on what it decides."""
    p = c.point
    base = _base_model(p, base_model)
    model, train, zero, cluster = _defaults(p, base)
    shaped = shaped_model({**model, **{k: p.model[k] for k in SHAPE_KEYS}})  # train.py names the point's shape so
    model = dict(model, name=shaped["name"], label=shaped["label"])
    deepspeed = _deepspeed(c.deepspeed_config)
    json_train = set() if deepspeed is None else {"precision", *(("lr", "weight_decay", "adam_betas", "adam_eps")
                                                                if deepspeed.optimizer else ())}
    json_zero = set() if deepspeed is None else set(deepspeed.decides)
    parts = [f"experiment_name={p.experiment}", f"model={base}"]
    parts += [_hydra(f"model.{k}", v) for k, v in p.model.items() if v != model.get(k)]
    parts += [f"stage={p.stage}", f"gpus={p.gpus}", f"tp={p.tp}", f"micro_batch={p.micro_batch}",
              f"cluster={p.cluster['name']}"]
    parts += [_hydra(f"train.{k}", v) for k, v in p.train.items()
              if (v != train.get(k) or k in ALWAYS_SHOWN) and k not in json_train]
    parts += [_hydra(f"zero.{k}", v) for k, v in p.zero.items() if v != zero.get(k) and k not in json_zero]
    parts += [_hydra(f"cluster.{k}", v) for k, v in p.cluster.items() if v != cluster.get(k)]
    if c.deepspeed_config:
        parts.append(_hydra("deepspeed_config", c.deepspeed_config))
    return " ".join(parts)


def _with_env(command: str, alloc_conf: str) -> str:
    return f"PYTORCH_CUDA_ALLOC_CONF={shlex.quote(alloc_conf)} {command}" if alloc_conf else command


def sbatch_line(point: Point, train_overrides: str, alloc_conf: str = "") -> str:
    """slurm/run_point.sh on whole nodes (check_plan_config: a job of more than a node fills them);
    the allocator's options exported to the job when the row needs them."""
    per_node = point.cluster["gpus_per_node"]
    nodes, gpus_per_node = max(1, point.gpus // per_node), min(per_node, point.gpus)
    export = f" --export=ALL,PYTORCH_CUDA_ALLOC_CONF={alloc_conf}" if alloc_conf else ""
    return f"sbatch{export} --nodes={nodes} --gpus-per-node={gpus_per_node} slurm/run_point.sh {train_overrides}"


def rows(candidates: list[Candidate], base_model: str | None = None, system: str = "zero_repro") -> list[dict]:
    """The plan's rows, ranked; `system`: the one that priced them (plan's system=; expected_error
    says whether that system on the point's cluster was validated)."""
    out = []
    for i, c in enumerate(ranked(candidates), 1):
        p, step, command = c.point, c.step, overrides(c, base_model)
        # the model's miss on measured steps of this regime, where it was validated
        error, regime = expected_error(p.tp, p.micro_batch, system, p.cluster["name"])
        out.append({"rank": i, "stage": p.stage, "tp": p.tp, "dp": p.dp, "micro_batch": p.micro_batch,
                    "grad_accum": p.train["grad_accum_steps"], "global_batch": p.global_batch,
                    "recompute": p.train["recompute"], "zero_r": c.zero_r, "fits": c.fits,
                    "peak_gb": round(c.tensor_peak / 1e9, 2),
                    "reserved_gb": None if c.reserved_source == "unconfirmed" else round(c.peak / 1e9, 2),
                    "reserved_source": c.reserved_source,
                    "fragmentation": round(c.replayed["fragmentation"], 3) if c.replayed else None,
                    "alloc_conf": c.alloc_conf, "limit_gb": round(c.limit / 1e9, 2),
                    "headroom_gb": round((c.limit - c.peak) / 1e9, 2),
                    "states_gb": round(c.analytic["model_states"] / 1e9, 2),
                    "activations_gb": round(c.analytic["activations"] / 1e9, 2), "peak_phase": c.analytic["peak_phase"],
                    "peak_source": "failed: " + c.simulation_error if c.simulation_error
                    else "simulated" if c.simulated_peak is not None else "analytic",
                    "tflops_per_gpu_predicted": round(step.tflops_per_gpu, 2) if step else None,
                    "tokens_per_s_predicted": round(c.speed) if step else None,
                    "step_s_predicted": round(step.step_s, 3) if step else None,
                    "dominant": step.dominant() if step else None,
                    "expected_error": round(error, 3) if step and error is not None else None,
                    "expected_error_regime": regime if step else None,
                    "point_id": p.point_id,
                    "overrides": command,
                    "command": _with_env(train_command(command, p.gpus, p.cluster["gpus_per_node"]), c.alloc_conf),
                    "sbatch": sbatch_line(p, command, c.alloc_conf)})
    return out


TABLE_COLUMNS = ("rank", "stage", "tp", "dp", "micro_batch", "grad_accum", "global_batch", "recompute", "zero_r",
                 "fits", "peak_gb", "reserved_gb", "reserved_source", "fragmentation", "headroom_gb", "peak_source",
                 "states_gb", "activations_gb",
                 "tflops_per_gpu_predicted", "tokens_per_s_predicted", "dominant", "expected_error")


def table(plan_rows: list[dict]) -> list[str]:
    """Rows as a Markdown table (TABLE_COLUMNS)."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    def cell(r: dict, c: str) -> str:
        if c == "expected_error" and r[c] is None and r["expected_error_regime"]:
            return "not validated"
        return "-" if r[c] is None else str(r[c])
    return lines + ["| " + " | ".join(cell(r, c) for c in TABLE_COLUMNS) + " |" for r in plan_rows]


def within_error(top_rows: list[dict], margin: float | None = None) -> list[str]:
    """A sentence when rows after the best are predicted within `margin` of it (default: the p90
    of the model's error on step-time ratios between TP degrees of the same run on the
    development set, expected_error.pair_ratio_p90): their order is then the model's guess, to be
    measured. Only where the model was validated (the best row's expected_error is a number)."""
    if len(top_rows) < 2 or top_rows[0]["tokens_per_s_predicted"] is None or top_rows[0]["expected_error"] is None:
        return []
    margin = pair_ratio_p90() if margin is None else margin
    best = top_rows[0]["tokens_per_s_predicted"]
    close = [r["rank"] for r in top_rows[1:]
             if r["tokens_per_s_predicted"] is not None and best <= r["tokens_per_s_predicted"] * (1 + margin)]
    if not close:
        return []
    return ["", f"Rows {', '.join(map(str, close))} are predicted within {margin:.0%} of row {top_rows[0]['rank']}: "
                f"the p90 of the model's error on step-time ratios between TP degrees of the same run "
                f"(|predicted ratio / measured ratio - 1| on measured A100 steps, validation_summary.md). "
                f"The model cannot order them; time a few steps of each."]


def markdown(plan_rows: list[dict], header: str, top: int) -> str:
    """The best `top` rows that fit, the command of the best, and the `top` nearest that do not."""
    fit = [r for r in plan_rows if r["fits"]]
    misses = [r for r in plan_rows if not r["fits"]]
    out = [header, "", f"**Fits: {len(fit)} configurations; the best {min(top, len(fit))}**", ""]
    out += table(fit[:top]) if fit else ["Nothing fits: see below."]
    out += within_error(fit[:top])
    if fit:
        best = fit[0]
        out += ["", "Run the best:", "", "```",
                best["command"],
                _with_env(f"{python_command()} experiments/train.py {best['overrides']} simulate=true",
                          best["alloc_conf"]) + "   # its memory, here",
                best["sbatch"], "```"]
    out += ["", f"**Does not fit: {len(misses)} configurations; the {min(top, len(misses))} nearest**", ""]
    out += table(misses[:top]) if misses else ["Everything fits."]
    return "\n".join(out) + "\n"


def write_plan(plan_rows: list[dict], text: str, folder: Path) -> tuple[Path, Path]:
    """plan.md (the printed plan), plan.csv (every row, every column) and plan_table.md (every
    row as one Markdown table, which the docs paste from)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "plan.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(plan_rows)
    (folder / "plan.md").write_text(text)
    (folder / "plan_table.md").write_text("\n".join(table(plan_rows)) + "\n")
    return folder / "plan.md", folder / "plan.csv"


class ProgressBar:
    """One line on stderr, redrawn: simulations run of at most `total`, and how many fit."""

    def __init__(self, total: int, wanted: int) -> None:
        self.total, self.wanted, self.began = total, wanted, time.perf_counter()
        self(0, 0)

    def __call__(self, ran: int, confirmed: int) -> None:
        done = min(1.0, ran / self.total)
        bar = "#" * round(30 * done) + "." * (30 - round(30 * done))
        print(f"\rsimulating [{bar}] {ran}/{self.total} at most, {confirmed}/{self.wanted} confirmed to fit, "
              f"{time.perf_counter() - self.began:.0f} s", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(file=sys.stderr)


# The plan's keys that change what it writes: the search's, the rank simulated (another rank's
# peaks) and the rows plan.md shows.
NAMED_KEYS = ("global_batch", "stages", "tps", "micro_batches", "recompute", "system", "device_memory_gb",
              "gpus_per_node", "confirm", "max_simulations", "simulate_rank", "top")


def plan_name(cfg: DictConfig, cluster_name: str, base_model: str | None) -> str:
    """The plan's folder when name= is not given: <model>-<cluster>-g<gpus>, then whatever else
    sets this plan apart, so that two different plans never share a folder: a custom shape
    (-l<layers>-h<hidden>-a<heads>-s<seq_len>, then -v<vocab_size> where that is off the base
    model's), each of NAMED_KEYS off its default (-tps1, -recomputetrue, -confirm6,
    -simulate_rank5, -top20), a DeepSpeed JSON (-ds_<file stem>_<hash of its contents>), and a
    hash of any train./zero./cluster. value off its default."""
    model = OmegaConf.to_container(cfg.model)
    parts = [model["name"]]
    base = load_model(base_model) if base_model in available_models() else None
    if base is None or any(model[k] != base[k] for k in SHAPE_KEYS):
        # the vocabulary only when off the base's (the schema's without one): shapes named before keep their names
        vocab = model["vocab_size"] != (base or {}).get("vocab_size", ModelConfig.vocab_size)
        # the Llama / MPT choices likewise, each off the base's (-mlpswiglu, -kv_heads8)
        choices = "".join("-" + re.sub(r"[^A-Za-z0-9_.]", "", f"{k}{model[k]}".lower()) for k in LATER_MODEL_DEFAULTS
                          if model[k] != (base or LATER_MODEL_DEFAULTS)[k])
        parts.append(f"l{model['layers']}-h{model['hidden']}-a{model['heads']}-s{model['seq_len']}"
                     + (f"-v{model['vocab_size']}" if vocab else "") + choices)
    parts += [cluster_name, f"g{cfg.gpus}"]
    defaults = OmegaConf.structured(PlanConfig)
    for key in NAMED_KEYS:
        value = OmegaConf.to_container(cfg)[key] if OmegaConf.is_list(cfg[key]) else cfg[key]
        default = OmegaConf.to_container(defaults)[key]
        if value != default:
            text = "_".join(map(str, value)) if isinstance(value, list) else str(value)
            parts.append(re.sub(r"[^A-Za-z0-9_.]", "", f"{key}{text}".lower()))
    if cfg.deepspeed_config:  # its name, and its contents: two JSONs of one name are two plans
        json_file = Path(cfg.deepspeed_config)
        contents = json_file.read_bytes() if json_file.is_file() else b""
        parts.append(f"ds_{json_file.stem}_{hashlib.sha1(contents).hexdigest()[:6]}")
    changed = {group: {k: v for k, v in OmegaConf.to_container(cfg[group]).items()
                       if v != OmegaConf.to_container(defaults[group]).get(k)}
               for group in ("train", "zero")}
    changed["cluster"] = {k: v for k, v in OmegaConf.to_container(cfg.cluster).items()
                          if v != OmegaConf.to_container(OmegaConf.merge(
                              OmegaConf.structured(ClusterConfig),
                              OmegaConf.load(CONF_DIR / "cluster" / f"{cluster_name}.yaml"))).get(k)}
    if any(changed.values()):
        parts.append(hashlib.sha1(json.dumps(changed, sort_keys=True, default=str).encode()).hexdigest()[:8])
    return "-".join(parts)


def run_plan(cfg: DictConfig, results_dir: Path, base_model: str | None = None) -> tuple[list[dict], str]:
    """The plan's rows and its Markdown (module docstring); plan.md, plan.csv and plan_table.md
    written under results_dir/plan/<name or model-cluster-g<gpus>>/, the simulated records
    where train.py simulate=true writes the same points', results_dir/plan_<cluster>/simulated/
    (an existing record of a point is reused). `base_model`: the model config the plan's
    model= chose (its command lines override that config)."""
    check_plan_config(cfg)
    began = time.perf_counter()
    candidates = price(candidate_points(cfg), cfg.system)
    for c in candidates:
        c.deepspeed_config = cfg.deepspeed_config
    cluster = candidates[0].point.cluster
    folder = results_dir / "plan" / (cfg.name or plan_name(cfg, cluster["name"], base_model))
    print(f"plan: {len(candidates)} configurations of {candidates[0].point.model['name']} on {cfg.gpus} GPUs of {cluster['name']} "
          f"({cluster['device_memory_gb']:g} GB, {cluster['cuda_reserve_gb']:g} GB reserved); "
          f"{sum(c.worth_simulating for c in candidates)} within {ANALYTIC_MARGIN:.0%} of the limit analytically",
          file=sys.stderr)
    bar = ProgressBar(cfg.max_simulations, cfg.confirm)
    ran = confirm(candidates, results_dir / experiment_name(cluster), wanted=cfg.confirm, max_simulations=cfg.max_simulations,
                  workers=cfg.simulate_workers or default_workers(), rank=cfg.simulate_rank, progress=bar)
    bar.close()
    factor = reserve_factor(candidates)
    for c in candidates:
        c.reserve_factor = factor
    plan_rows = rows(candidates, base_model, cfg.system)
    reused = sum(c.simulated_peak is not None or c.simulation_error is not None for c in candidates) - ran
    params = parameter_count(candidates[0].point.shape, 1)
    hw = cluster_hardware(cluster)
    speed = (f"speed predicted for system {cfg.system} on {hw.name} (analysis/step_time.py)" if hw else
             f"cluster {cluster['name']} has no step-time profile: speed not predicted, rows ordered by memory")
    header = (f"**Plan: {candidates[0].point.model['name']} ({params / 1e9:.2f}B parameters) on {cfg.gpus} GPUs of {cluster['name']}**\n\n"
              f"{len(candidates)} configurations; limit {candidates[0].limit / 1e9:.2f} GB per GPU for what the caching allocator reserves "
              f"({cluster['device_memory_gb']:g} GB less {cluster['cuda_reserve_gb']:g} GB CUDA reserve); "
              f"{ran + reused} simulated at full world size"
              + (f" ({reused} of them records of earlier plans)" if reused else "")
              + f", in {time.perf_counter() - began:.0f} s; {speed}. "
              + (f"Rows not replayed reserve their tensor peak x {factor:.3f}, the largest ratio of the replayed rows that fit "
                 "(reserved_source analytic+margin)." if factor is not None else
                 "No row was replayed: rows are judged on their tensor peak alone (reserved_source unconfirmed)."))
    text = markdown(plan_rows, header, cfg.top)
    md, csv_path = write_plan(plan_rows, text, folder)
    return plan_rows, text + f"\nwritten: {md}, {csv_path}\n"

