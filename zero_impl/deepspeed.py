"""DeepSpeed's JSON config read as this engine's: `read_deepspeed(path_or_dict)`, which
config.parse_deepspeed (and ZeroConfig.from_deepspeed) turn into a ZeroConfig; this module
imports nothing of the engine, so the config can name it without a circle.

Keys that mean the same thing map onto ZeroConfig (docs/deepspeed_config.md has the table); keys
the JSON omits take DeepSpeed's defaults, so a config means here what it means in DeepSpeed.
The defaults are DeepSpeed's own, read in microsoft/DeepSpeed (v0.16.5):
deepspeed/runtime/zero/config.py (DeepSpeedZeroConfig: buckets 5e8, sub_group_size 1e9,
prefetch 5e7, persistence 1e5, overlap_comm on at stage 3 only), deepspeed/runtime/constants.py
(fp16: dynamic scale 2**16, window 1000, hysteresis 2, min 1; gradient_clipping 0),
deepspeed/runtime/activation_checkpointing/config.py (all off), deepspeed/ops/adam/fused_adam.py
(Adam: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0) and deepspeed/runtime/config.py
(the batch rule, DeepSpeedConfig.batch_for). What this engine cannot honour is rejected with one
line naming the key and why; keys with no effect here are listed in `ignored`; a key it does not
know at all is rejected, so nothing is silently dropped.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any



class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config this engine cannot honour, in one line: `deepspeed_config <key>: <why>`."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"deepspeed_config {key}: {why}")


@dataclass(frozen=True)
class DeepSpeedConfig:
    """What a DeepSpeed JSON sets: the engine's config (DeepSpeed's defaults where it is silent),
    the batch keys as given (None: absent; `batch_for` applies DeepSpeed's rule at a DP degree),
    the AdamW settings ({"type": "adamw", "lr", "betas", "eps", "weight_decay"}, FusedAdam's
    defaults for those it omits; None: no optimizer block), the keys it has that have no effect
    here (dotted key -> why) and where it came from. `decides`: the ZeroConfig fields the JSON
    sets, by a value or by DeepSpeed's default: the sizes, overlap, clipping and precision always,
    the accumulation where it gives one, the loss scaling with fp16 on, ZeRO-R's switches with an
    activation_checkpointing block (without one it says nothing about checkpoints)."""

    zero: ZeroConfig             # zero_impl.config's (a string annotation: this module imports no engine code)
    micro_batch: int | None
    train_batch_size: int | None
    grad_accum_steps: int | None
    optimizer: dict | None
    ignored: dict[str, str]
    source: str
    decides: tuple[str, ...] = ()

    def batch_for(self, dp: int) -> tuple[int | None, int | None]:
        """(micro-batch per GPU, accumulation steps) at data-parallel degree `dp`, by DeepSpeed's
        rule train_batch_size = micro x accumulation x DP: any two give the third, all three
        must agree, train_batch_size alone means accumulation 1, a micro-batch alone too
        (DeepSpeedConfig._set_batch_related_parameters). None where the JSON says nothing."""
        total, micro, accum = self.train_batch_size, self.micro_batch, self.grad_accum_steps
        if total is None:
            return micro, (1 if micro is not None and accum is None else accum)
        if micro is None and accum is None:
            accum = 1
        known = (micro or 1) * (accum or 1) * dp
        if total % known or (micro is not None and accum is not None and total != known):
            raise _batch_error(total, micro, accum, dp)
        return (micro or total // known), (accum or total // known)


def _batch_error(total: int, micro: int | None, accum: int | None, dp: int | str) -> DeepSpeedConfigError:
    shown = " x ".join(str(v) if v is not None else "?" for v in (micro, accum, dp))
    whole = "" if micro is not None and accum is not None else " for any whole ?"
    return DeepSpeedConfigError("train_batch_size", f"{total} != train_micro_batch_size_per_gpu x "
                                f"gradient_accumulation_steps x DP = {shown}{whole} (DeepSpeed's rule)")


ZERO_IGNORED = {
    "stage3_max_live_parameters": "this engine bounds stage 3's live parameters by units: zero.stage3_max_live_units",
    "stage3_max_reuse_distance": "stage 3 frees a unit after its use and gathers it again for backward",
    "stage3_model_persistence_threshold": "stage3_param_persistence_threshold alone decides what stays gathered",
    "stage3_gather_16bit_weights_on_model_save": "checkpoints here keep the fp32 masters (zero_impl.checkpoint)",
    "stage3_gather_fp16_weights_on_model_save": "checkpoints here keep the fp32 masters (zero_impl.checkpoint)",
    "round_robin_gradients": "an option of CPU offloading, which this engine does not do",
    "load_from_fp32_weights": "checkpoints here always load the fp32 masters",
    "elastic_checkpoint": "DeepSpeed no longer supports it; checkpoints here load at any DP degree",
    "ignore_unused_parameters": "a parameter without a gradient is reduced as zeros",
    "cpu_offload_use_pin_memory": "an option of CPU offloading, which this engine does not do",
    "memory_efficient_linear": "stage 3 keeps no extra copy of a linear layer's input",
}
TOP_IGNORED = {
    "steps_per_print": "the record holds every step's loss and time",
    "wall_clock_breakdown": "the record holds the step times",
    "memory_breakdown": "the record holds the measured memory",
    "dump_state": "DeepSpeed's debugging print",
    "zero_allow_untested_optimizer": "the optimizer is always AdamW here",
    "zero_force_ds_cpu_optimizer": "nothing is offloaded, so no CPU optimizer",
    **{k: "logging is the record (results/runs)" for k in ("tensorboard", "wandb", "csv_monitor", "comet",
                                                            "comms_logger", "flops_profiler", "monitor_config")},
}
OFFLOAD = "offloading to the CPU/NVMe (ZeRO-Offload, ZeRO-Infinity) is not implemented by this engine"
TOP_REJECTED = {
    "scheduler": "this benchmark trains at a constant learning rate (optimizer.params.lr); remove the block",
    "amp": "NVIDIA Apex AMP is not used: set fp16 or bf16",
    "elasticity": "elastic training is not implemented",
    "pipeline": "pipeline parallelism is not implemented (TP x DP only)",
    "sparse_attention": "the benchmark model has dense attention only",
    "compression_training": "compression training is not implemented",
    "data_efficiency": "data sampling and routing are not implemented (synthetic tokens)",
    "curriculum_learning": "curriculum learning is not implemented (synthetic tokens)",
    "progressive_layer_drop": "progressive layer drop is not implemented",
    "eigenvalue": "eigenvalue computation is not implemented",
    "quantize_training": "quantized training is not implemented",
    "autotuning": "use experiments/plan.py to search configurations",
}
OPTIMIZERS = ("adam", "adamw")  # DeepSpeed's names, lower case (it compares them lower-cased)


def _load(path_or_dict: str | Path | dict) -> tuple[dict, str]:
    if isinstance(path_or_dict, dict):
        return path_or_dict, "<dict>"
    path = Path(path_or_dict)
    try:
        values = json.loads(path.read_text())
    except OSError as e:
        raise DeepSpeedConfigError(str(path), f"cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise DeepSpeedConfigError(str(path), f"not valid JSON: {e}") from None
    if not isinstance(values, dict):
        raise DeepSpeedConfigError(str(path), f"must hold a JSON object, got {type(values).__name__}")
    return values, str(path)


def _checked(key: str, value: Any, kind: str, minimum: float | None = None) -> Any:
    """`value` as `kind` ("int", "number", "bool", "str", "betas"), or a one-line error naming `key`."""
    if value == "auto":
        raise DeepSpeedConfigError(key, '"auto" is a placeholder the Hugging Face Trainer fills in from its own '
                                        "arguments; write the value")
    if kind == "int" and isinstance(value, float) and value.is_integer():
        value = int(value)  # DeepSpeed's JSON files write sizes as 5e8
    ok = {"int": isinstance(value, int), "number": isinstance(value, (int, float)), "bool": isinstance(value, bool),
          "str": isinstance(value, str),
          "betas": isinstance(value, list) and len(value) == 2
          and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in value)}[kind]
    if not ok or (kind in ("int", "number") and isinstance(value, bool)):
        wanted = {"int": "an integer", "number": "a number", "bool": "true or false", "str": "a string",
                  "betas": "two numbers in [0, 1)"}[kind]
        raise DeepSpeedConfigError(key, f"must be {wanted}, got {json.dumps(value)}")
    if minimum is not None and value < minimum:
        raise DeepSpeedConfigError(key, f"must be >= {minimum:g}, got {json.dumps(value)}")
    return value


class _Block:
    """One JSON object being read: each of its keys is taken, ignored or rejected by name; `done`
    rejects any other."""

    def __init__(self, values: Any, prefix: str, ignored: dict[str, str]) -> None:
        if not isinstance(values, dict):
            raise DeepSpeedConfigError(prefix, f"must be an object, got {json.dumps(values)}")
        self.values, self.prefix, self.ignored, self.known = values, prefix, ignored, []

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def has(self, name: str) -> bool:
        self.known.append(name)
        return self.values.get(name) is not None

    def get(self, name: str, kind: str, default: Any, minimum: float | None = None) -> Any:
        return _checked(self.key(name), self.values[name], kind, minimum) if self.has(name) else default

    def alias(self, names: tuple[str, str], kind: str, default: Any, minimum: float | None = None) -> Any:
        """A key DeepSpeed accepts under two names (its field name and its stage3_ alias)."""
        given = [n for n in names if self.has(n)]
        if len(given) == 2:
            raise DeepSpeedConfigError(self.key(names[1]), f"is another name of {self.key(names[0])}: give one")
        return self.get(given[0], kind, default, minimum) if given else default

    def block(self, name: str) -> _Block | None:
        return _Block(self.values[name], self.key(name), self.ignored) if self.has(name) else None

    def require(self, name: str, honoured: Any, why: str) -> None:
        """A key this engine honours at one value only (`why` says why it cannot at another)."""
        if self.has(name) and _checked(self.key(name), self.values[name], "bool" if isinstance(honoured, bool)
                                       else "number") != honoured:
            raise DeepSpeedConfigError(self.key(name), why)

    def ignore(self, reasons: dict[str, str]) -> None:
        for name, why in reasons.items():
            if self.has(name):
                self.ignored[self.key(name)] = why

    def reject(self, reasons: dict[str, str]) -> None:
        """Blocks this engine cannot honour; one written {"enabled": false} is off, so ignored."""
        for name, why in reasons.items():
            if self.has(name):
                value = self.values[name]
                if isinstance(value, dict) and value.get("enabled") is False:
                    self.ignored[self.key(name)] = "disabled"
                else:
                    raise DeepSpeedConfigError(self.key(name), why)

    def done(self) -> None:
        unknown = [k for k in self.values if k not in self.known]
        if unknown:
            raise DeepSpeedConfigError(self.key(unknown[0]), f"unknown DeepSpeed key; known here: {sorted(set(self.known))}")


def _zero_optimization(top: _Block) -> dict:
    raw = top.values.get("zero_optimization") if top.has("zero_optimization") else {}
    if isinstance(raw, bool):  # DeepSpeed's deprecated form: true is stage 1 (read_zero_config_deprecated)
        raw = {"stage": int(raw)}
    z = _Block(raw, "zero_optimization", top.ignored)
    stage = z.values.get("stage", 0) if z.has("stage") else 0
    stage = _checked(z.key("stage"), stage, "int")  # its range: ZeroConfig's own check (config_error names this key)
    out = {"stage": stage,
           "reduce_bucket_size": z.get("reduce_bucket_size", "int", 500_000_000, 1),
           "allgather_bucket_size": z.get("allgather_bucket_size", "int", 500_000_000, 1),
           "overlap_comm": z.get("overlap_comm", "bool", stage == 3),  # DeepSpeed: on at stage 3 only
           "stage3_prefetch_bucket_size": z.alias(("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
                                                  "int", 50_000_000, 0),
           "stage3_param_persistence_threshold": z.alias(("stage3_param_persistence_threshold",
                                                          "param_persistence_threshold"), "int", 100_000, 0)}
    sub_group = z.get("sub_group_size", "int", 1_000_000_000, 1)
    if stage == 3:  # stage 3's optimizer steps its shard in sub-groups of this many elements: ours too
        out["optimizer_bucket_size"] = sub_group
    elif z.has("sub_group_size"):  # stage_1_and_2.py never reads it
        top.ignored[z.key("sub_group_size")] = ("stages 1-2 of DeepSpeed step the whole shard; the engine's chunked "
                                                "step (zero.optimizer_bucket_size) holds less")
    always = "this engine always does it (gradients in contiguous buckets, reduce-scattered; the post-step " \
             "parameters all-gathered): false cannot be honoured"
    for name in ("contiguous_gradients", "reduce_scatter", "allgather_partitions"):
        z.require(name, True, always)
    for name in ("offload_optimizer", "offload_param"):
        block = z.block(name)
        if block is not None:
            device = block.get("device", "str", "none")
            if device != "none":
                raise DeepSpeedConfigError(block.key("device"), f"{OFFLOAD}; remove the block or set device \"none\"")
            top.ignored[block.key("device")] = "\"none\": nothing offloaded (the block's other keys with it)"
    for name in ("cpu_offload", "cpu_offload_param"):  # the old names of offload_optimizer / offload_param
        z.require(name, False, f"{OFFLOAD}; remove the key")
    quantized = "ZeRO++'s quantized collectives are not implemented: collectives move the model's dtype"
    for name in ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients"):
        z.require(name, False, quantized)
    if z.get("zero_hpz_partition_size", "int", 1, 0) > 1:
        raise DeepSpeedConfigError(z.key("zero_hpz_partition_size"), "ZeRO++'s hierarchical partitioning (a "
                                   "secondary copy of the parameters within a node) is not implemented")
    if z.get("mics_shard_size", "int", -1) > 0:
        raise DeepSpeedConfigError(z.key("mics_shard_size"), "MiCS (sharding within a sub-group) is not implemented")
    z.require("legacy_stage1", False, "DeepSpeed's old stage 1 is not implemented; stage 1 here is the paper's Pos")
    z.ignore(ZERO_IGNORED)
    z.done()
    return out


def _precision(top: _Block) -> tuple[str, dict]:
    """The precision and, for fp16, the loss scaling (DeepSpeed's defaults where unsaid)."""
    fp16 = top.block("fp16")
    scaling, fp16_on = {}, False
    if fp16 is not None:
        fp16_on = fp16.get("enabled", "bool", False)
        scaling = {"loss_scale": float(fp16.get("loss_scale", "number", 0, 0)),
                   "initial_scale_power": fp16.get("initial_scale_power", "int", 16, 0),
                   "loss_scale_window": fp16.get("loss_scale_window", "int", 1000, 1),
                   "hysteresis": fp16.get("hysteresis", "int", 2, 1),
                   "consecutive_hysteresis": fp16.get("consecutive_hysteresis", "bool", False),
                   "min_loss_scale": float(fp16.get("min_loss_scale", "number", 1, 0))}
        fp16.require("fp16_master_weights_and_grads", False, "the optimizer's masters and gradients are fp32 here")
        fp16.ignore({"auto_cast": "the model's inputs are token ids: nothing to cast"})
        fp16.done()
    halves = {}
    for name in ("bf16", "bfloat16"):  # bfloat16: DeepSpeed's older name of the block
        block = top.block(name)
        if block is not None:
            halves[name] = block.get("enabled", "bool", False)
            block.ignore({"immediate_grad_update": "gradients are accumulated in fp32 here (ZeroConfig.reduce_dtype)"})
            block.done()
    if len(halves) == 2:
        raise DeepSpeedConfigError("bfloat16", "is DeepSpeed's older name of bf16: give one")
    bf16_on = any(halves.values())
    if fp16_on and bf16_on:
        raise DeepSpeedConfigError("fp16.enabled", f"true together with {next(iter(halves))}.enabled: choose one precision")
    if fp16_on:
        return "fp16", scaling
    return ("bf16" if bf16_on else "fp32"), {}  # loss scaling is fp16's only


def _optimizer(top: _Block) -> dict | None:
    block = top.block("optimizer")
    if block is None:
        return None
    kind = block.get("type", "str", None)
    if kind is None:
        raise DeepSpeedConfigError(block.key("type"), f"missing; allowed: {list(OPTIMIZERS)}")
    if kind.lower() not in OPTIMIZERS:
        why = " (LAMB's per-layer trust ratio needs each parameter whole, not a shard)" if "lamb" in kind.lower() else ""
        raise DeepSpeedConfigError(block.key("type"), f"{kind} is not implemented here{why}; this benchmark trains "
                                   f"with AdamW: type Adam or AdamW")
    block.ignore({"legacy_fusion": "DeepSpeed's old fused-kernel switch; the step is torch's AdamW"})
    params = block.block("params") or _Block({}, block.key("params"), top.ignored)
    block.done()
    torch_adam = params.get("torch_adam", "bool", False)
    # DeepSpeed's Adam is AdamW unless adam_w_mode is false (runtime/engine.py _configure_basic_optimizer)
    adam_w_mode = params.get("adam_w_mode", "bool", True)   # read for AdamW too: DeepSpeed accepts it there
    decoupled = kind.lower() == "adamw" or adam_w_mode
    # FusedAdam's defaults; with torch_adam DeepSpeed builds torch.optim.AdamW, whose weight decay is 0.01
    values = {"type": "adamw", "lr": float(params.get("lr", "number", 1e-3, 0)),
              "betas": [float(b) for b in params.get("betas", "betas", [0.9, 0.999])],
              "eps": float(params.get("eps", "number", 1e-8, 0)),
              "weight_decay": float(params.get("weight_decay", "number", 0.01 if torch_adam and decoupled else 0.0, 0))}
    if not decoupled and values["weight_decay"]:
        raise DeepSpeedConfigError(params.key("adam_w_mode"), "false makes weight decay an L2 term added to the "
                                   "gradient (Adam); this engine's AdamW decays the weights apart from it: set "
                                   "adam_w_mode true or weight_decay 0")
    if params.has("max_grad_norm"):  # DeepSpeed itself refuses it
        raise DeepSpeedConfigError(params.key("max_grad_norm"), "is not an optimizer parameter: use gradient_clipping")
    params.require("amsgrad", False, "AMSGrad is not implemented (nor by DeepSpeed's FusedAdam)")
    params.require("bias_correction", True, "torch's AdamW always corrects the moments' bias")
    params.ignore({"torch_adam": "the step is torch's AdamW either way",
                   "fused": "the step is torch's AdamW (foreach on CUDA)"})
    params.done()
    return values


def _activation_checkpointing(top: _Block) -> dict:
    """ZeRO-R's switches: the same names and meaning as ZeroConfig's (activations.py)."""
    block = top.block("activation_checkpointing")
    if block is None:
        return {}
    out = {name: block.get(name, "bool", False)
           for name in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")}
    out["number_checkpoints"] = block.get("number_checkpoints", "int", None, 1)
    block.ignore({"profile": "the record holds the step times",
                  "synchronize_checkpoint_boundary": "a CUDA synchronize for DeepSpeed's profiling; no effect on results"})
    block.done()
    return out


# The ZeroConfig fields a DeepSpeed config decides (DeepSpeed's default where it is silent; the
# accumulation only where it gives one), each with its DeepSpeed key
DEEPSPEED_KEYS = {"stage": "zero_optimization.stage", "precision": "fp16.enabled / bf16.enabled",
                  **{k: f"zero_optimization.{k}" for k in ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
                                                           "stage3_prefetch_bucket_size",
                                                           "stage3_param_persistence_threshold")},
                  "optimizer_bucket_size": "zero_optimization.sub_group_size",
                  "clip_grad_norm": "gradient_clipping", "grad_accum_steps": "gradient_accumulation_steps",
                  **{k: f"fp16.{k}" for k in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                                              "consecutive_hysteresis", "min_loss_scale")},
                  **{k: f"activation_checkpointing.{k}" for k in ("partition_activations", "cpu_checkpointing",
                                                                  "contiguous_memory_optimization",
                                                                  "number_checkpoints")}}


def read_deepspeed(path_or_dict: str | Path | dict) -> tuple[dict, dict]:
    """Read a DeepSpeed JSON config (a path, or the dict it holds): (the ZeroConfig fields it
    decides, the rest of a DeepSpeedConfig's fields). config.parse_deepspeed builds the two;
    raises DeepSpeedConfigError in one line naming the first key this engine cannot honour."""
    values, source = _load(path_or_dict)
    ignored: dict[str, str] = {}
    top = _Block(values, "", ignored)
    micro = top.get("train_micro_batch_size_per_gpu", "int", None, 1)
    total = top.get("train_batch_size", "int", None, 1)
    accum = top.get("gradient_accumulation_steps", "int", None, 1)
    clip = float(top.get("gradient_clipping", "number", 0.0, 0))
    precision, scaling = _precision(top)
    optimizer = _optimizer(top)
    zero = {**_zero_optimization(top), **_activation_checkpointing(top)}
    top.require("prescale_gradients", False, "gradients are reduced first, then averaged, as the paper's runs do")
    top.require("gradient_predivide_factor", 1.0, "gradients are averaged once, after their reduction")
    top.require("sparse_gradients", False, "the benchmark model has no sparse gradients")
    top.ignore({"prescale_gradients": "false: the engine's own order", "gradient_predivide_factor": "1.0: no pre-division",
                "sparse_gradients": "false: nothing sparse", **TOP_IGNORED})
    top.reject(TOP_REJECTED)
    top.done()
    if total is not None and total % ((micro or 1) * (accum or 1)):  # wrong at any DP degree
        raise _batch_error(total, micro, accum, "DP")
    decided = {"precision": precision, "clip_grad_norm": clip, **scaling, **zero,
               **({"grad_accum_steps": accum} if accum is not None else {})}
    return decided, {"micro_batch": micro, "train_batch_size": total, "grad_accum_steps": accum,
                     "optimizer": optimizer, "ignored": ignored, "source": source, "decides": tuple(decided)}


def config_error(error: ValueError, source: str) -> DeepSpeedConfigError:
    """ZeroConfig's refusal of a decided value, as the DeepSpeed key that set it."""
    field = re.search(r"ZeroConfig\.(\w+)", str(error))
    key = DEEPSPEED_KEYS.get(field.group(1), source) if field else source
    return DeepSpeedConfigError(key, re.sub(r"ZeroConfig\.\w+ ?", "", str(error)))
