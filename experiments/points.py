"""From a sweep config to validated benchmark points.

An experiment lists explicit points (the paper's rows) or a grid (a cartesian product); the
sweep's top-level model/stage/gpus/tp/micro_batch, when given, replace that axis everywhere.
Every point is validated before anything is launched; a problem is a ConfigError whose message
is one line naming the point and the key.
"""
from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, fields
from functools import cache
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from zero_impl import (DTYPES, STAGES, ZERO_R_CONFIGS, ZERO_R_SWITCHES, DeepSpeedConfig, DeepSpeedConfigError,
                       ZeroConfig, parse_deepspeed)
from zero_impl.deepspeed import DEEPSPEED_KEYS
from experiments.analysis.activations import activation_memory, engine_buffer_bytes
from experiments.analysis.hardware import from_cluster
from experiments.analysis.step_time import inputs_from_point, predict
from experiments.analysis.memory import model_state_bytes, optimizer_step_bytes
from experiments.models.gpt_shape import (LAYER_SPECS, GPTShape, layer_parameters, normal_draws_per_rank,
                                          padded_vocab_size, parameters_per_tp_rank, root_parameters)

from .schema import ModelConfig, TrainConfig, TrainSettings, ZeroSettings

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
AXES = ("model", "stage", "gpus", "tp", "micro_batch")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
FAULTS = ("none", "raise", "raise_last_rank", "hang", "hang_last_rank", "slow")
# train.* that leave results alone
NOT_HASHED = ("timeout_s", "checkpoint_every", "resume", "checkpoint_dir", "stop_signal_lead_s")
LAUNCHERS = ("auto", "fork", "spawn", "torchrun")


# engine knobs added after the first records, at the value that behaves as the engine did before
# they existed: there they stay out of a point's hash, so the ids of earlier records still hold
# (literals: a later change of a default must not remap ids). optimizer_bucket_size: None is the
# whole-shard step of before; at its default 4e7 a point has a new id, as its peak may differ.
# stage3_keep_root joined the schema after the engine's default (True) had made the reference records.
LATER_KNOB_DEFAULTS = {"partition_activations": False, "cpu_checkpointing": False,
                       "contiguous_memory_optimization": False, "number_checkpoints": None,
                       "optimizer_bucket_size": None, "force_collectives": False, "loss_scale": 0.0,
                       "initial_scale_power": 16, "loss_scale_window": 1000, "min_loss_scale": 1.0, "hysteresis": 1,
                       "consecutive_hysteresis": False, "stage3_keep_root": True}
# engine knobs that choose how gloo moves the same bytes, not what a point is: outside its hash
# (the record's resolved config keeps them)
UNHASHED_KNOBS = ("gloo_point_to_point",)
LATER_TRAIN_DEFAULTS = {"layer_spec": "local", "adam_betas": [0.9, 0.999], "adam_eps": 1e-8}  # train.* likewise
# model.* likewise: the Llama / MPT choices, at GPT-2's values (GPTShape's defaults)
LATER_MODEL_DEFAULTS = {"ffn_hidden": None, "kv_heads": None, "bias": True, "position": "learned", "mlp": "gelu",
                        "norm": "layernorm", "tie_embeddings": True}


class ConfigError(ValueError):
    """Bad input, reported in one line before anything runs."""


@cache
def available_models() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))


@cache
def load_model(name: str) -> dict:
    if name not in available_models():
        raise ConfigError(f"unknown model {name!r}; available: {', '.join(available_models())}")
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"))
    return OmegaConf.to_container(merged)


SHAPE_KEYS = ("layers", "hidden", "heads", "seq_len", "vocab_size", *LATER_MODEL_DEFAULTS)


def shape_of(model: dict) -> GPTShape:
    """The GPTShape of a model config (a record's model from before a key existed has its default)."""
    return GPTShape(model["layers"], model["hidden"], model["heads"], model["seq_len"], model["vocab_size"],
                    **{k: model.get(k, v) for k, v in LATER_MODEL_DEFAULTS.items()})


def shaped_model(model: dict) -> dict:
    """A model config whose shape the command line changed, named for it: gpt_7b with
    model.layers=40 is `gpt_7b@layers40` (its config's name, then each shape key off the config's),
    so a plan's header and the records never call another shape by a config's name; the config's
    `label` (the paper's printed size) no longer applies. A name no config has is the user's own
    and stays, so a printed `model.name=gpt_7b@layers40` reads back as the same model."""
    name = model["name"]
    if name not in available_models():
        return model
    base = load_model(name)
    changed = [key for key in SHAPE_KEYS if model.get(key, LATER_MODEL_DEFAULTS.get(key)) != base[key]]
    if not changed:
        return model
    return dict(model, name=name + "@" + "-".join(f"{key}{model[key]}" for key in changed), label="")


@dataclass
class Point:
    """One benchmark point, fully resolved: everything train.py needs."""

    experiment: str
    model: dict
    stage: int
    gpus: int
    tp: int
    micro_batch: int
    note: str
    train: dict
    zero: dict
    cluster: dict

    @property
    def dp(self) -> int:
        return self.gpus // self.tp

    @property
    def shape(self) -> GPTShape:
        return shape_of(self.model)

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.dp * self.train["grad_accum_steps"]

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def point_id(self) -> str:
        """Readable and unique: the axes, the note, and a hash of everything else."""
        return self._id(NOT_HASHED)

    @property
    def checkpoint_id(self) -> str:
        """The point's id with train.steps left out: the same training run for more or fewer
        steps, which train.resume=true continues from its checkpoints (run/real.py checkpoint_root)."""
        return self._id((*NOT_HASHED, "steps"))

    def _id(self, unhashed_train: tuple[str, ...]) -> str:
        settings = {k: v for k, v in self.as_dict().items() if k not in ("cluster",)}
        settings["model"] = {k: v for k, v in self.model.items()
                             if k not in LATER_MODEL_DEFAULTS or v != LATER_MODEL_DEFAULTS[k]}
        settings["zero"] = {k: v for k, v in self.zero.items() if k not in UNHASHED_KNOBS
                            and (k not in LATER_KNOB_DEFAULTS or v != LATER_KNOB_DEFAULTS[k])}
        settings["train"] = {k: v for k, v in self.train.items() if k not in unhashed_train
                             and (k not in LATER_TRAIN_DEFAULTS or v != LATER_TRAIN_DEFAULTS[k])}
        if settings["train"]["precision"] == "auto":  # auto means fp32 on CPU, half precision on GPUs
            settings["train"]["precision"] = "auto-gpu" if torch.cuda.is_available() else "auto-cpu"
        digest = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
        note = f"-{_slug(self.note)}" if self.note else ""
        return f"{self.model['name']}-s{self.stage}-g{self.gpus}-tp{self.tp}-mb{self.micro_batch}{note}-{digest}"

    def describe(self) -> str:
        return f"{self.model['name']}, stage {self.stage}, {self.gpus} GPUs, TP {self.tp}, micro-batch {self.micro_batch}"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40]


def _as_list(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)) or OmegaConf.is_list(value):
        return list(value)
    return [value]


def expand(cfg: DictConfig) -> list[Point]:
    """The sweep's points, in order, duplicates removed. Raises ConfigError on bad input."""
    exp = cfg.experiment
    chosen_model = shaped_model(OmegaConf.to_container(cfg.model)) if cfg.get("model") is not None else None
    overrides = {axis: _as_list(cfg[axis]) for axis in AXES if axis != "model"}
    overrides["model"] = [chosen_model["name"]] if chosen_model else []
    for axis in AXES[1:]:
        if cfg[axis] is not None and not overrides[axis]:
            raise ConfigError(f"{axis} is an empty list")
    if exp.points:
        specs = [dict(OmegaConf.to_container(p)) for p in exp.points]
        rows = []
        for spec in specs:
            _check_zero_r(spec)
            _check_point_zero(spec)
            axes = [overrides[a] or [spec[a]] for a in AXES]
            rows += [dict(spec, **dict(zip(AXES, combo))) for combo in itertools.product(*axes)]
    else:
        axes = [overrides[a] or list(exp.grid[a]) for a in AXES]
        if not all(axes):
            raise ConfigError(f"experiment {exp.name!r} has neither points nor a complete grid")
        rows = [dict(zip(AXES, combo), note="") for combo in itertools.product(*axes)]
    train = _check_train(cfg.train)
    zero = OmegaConf.to_container(cfg.zero)
    try:
        ZeroConfig(**zero)
    except ValueError as e:
        raise ConfigError(str(e).replace("ZeroConfig.", "zero.")) from None
    cluster = OmegaConf.to_container(cfg.cluster)
    deepspeed = _deepspeed(cfg)
    if deepspeed is not None:
        train, zero = _deepspeed_settings(deepspeed, overrides, train, zero)
    points, seen = [], set()
    for row in rows:
        _check_axes(row)
        row_train = train
        if deepspeed is not None:
            row, row_train = _deepspeed_row(deepspeed, row, overrides, train)
        model = chosen_model if chosen_model and row["model"] == chosen_model["name"] else load_model(str(row["model"]))
        point = Point(experiment=exp.name, model=model, stage=row["stage"], gpus=row["gpus"],
                      tp=row["tp"], micro_batch=row["micro_batch"], note=row.get("note", ""), train=row_train,
                      zero=_zero_for(zero, row, row_train), cluster=cluster)
        try:
            point.shape.check()
            point.shape.check_tp(point.tp)
        except ValueError as e:
            raise ConfigError(f"point ({point.describe()}): {e}") from None
        if point.gpus % point.tp:
            raise ConfigError(f"point ({point.describe()}): GPU count {point.gpus} is not divisible by TP {point.tp}")
        if not (cfg.get("simulate") or cfg.get("dry_run")):  # those save nothing
            check_checkpoint_fits(point)
        if point.point_id not in seen:
            seen.add(point.point_id)
            points.append(point)
    if cfg.launcher not in LAUNCHERS:
        raise ConfigError(f"launcher must be one of {list(LAUNCHERS)}, got {cfg.launcher!r}")
    return points


_IGNORED_REPORTED: set[str] = set()  # DeepSpeed files whose ignored keys this process has printed


def _deepspeed(cfg: DictConfig) -> DeepSpeedConfig | None:
    """The sweep's deepspeed_config, read once; its ignored keys go to stderr once per file and
    process (the preflight and the run both expand the same config)."""
    path = cfg.get("deepspeed_config") or ""
    if not path:
        return None
    try:
        deepspeed = parse_deepspeed(path)
    except DeepSpeedConfigError as e:
        raise ConfigError(str(e)) from None
    if deepspeed.ignored and deepspeed.source not in _IGNORED_REPORTED:
        _IGNORED_REPORTED.add(deepspeed.source)
        print(f"deepspeed_config {deepspeed.source}: ignored (no effect here): "
              + "; ".join(f"{key} ({why})" for key, why in deepspeed.ignored.items()), file=sys.stderr)
    return deepspeed


def _agrees(name: str, given: Any, default: Any, value: Any, deepspeed_key: str, source: str) -> None:
    """A value the command line set (not its default) must be the one the DeepSpeed JSON sets."""
    if given != default and given != value:
        raise ConfigError(f"{name}={given!r} contradicts deepspeed_config {source} ({deepspeed_key}: {value!r}); "
                          "set it in one place")


def _deepspeed_settings(deepspeed: DeepSpeedConfig, overrides: dict, train: dict, zero: dict) -> tuple[dict, dict]:
    """train.* and zero.* with what the JSON sets (its precision, its optimizer's lr, betas, eps and
    weight decay, its engine knobs); the command line's stage must be the JSON's."""
    source, ds_zero = deepspeed.source, deepspeed.zero
    for stage in overrides["stage"]:
        _agrees("stage", stage, None, ds_zero.stage, "zero_optimization.stage", source)
    sets = {"precision": (ds_zero.precision, DEEPSPEED_KEYS["precision"])}
    if deepspeed.optimizer is not None:
        sets.update({key: (deepspeed.optimizer[name], f"optimizer.params.{name}") for key, name in
                     (("lr", "lr"), ("weight_decay", "weight_decay"), ("adam_betas", "betas"), ("adam_eps", "eps"))})
    defaults = TrainSettings()
    for key, (value, deepspeed_key) in sets.items():
        _agrees(f"train.{key}", train[key], getattr(defaults, key), value, deepspeed_key, source)
    knobs = {key: getattr(ds_zero, key) for key in deepspeed.decides if key in zero}
    zero_defaults = ZeroSettings()
    for key, value in knobs.items():
        _agrees(f"zero.{key}", zero[key], getattr(zero_defaults, key), value, DEEPSPEED_KEYS[key], source)
    return dict(train, **{key: value for key, (value, _) in sets.items()}), dict(zero, **knobs)


def _deepspeed_row(deepspeed: DeepSpeedConfig, row: dict, overrides: dict, train: dict) -> tuple[dict, dict]:
    """A row at the JSON's stage, with its micro-batch and accumulation at the row's DP degree
    (DeepSpeed's batch rule); a command-line micro_batch must be the JSON's."""
    try:
        micro, accum = deepspeed.batch_for(max(row["gpus"] // row["tp"], 1))
    except DeepSpeedConfigError as e:
        raise ConfigError(f"point ({row['model']}, {row['gpus']} GPUs, TP {row['tp']}): {e}") from None
    if micro is not None and overrides["micro_batch"]:
        _agrees("micro_batch", row["micro_batch"], None, micro, "train_micro_batch_size_per_gpu", deepspeed.source)
    if accum is not None:
        _agrees("train.grad_accum_steps", train["grad_accum_steps"], TrainSettings.grad_accum_steps, accum,
                "gradient_accumulation_steps", deepspeed.source)
        train = dict(train, grad_accum_steps=accum)
    return dict(row, stage=deepspeed.zero.stage, micro_batch=micro or row["micro_batch"]), train


def _check_zero_r(spec: dict) -> None:
    """A point's `zero_r` names one of Table 3's configurations (its stage is checked per row,
    after the command line's axes: _zero_for)."""
    name = spec.get("zero_r") or ""
    if name and name not in ZERO_R_CONFIGS:
        raise ConfigError(f"zero_r must be one of {list(ZERO_R_CONFIGS)} (Table 3), got {name!r}")


def _check_point_zero(spec: dict) -> None:
    """A point's own `zero` names the sweep's engine knobs (schema.ZeroSettings), and none of the
    ZeRO-R switches its `zero_r` sets; values are checked per point, at its final stage (_zero_for)."""
    allowed = [f.name for f in fields(ZeroSettings)]
    if spec.get("zero_r"):
        allowed = [k for k in allowed if k not in ZERO_R_SWITCHES]
    unknown = sorted(set(spec.get("zero") or {}) - set(allowed))
    if unknown:
        why = f" (zero_r {spec['zero_r']} sets the ZeRO-R switches)" if spec.get("zero_r") else ""
        raise ConfigError(f"point ({spec['model']}): zero override(s) {unknown} are not a point's engine "
                          f"knobs{why}; allowed: {sorted(allowed)}")


def _zero_for(zero: dict, row: dict, train: dict) -> dict:
    """The engine knobs of one point: the sweep's, the point's own over them, its Table 3
    configuration's ZeRO-R switches over both; checked at the point's stage, sizes as integers
    (a 2e7 written in YAML is the same point as 20000000)."""
    zero_r = row.get("zero_r") or ""
    zero = dict(zero, **(row.get("zero") or {}))
    if zero_r:
        if row["stage"] != ZERO_R_CONFIGS[zero_r]["stage"]:  # e.g. `stage=1` over a C4 point
            raise ConfigError(f"point ({row['model']}, zero_r {zero_r}): {zero_r} is stage "
                              f"{ZERO_R_CONFIGS[zero_r]['stage']} (Table 3), the point says stage {row['stage']}")
        zero = dict(zero, **{k: v for k, v in ZERO_R_CONFIGS[zero_r].items() if k != "stage"})
    try:
        config = ZeroConfig(stage=row["stage"], **zero)
    except ValueError as e:
        raise ConfigError(f"point ({row['model']}, stage {row['stage']}): "
                          f"{str(e).replace('ZeroConfig.', 'zero.')}") from None
    zero = {k: getattr(config, k) for k in zero}
    for key in ("partition_activations", "contiguous_memory_optimization"):
        if zero.get(key) and not train["recompute"]:
            raise ConfigError(f"zero.{key}{f' (zero_r {zero_r})' if zero_r else ''} acts on activation checkpoints: "
                              "it needs train.recompute=true")
    return zero


def _check_axes(row: dict) -> None:
    if row["stage"] not in STAGES or isinstance(row["stage"], bool):
        raise ConfigError(f"stage must be one of {list(STAGES)}, got {row['stage']!r}")
    for key in ("gpus", "tp", "micro_batch"):
        value = row[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    if not isinstance(row["model"], str):
        raise ConfigError(f"model must be a model name, got {row['model']!r}")


def _check_train(train: DictConfig) -> dict:
    t = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(TrainSettings), train))
    if t["precision"] not in PRECISIONS:
        raise ConfigError(f"train.precision must be one of {list(PRECISIONS)}, got {t['precision']!r}")
    if t["layer_spec"] not in LAYER_SPECS:
        raise ConfigError(f"train.layer_spec must be one of {list(LAYER_SPECS)}, got {t['layer_spec']!r}")
    if t["layer_spec"] == "transformer_engine" and importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError("train.layer_spec=transformer_engine needs Transformer Engine, which is not installed here "
                          "(NGC PyTorch images have it); the default, local, is megatron's own layers")
    if t["fault"] not in FAULTS:
        raise ConfigError(f"train.fault must be one of {list(FAULTS)}, got {t['fault']!r}")
    for key in ("grad_accum_steps", "steps"):
        if t[key] < 1:
            raise ConfigError(f"train.{key} must be a positive integer, got {t[key]!r}")
    if t["checkpoint_every"] < 0:
        raise ConfigError(f"train.checkpoint_every must be >= 0, got {t['checkpoint_every']!r}")
    if len(t["adam_betas"]) != 2 or not all(0 <= b < 1 for b in t["adam_betas"]):
        raise ConfigError(f"train.adam_betas must be two numbers in [0, 1), got {t['adam_betas']!r}")
    if not t["adam_eps"] > 0:
        raise ConfigError(f"train.adam_eps must be > 0, got {t['adam_eps']!r}")
    if t["warmup_steps"] < 0:
        raise ConfigError(f"train.warmup_steps must be >= 0, got {t['warmup_steps']!r}")
    if not t["timeout_s"] > 0:
        raise ConfigError(f"train.timeout_s must be > 0, got {t['timeout_s']!r}")
    if t["stop_signal_lead_s"] < 1:
        raise ConfigError(f"train.stop_signal_lead_s must be a positive number of seconds, got {t['stop_signal_lead_s']!r}")
    return t


def local_devices(cluster: dict) -> tuple[int, str]:
    """How many ranks this machine can give one point, and what they are."""
    if torch.cuda.is_available():
        return torch.cuda.device_count(), f"{torch.cuda.device_count()} GPUs"
    return cluster["max_cpu_ranks"], f"{cluster['max_cpu_ranks']} CPU ranks (no GPU found; cluster.max_cpu_ranks)"


def check_runnable_here(points: list[Point]) -> None:
    """Points launched on this machine must fit its devices."""
    for point in points:
        count, what = local_devices(point.cluster)
        if point.gpus > count:
            raise ConfigError(f"point ({point.describe()}) needs {point.gpus} devices; this machine offers {what}. "
                              "List it with dry_run=true, or run it through a SLURM launcher")


# Overrides every limit host_available reads: a user's own cap (this many bytes, whatever the host
# says), and the tests' way to give the check a host of a known size.
HOST_MEMORY_ENV = "ZERO_REPRO_HOST_MEMORY_BYTES"


@dataclass(frozen=True)
class HostMemory:
    """What this host can give new allocations now, and which limit that is."""
    bytes: int
    source: str  # e.g. "MemAvailable", "/sys/fs/cgroup/memory.max less memory.current"


def host_available(meminfo: Path = Path("/proc/meminfo"), self_cgroup: Path = Path("/proc/self/cgroup"),
                   cgroup_root: Path = Path("/sys/fs/cgroup")) -> HostMemory | None:
    """The least of /proc/meminfo's MemAvailable and what this process's memory cgroups still
    allow (Slurm's job, a container: what they enforce, whatever the host has free); the
    ZERO_REPRO_HOST_MEMORY_BYTES environment variable replaces them all. None where none is known."""
    override = os.environ.get(HOST_MEMORY_ENV)
    if override:
        try:
            return HostMemory(int(float(override)), HOST_MEMORY_ENV)
        except ValueError:
            raise ConfigError(f"{HOST_MEMORY_ENV}={override!r} is not a number of bytes") from None
    limits = [*_cgroup_headroom(self_cgroup, cgroup_root)]
    try:
        kib = next(line.split()[1] for line in meminfo.read_text().splitlines() if line.startswith("MemAvailable:"))
        limits.append(HostMemory(int(kib) * 1024, "MemAvailable"))
    except (OSError, StopIteration):
        pass
    return min(limits, key=lambda m: m.bytes, default=None)


def _cgroup_headroom(self_cgroup: Path, cgroup_root: Path) -> list[HostMemory]:
    """Limit less usage of each memory cgroup this process is in (/proc/self/cgroup), at its own
    level and every level above it: Slurm sets the job's limit on job_<id>, above the step's
    cgroup. cgroup v2: memory.max (unless 'max') - memory.current; v1: memory.limit_in_bytes -
    memory.usage_in_bytes."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, limit, usage = cgroup_root, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base, limit, usage = cgroup_root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        folder = base / path.lstrip("/")
        for level in (folder, *folder.parents):
            if not level.is_relative_to(base):
                break
            try:
                cap, used = (level / limit).read_text().strip(), int((level / usage).read_text())
            except (OSError, ValueError):
                continue
            if cap != "max":
                found.append(HostMemory(max(int(cap) - used, 0), f"{level / limit} less {usage}"))
    return found


def ranks_on_gpus() -> bool:
    """Whether this host's ranks hold their tensors on GPUs (then the host check does not apply)."""
    return torch.cuda.is_available()


def host_memory_shortfall(point: Point, ranks_here: int, available: HostMemory | None) -> tuple[int, float] | None:
    """(predicted bytes per process, bytes per process the host can give) where a point run for
    real on CPU processes does not fit this host, else None: its predicted peak per process
    (predicted_memory_bytes, the dry run's prediction, at the precision it trains in here and
    without dropout, as the benchmark model has none) against `available` (host_available)
    divided among its `ranks_here` ranks on this host. GPU ranks hold their tensors on the
    device: not checked."""
    if ranks_on_gpus() or available is None:
        return None
    needed = predicted_memory_bytes(point, resolve_precision(point.train["precision"]), dropout=False)["total"]
    per_rank = available.bytes / ranks_here
    return (needed, per_rank) if needed > per_rank else None


def check_host_memory(point: Point, ranks_here: int, available: HostMemory | None = None) -> None:
    """Refuse a point that does not fit this host (host_memory_shortfall; `available` default
    host_available()), before anything is built: a paper-sized point would otherwise take the
    host's memory within seconds."""
    available = host_available() if available is None else available
    short = host_memory_shortfall(point, ranks_here, available)
    if short is not None:
        needed, per_rank = short
        raise ConfigError(f"point ({point.describe()}) needs {needed / 1e9:.2f} GB per process (predicted) and this host "
                          f"can give {per_rank / 1e9:.2f} GB per process ({available.source} {available.bytes / 1e9:.2f} "
                          f"GB over {ranks_here} rank(s)): see its memory with simulate=true (sweep.py: also "
                          "dry_run=true), or run it anyway with ignore_host_memory=true")


# zero_impl.checkpoint writes each trainable parameter's fp32 master and Adam's two fp32 moments
# (the model-precision parameter is the master's rounding: not written)
CHECKPOINT_BYTES_PER_PARAM = 12


def checkpoint_bytes_per_rank(point: Point) -> float:
    """Bytes one rank writes per checkpoint: 1/DP of its TP slice's masters and moments. DCP
    writes each piece once and spreads replicated pieces (stage 0's masters, the TP-duplicated
    LayerNorms) over the ranks that hold them, so it is 1/DP at every stage."""
    return CHECKPOINT_BYTES_PER_PARAM * parameters_per_tp_rank(point.shape, point.tp) / point.dp


def checkpoint_seconds(point: Point) -> float | None:
    """One checkpoint's write time: the bytes of a node's ranks / cluster.checkpoint_write_gb_per_s
    (what one node writes while all do); None where the bandwidth is unknown."""
    gb_per_s = point.cluster.get("checkpoint_write_gb_per_s")
    if gb_per_s is None:
        return None
    ranks_per_node = min(point.gpus, point.cluster.get("gpus_per_node") or point.gpus)
    return checkpoint_bytes_per_rank(point) * ranks_per_node / (gb_per_s * 1e9)


def check_checkpoint_fits(point: Point) -> None:
    """Under Slurm the ranks see the USR1 warning (train.stop_signal_lead_s before the time
    limit) after their current step, then save: a step and a save must fit in the warning; with
    train.checkpoint_every a periodic save may be under way when it comes, so two saves and a
    step. The step is the step-time model's (analysis/step_time.py), where the cluster has its
    constants. Unknown bandwidth: nothing to check."""
    save = checkpoint_seconds(point)
    if save is None:
        return
    hardware = from_cluster(point.cluster)
    step = predict(inputs_from_point(point), hardware, "zero_repro").step_s if hardware else 0.0
    saves = 2 if point.train["checkpoint_every"] else 1
    lead = point.train["stop_signal_lead_s"]
    if step + saves * save > lead:
        per_node = min(point.gpus, point.cluster.get("gpus_per_node") or point.gpus)
        raise ConfigError(
            f"point ({point.describe()}): a checkpoint of {checkpoint_bytes_per_rank(point) / 1e9:.1f} GB per rank x "
            f"{per_node} ranks per node at cluster.checkpoint_write_gb_per_s={point.cluster['checkpoint_write_gb_per_s']:g} "
            f"takes {save:.0f} s; {saves} save(s) + a step ({step:.0f} s) = {step + saves * save:.0f} s do not fit in "
            f"train.stop_signal_lead_s={lead} (Slurm's --signal=B:USR1@{lead} in slurm/run_*.sh)"
            + ("; train.checkpoint_every adds a save in progress" if saves == 2 else "")
            + ": raise both lead times, or give the file system's real bandwidth")


def cpu_normal_draws_per_s(elements: int = 2 ** 22) -> float:
    """This host's fp32 normal draws per second, best of 3 (torch's CPU normal_ runs on one core)."""
    values, best = torch.empty(elements), math.inf
    for _ in range(3):
        began = time.perf_counter()
        values.normal_()
        best = min(best, time.perf_counter() - began)
    return elements / best


def launch_plan(point: Point, cpu_draws_per_s: float) -> str:
    """One line for the launcher's log, before any rank starts: what initialization draws per
    rank and what that costs on the GPU (a bound: 4 bytes written per value at the datasheet's
    cluster.hbm_gb_per_s) and on this host's CPU (`cpu_draws_per_s`, measured: a rank's cost
    where it draws on the host), and one checkpoint's size and write time."""
    draws = normal_draws_per_rank(point.shape, point.tp)
    hbm = point.cluster.get("hbm_gb_per_s")
    on_gpu = f">= {draws * 4 / (hbm * 1e9):.1f} s on the GPU (4 B per value at hbm_gb_per_s={hbm:g}), " if hbm else ""
    line = (f"plan: init draws {draws:.3g} normal values per rank (every weight whole): {on_gpu}"
            f"{draws / cpu_draws_per_s / 60:.1f} min on this host's CPU ({cpu_draws_per_s / 1e6:.0f} M/s measured, "
            f"one core); a checkpoint is {checkpoint_bytes_per_rank(point) / 1e9:.2f} GB per rank")
    save = checkpoint_seconds(point)
    if save is None:
        return line + " (cluster.checkpoint_write_gb_per_s unknown: its time is not checked)"
    return (line + f", {save:.0f} s per save at checkpoint_write_gb_per_s={point.cluster['checkpoint_write_gb_per_s']:g} "
            f"per node, within Slurm's {point.train['stop_signal_lead_s']} s warning")


def resolve_precision(precision: str) -> str:
    """'auto': fp32 on CPU; on CUDA, bf16 where the current device computes it natively
    (compute capability >= 8.0: A100, H100), fp16 below (V100 is 7.0). Not
    torch.cuda.is_bf16_supported(): it says True on sm_70, where bf16 is emulated, and creates a
    tensor on the current device to find out. Call it after torch.cuda.set_device(local rank):
    it asks the current device."""
    if precision != "auto":
        return precision
    if not torch.cuda.is_available():
        return "fp32"
    major, _ = torch.cuda.get_device_capability(torch.cuda.current_device())
    return "bf16" if major >= 8 else "fp16"


def predicted_model_state_bytes(point: Point, precision: str) -> dict[str, float]:
    """Table 1's formula for one rank at the engine's dtypes: Ψ is the parameters of its TP
    slice, Nd its DP degree. fp16 is the paper's P = G = 2, K = 12; bf16 keeps its gradients in
    fp32 (ZeroConfig.reduce_dtype's default: G = 4); in fp32 the master is the parameter itself
    (K = 8, Adam's two moments)."""
    psi = parameters_per_tp_rank(point.shape, point.tp)
    config = ZeroConfig(stage=point.stage, precision=precision, **point.zero)
    return model_state_bytes(psi, point.stage, point.dp, param_bytes=config.param_dtype.itemsize,
                             grad_bytes=config.grad_reduce_dtype.itemsize,
                             optimizer_bytes=12 if config.mixed_precision else 8)


def predicted_memory_bytes(point: Point, precision: str, *, dropout: bool = True) -> dict[str, float]:
    """Peak bytes per GPU of the point's recipe, `total`: the larger of backward's (Table 1's
    model states, the activations of its micro-batch, Korthikanti et al. 2022, with the point's
    recomputation, and the engine's buffers, experiments/analysis/activations.py) and the
    optimizer step's (the model states and the step's temporaries, analysis/memory.py
    optimizer_step_bytes, with a foreach Adam as on CUDA, and the local attention's score buffer,
    which megatron holds from the first forward on: activations.score_buffer_bytes), each with
    its terms; `peak_phase`.
    Backward's peak is the larger of two moments. The loss's working set (its forward, and its
    backward up to the output layer's) comes before any gradient of the model: of the engine's
    buffers only stage 3's gathered units are there (the root holds the output layer). The
    layers' backward (one recomputed layer's peak, or without recomputation what the last
    layer's attention adds) comes with all of them: gradient staging, the tied embedding's
    gradient, the gathered units. (Simulated: Figure 2's and 4's micro-batch-24 points peak at
    the loss with no engine buffer allocated.)
    dropout: count dropout masks, as the paper's recipe trains (the benchmark model has none); never
    for a shape other than GPT-2's (Llama's and MPT's recipes have no dropout)."""
    shape = point.shape
    vocab = padded_vocab_size(shape.vocab_size, point.tp)
    states = predicted_model_state_bytes(point, precision)
    activations = activation_memory(seq_len=shape.seq_len, micro_batch=point.micro_batch, hidden=shape.hidden,
                                    heads=shape.heads, layers=shape.layers, vocab=vocab, tp=point.tp,
                                    recompute=point.train["recompute"], bytes_per_element=DTYPES[precision].itemsize,
                                    dropout=dropout and _is_gpt2(shape),
                                    partition_activations=point.zero.get("partition_activations", False),
                                    cpu_checkpointing=point.zero.get("cpu_checkpointing", False),
                                    **_layer_shape(shape, point.train.get("layer_spec", "local")))
    config = ZeroConfig(stage=point.stage, precision=precision, **point.zero)  # the engine's dtypes
    buffers = engine_buffer_bytes(stage=point.stage, hidden=shape.hidden, seq_len=shape.seq_len, vocab=vocab,
                                  tp=point.tp, params=parameters_per_tp_rank(shape, point.tp),
                                  reduce_bucket_size=config.reduce_bucket_size,
                                  stage3_max_live_units=config.stage3_max_live_units,
                                  param_bytes=config.param_dtype.itemsize,
                                  reduce_bytes=config.grad_reduce_dtype.itemsize,
                                  **_unit_params(shape, point.tp))
    # A master is one bucket's shard of one param group, never split: a chunk may be one larger
    # master, at most a bucket's or the largest parameter's (the tied embedding) share.
    sharded_over = point.dp if point.stage > 0 else 1
    params = parameters_per_tp_rank(shape, point.tp)
    largest_master = max(min(config.reduce_bucket_size, params), vocab * shape.hidden / point.tp) / sharded_over
    chunk = None if config.optimizer_bucket_size is None else max(config.optimizer_bucket_size, largest_master)
    step = optimizer_step_bytes(params / sharded_over, chunk=chunk, grad_bytes=config.grad_reduce_dtype.itemsize,
                                master_bytes=config.master_dtype.itemsize)
    held = states["total"] + activations["layers_kept"] + activations["head"] + activations["score_buffer"]
    at_loss = held + activations["logits"] + buffers["gathered_units"]
    at_layers = held + activations["recomputed_layer"] + activations["last_layer_transient"] + buffers["total"]
    backward = max(at_loss, at_layers)
    at_step = states["total"] + activations["score_buffer"] + step
    return {"model_states": states["total"], "activations": activations["total"], "buffers": buffers["total"],
            "step_temporaries": step, "total": max(backward, at_step),
            "peak_phase": "step" if at_step > backward else "backward",
            "terms": {"model_states": states, "activations": activations, "buffers": buffers}}


def _is_gpt2(shape: GPTShape) -> bool:
    return all(getattr(shape, k) == v for k, v in LATER_MODEL_DEFAULTS.items())


def _layer_shape(shape: GPTShape, layer_spec: str) -> dict:
    """activation_memory's shape arguments beyond GPT-2's (none for GPT-2, whose numbers stay
    those of before): K and V at kv_heads' width where TE's attention keeps them so, at every
    head's on the local spec (its DotProductAttention repeats them before its matmuls), whose
    rotary embeddings with multi-head attention keep the QKV output beside the rotated Q and K;
    TE's fused attention keeps no s x s scores (any shape)."""
    local = layer_spec != "transformer_engine"
    if _is_gpt2(shape):
        return {} if local else {"fused_attention": True}
    return {"kv_hidden": shape.hidden if local else shape.kv_hidden, "ffn": shape.ffn, "swiglu": shape.mlp == "swiglu",
            "rotated_copies": local and shape.position == "rope" and shape.query_groups == shape.heads,
            "rmsnorm": local and shape.norm == "rmsnorm", "fused_attention": not local}


def _unit_params(shape: GPTShape, tp: int) -> dict:
    """engine_buffer_bytes' stage-3 units beyond GPT-2's: one layer's and the root's
    parameters on one TP rank."""
    if _is_gpt2(shape):
        return {}
    layer, layer_dup = layer_parameters(shape)
    root, root_dup = root_parameters(shape, tp)
    return {"layer_params": layer / tp + layer_dup, "root_params": root / tp + root_dup}


def check_simulate_rank(points: list[Point], rank: int) -> None:
    for point in points:
        if not 0 <= rank < point.gpus:
            raise ConfigError(f"point ({point.describe()}): simulate_rank must be in [0, {point.gpus}), got {rank}")


def point_from_train_config(cfg: DictConfig) -> Point:
    """The single point a train.py invocation describes (validated like a sweep's). With a
    deepspeed_config, a stage or micro_batch other than train.py's default is the command line's,
    which the JSON's must equal (expand checks); the default itself cannot be told from one given."""
    axes = ("stage", "gpus", "tp", "micro_batch")
    deepspeed = cfg.get("deepspeed_config") or ""
    given = {axis: cfg[axis] if deepspeed and axis in ("stage", "micro_batch") and cfg[axis] != getattr(TrainConfig, axis)
             else None for axis in axes}
    sweep_like = OmegaConf.create({
        "experiment": {"name": cfg.experiment_name, "points": [{"model": cfg.model.name, **{k: cfg[k] for k in axes}}],
                       "grid": {}},
        "model": cfg.model, "train": cfg.train, "zero": cfg.zero, "cluster": cfg.cluster, "launcher": "torchrun",
        "deepspeed_config": deepspeed, **given})
    return expand(sweep_like)[0]


def simulated_precision(point: Point) -> str:
    """The precision the point's cluster would train in: "auto" is what `resolve_precision`
    picks on that cluster's GPUs (fp16 on V100, which lacks bf16; bf16 on newer GPUs), or on
    this machine for the local cluster."""
    precision = point.train["precision"]
    if precision != "auto":
        return precision
    cluster = point.cluster
    if cluster.get("device_memory_gb") is None:  # local: what a real run here would use
        return resolve_precision(precision)
    text = f"{cluster.get('name', '')} {cluster.get('description', '')}".lower()
    return "fp16" if "v100" in text else "bf16"
