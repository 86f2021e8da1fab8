"""Measured training steps against the step-time model: any CSV in the schema of one of the
development set's files (results/external/, provenance in its README), each row as the model's
inputs or the reason the model refuses it, predicted, and the error summary.

Two schemas, told apart by their columns:

- `vtrain`: vTrain's iteration times (vtrain_a100_single_node.csv, vtrain_a100_multi_node.csv;
  the multi-node file adds the parameter count first): Megatron-DeepSpeed 2023 on DGX A100 nodes,
  fp16 assumed, full recomputation, vTrain's default vocabulary. Rows run by system
  megatron_ds2023 unless given, on cluster dgx_a100, or dgx_a100_800g for a file with the
  parameter-count column: vTrain's multi-node runs had 800 Gb/s between nodes (its
  config/validation/multi/*.json), not a DGX A100's 1,600; `cluster=` overrides both.
- `throughput`: the sharded-data-parallel compilation (llm_foundry_a100_fsdp.csv), whose columns
  every file of its kind shares: measured tokens per second per GPU, the GPU, shape, sharding,
  precision and activation checkpointing per row. A row's source names its system
  (SOURCE_SYSTEMS: llm-foundry's rows run by llm_foundry_fsdp1, MPT's block as llm-foundry builds
  it, the gradients reduced in the dtype of the row's mixed-precision mode); a row of another
  source is refused unless `system=` names one (zero_repro: this engine at the ZeRO stage of the
  row's sharding strategy). The cluster comes from the row's GPU unless given. The row's
  attention_impl, where it names a kernel the model prices (ATTENTION_IMPLS, its first word:
  llm-foundry's attn_impl values), selects it; empty, the system's kernel; a name that does not
  say which kernel ran ("flash": flash-attn v1 or v2) refuses the row. It and the other
  provenance columns (THROUGHPUT_RUN) also tell families apart.

The error is on step time: ratio = predicted / measured seconds per step (for a throughput file,
measured / predicted tokens per second), error |ratio - 1|. A throughput file's summary adds the
ranking check (fastest_in_family): among rows alike but for micro-batch and activation
checkpointing, how often the model's fastest is the measured fastest.
"""
from __future__ import annotations

import csv
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from statistics import median

from experiments.analysis import step_time as st
from experiments.analysis.expected_error import quantile
from experiments.analysis.hardware import Hardware, profile
from experiments.analysis.systems import System
from experiments.models.gpt_shape import GPTShape

VTRAIN_VOCAB = 50257   # vTrain's configs' default vocabulary (GPT-2's), padded by Megatron to 128 x TP
VTRAIN_SYSTEM, VTRAIN_CLUSTER = "megatron_ds2023", "dgx_a100"
# a vTrain file with the parameter-count column (only the multi-node file has it) ran on nodes
# of 8 A100s with 800 Gb/s between them (inter_node_bandwidth: 800 in its
# config/validation/multi/*.json): conf/cluster/dgx_a100_800g.yaml
VTRAIN_MULTI_NODE_CLUSTER = "dgx_a100_800g"
PIPELINE_REFUSAL = "pipeline parallelism > 1: not modelled"
# vTrain's header -> the row's keys (the multi-node file's first column is optional)
VTRAIN_COLUMNS = {"# GPUs": "gpus", "global batch": "global_batch", "micro batch": "micro_batch",
                  "hidden size": "hidden", "attention heads": "heads", "# layers": "layers",
                  "sequence length": "seq_len", "tensor parallelism": "tp", "data parallelism": "dp",
                  "pipeline parallelism": "pp", "iteration time (ms)": "ms"}
VTRAIN_PARAMS = "Parameters (billion)"
# the throughput compilation's columns this reads (the rest are provenance); ints, then text
THROUGHPUT_INTS = ("gpus", "layers", "hidden", "heads", "vocab", "seq_len", "micro_batch", "global_batch", "tp", "pp")
THROUGHPUT_TEXT = ("source", "gpu", "sharding", "precision", "activation_checkpointing",
                   "measured_tokens_per_s_per_gpu")
# read when present: an empty cell or missing column takes the default (kv_heads: heads, ffn_hidden: 4 x hidden)
THROUGHPUT_OPTIONAL = ("kv_heads", "ffn_hidden", "dp", "cp", "activation_cpu_offload", "measured_tokens_per_s_total",
                       "mixed_precision_mode")
# the run's provenance, read as text when present (empty otherwise): not the model's inputs, but
# what rows must share to be one run but for micro-batch and checkpointing (FAMILY_KEY)
THROUGHPUT_RUN = ("commit_or_table", "software", "interconnect", "attention_impl", "compile")
# a throughput family (fastest_in_family): rows alike in every column that defines the run (the
# source and the commit its row first appeared at, the software image, the GPU and its count, the
# interconnect, the shape, the sequence length, the layout, sharding, precision and
# mixed-precision mode, the attention kernel, compilation, offload); free: the micro-batch, the
# activation checkpointing and the global batch and accumulation that follow from the micro-batch
# (llm-foundry's sweeps hold the accumulation, global batch = micro-batch x GPUs x accumulation; a
# sweep at a fixed global batch holds the batch). An unrecorded software image is its own text:
# not known equal to a recorded one.
FAMILY_KEY = ("source", "gpu", "gpus", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len",
              "sharding", "dp", "tp", "pp", "cp", "precision", "mixed_precision_mode", "activation_cpu_offload",
              *THROUGHPUT_RUN)
FAMILY_RULE = "the largest micro-batch without activation checkpointing"
# FSDP's sharding strategies as ZeRO stages (the compilation names them inside longer text)
SHARDING_STAGES = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0}
# a throughput row's attention_impl (its first word, lower case, up to the first character that
# is neither a letter nor a digit) -> the kernel the model prices (attention.MEASURED):
# llm-foundry's attn_impl `triton` is its Triton flash kernel; `flash2` names FlashAttention-2, as
# does `flash` or `flashattention` with a version 2 in the cell ("flash (v2.3.6)"). A bare `flash`
# is whichever flash-attn was installed (v1 with torch 1.13's images, v2 with `.[gpu-flash2]`):
# refused. MPT's `torch` attention is refused too: the model's unfused path is priced faster than
# the PyTorch attention flash-attention's own figures measured (A100, H100), so it is not claimed
ATTENTION_IMPLS = {"triton": "flash_triton", "flash2": "flash2"}
# a throughput row's GPU -> the profile of its machine
GPU_CLUSTERS = {"A100 80GB": "dgx_a100", "A100 40GB": "dgx_a100_40gb", "H100 80GB": "dgx_h100"}
# a throughput row's source -> the system that models its stack, and its model's block as the
# source builds it (the file has no columns for these): llm-foundry's benchmark MPT keeps its
# config's defaults, biases on (no_bias: False; its pretrain yamls do not set it), learned
# positions, GeLU, (low-precision) LayerNorm, the logits on the tied word embedding
# (llmfoundry/models/mpt/configuration_mpt.py, modeling_mpt.py @ b2a43a14)
SOURCE_SYSTEMS = {"llm-foundry": "llm_foundry_fsdp1"}
SOURCE_MODELS = {"llm-foundry": {"bias": True, "position": "learned", "mlp": "gelu", "norm": "layernorm",
                                 "tie_embeddings": True}}
# FSDP's mixed-precision mode (the row's mixed_precision_mode names it) -> bytes of a reduced
# gradient element: Composer's PURE reduces in bf16, DEFAULT in fp32 from Composer 0.16.4 on
# (mosaic_fsdp_utils.py; 0.13.4's DEFAULT left it to torch 1.13.1, which reduced in bf16); the
# file's DEFAULT rows all ran Composer 0.16-0.17 (their mixed_precision_mode says so)
REDUCE_BYTES = {"PURE": 2, "DEFAULT": 4}
# the sequence-length bands of the summary: the development set's lengths are 512-2,048,
# 4,096-8,192 and 16,384-65,536; a length between two bands falls in the upper one
SEQ_BANDS = ((2048, "<=2k"), (8192, "4-8k"), (float("inf"), ">=16k"))


@dataclass(frozen=True)
class Schema:
    """A file kind: what its measured column is in and the columns the summary groups by."""

    name: str
    description: str
    unit: str                              # "s/step" or "tokens/s/GPU"
    groups: tuple[tuple[str, str], ...]    # (label, row key) the median ratio is grouped by


VTRAIN = Schema("vtrain", "vTrain's Megatron-DeepSpeed iteration times", "s/step",
                (("TP", "tp"), ("sequence length", "seq_band")))
THROUGHPUT = Schema("throughput", "measured throughput of sharded data parallelism", "tokens/s/GPU",
                    (("TP", "tp"), ("sequence length", "seq_band"), ("GPU", "gpu"), ("sharding", "sharding"),
                     ("activation checkpointing", "activation_checkpointing")))


@dataclass(frozen=True)
class Outcome:
    """One row of a file: its prediction by `system` on `cluster`, or why it is refused."""

    index: int                        # the row's 0-based position among the file's data rows
    row: dict
    measured: float | None            # in the schema's unit
    measured_step_s: float | None
    system: str | None = None
    cluster: str | None = None
    prediction: st.StepTime | None = None
    reason: str | None = None         # refused: why
    tokens_per_step: float | None = field(default=None, repr=False)   # throughput rows: global batch x sequence

    @property
    def ratio(self) -> float | None:
        """Predicted / measured seconds per step."""
        return None if self.prediction is None else self.prediction.step_s / self.measured_step_s

    @property
    def predicted(self) -> float | None:
        """The prediction in the file's unit."""
        if self.prediction is None:
            return None
        if self.tokens_per_step is None:
            return self.prediction.step_s
        return self.tokens_per_step / (self.prediction.step_s * self.row["gpus"])


class SchemaError(ValueError):
    """A file whose columns match no schema, or that cannot be read."""


def seq_band(seq_len: int) -> str:
    return next(label for top, label in SEQ_BANDS if seq_len <= top)


def read(path: str | Path) -> tuple[Schema, list[dict]]:
    """The file's schema and its rows (text by column; the first byte may be a UTF-8 byte-order mark)."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            reader = csv.DictReader(f)
            header = [c.strip() for c in reader.fieldnames or []]
            rows = [{k.strip(): (v or "").strip() for k, v in r.items() if k is not None} for r in reader]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise SchemaError(f"{path}: cannot be read ({e})") from None
    missing_vtrain = [c for c in VTRAIN_COLUMNS if c not in header]
    missing_throughput = [c for c in THROUGHPUT_INTS + THROUGHPUT_TEXT if c not in header]
    if not missing_vtrain:
        return VTRAIN, rows
    if not missing_throughput:
        return THROUGHPUT, rows
    raise SchemaError(f"{path}: its columns match no known schema: vTrain's iteration times lack "
                      f"{missing_vtrain[:3]}, the throughput compilation's lack {missing_throughput[:3]} "
                      f"(results/external/README.md describes both)")


def _cell(text: dict, col: str, kind: type) -> int | float | bool:
    """A cell as a positive int or float (every size and measurement here is), or a bool
    (True/False); ValueError naming the column."""
    value = text.get(col, "")
    try:
        if kind is bool:
            if value.lower() not in ("true", "false"):
                raise ValueError
            return value.lower() == "true"
        number = kind(value)
        if number <= 0:
            raise ValueError
        return number
    except ValueError:
        raise ValueError(f"column {col} = {value!r}") from None


def vtrain_row(text: dict) -> dict:
    """A vTrain row typed: the keys of VTRAIN_COLUMNS (ms a float, the rest ints), params_b if given."""
    row = {key: _cell(text, col, float if key == "ms" else int) for col, key in VTRAIN_COLUMNS.items()}
    if text.get(VTRAIN_PARAMS):
        row["params_b"] = _cell(text, VTRAIN_PARAMS, float)
    return row


@cache
def vtrain_rows(path: Path) -> tuple[dict, ...]:
    """Every row of a vTrain file, typed (SchemaError for a file of another schema)."""
    schema, rows = read(path)
    if schema is not VTRAIN:
        raise SchemaError(f"{path}: not a vTrain iteration-time file")
    return tuple(vtrain_row(r) for r in rows)


def vtrain_inputs(row: dict) -> st.StepInputs:
    """A vTrain row as the model's input: Megatron's padded vocabulary and parameters per TP rank,
    fp16, full recomputation, the global batch accumulated over micro-batches of the DP degree."""
    model = {"layers": row["layers"], "hidden": row["hidden"], "heads": row["heads"], "seq_len": row["seq_len"],
             "vocab_size": VTRAIN_VOCAB}
    grad_accum = row["global_batch"] // (row["micro_batch"] * row["dp"])
    return st.StepInputs(**st.shape_inputs(model, row["tp"]), micro_batch=row["micro_batch"], tp=row["tp"],
                         dp=row["dp"], stage=0, recompute=True, grad_accum=grad_accum, element_bytes=2)


def _shape_refusal(row: dict, model_parallel: int) -> str | None:
    """Why the model cannot express a row's parallel layout or shape, or None."""
    if row["pp"] > 1:
        return PIPELINE_REFUSAL
    if row["tp"] * row["dp"] * model_parallel != row["gpus"]:
        return "shape: GPUs != TP x DP x PP (x CP)"
    if row["global_batch"] % (row["micro_batch"] * row["dp"]):
        return "shape: global batch not a multiple of micro-batch x DP"
    try:
        GPTShape(row["layers"], row["hidden"], row["heads"]).check_tp(row["tp"])
    except ValueError as e:
        return f"shape: {e}"
    return None


@cache
def hardware(cluster: str) -> Hardware:
    return profile(cluster)


def _predicted(base: Outcome, x: st.StepInputs, system: str | System, cluster: str) -> Outcome:
    """base predicted by `system` (a name, or a System: a variant of one) on `cluster`, or
    refused where the system cannot run x."""
    spec = st.resolve_system(system)
    if x.stage not in spec.stages:
        return _refused(base, f"system {spec.name} runs ZeRO stages {list(spec.stages)}, not {x.stage}")
    try:
        prediction = st.predict(x, hardware(cluster), spec)
    except ValueError as e:   # a constraint of the model's own (a kernel it cannot size, ...)
        return _refused(base, f"the model cannot express it: {e}")
    return Outcome(base.index, base.row, base.measured, base.measured_step_s, spec.name, cluster, prediction,
                   tokens_per_step=base.tokens_per_step)


def _refused(base: Outcome, reason: str) -> Outcome:
    return Outcome(base.index, base.row, base.measured, base.measured_step_s, reason=reason,
                   tokens_per_step=base.tokens_per_step)


def _vtrain_outcome(index: int, text: dict, row: dict, system: str | None, cluster: str | None) -> Outcome:
    base = Outcome(index, row, row["ms"] * 1e-3, row["ms"] * 1e-3)
    why = _shape_refusal(row, row["pp"])
    if why:
        return _refused(base, why)
    default = VTRAIN_MULTI_NODE_CLUSTER if VTRAIN_PARAMS in text else VTRAIN_CLUSTER
    return _predicted(base, vtrain_inputs(row), system or VTRAIN_SYSTEM, cluster or default)


def throughput_row(text: dict) -> dict:
    """A throughput row typed (ValueError naming the column a cell does not parse in); an empty
    optional cell takes its default: kv_heads the heads, ffn_hidden 4 x hidden, CP 1, DP the rest
    of the GPUs, no offload, tokens per GPU the total over the GPUs."""
    row = {col: _cell(text, col, int) for col in THROUGHPUT_INTS} | {col: text[col] for col in THROUGHPUT_TEXT}
    given = {col for col in THROUGHPUT_OPTIONAL if text.get(col)}
    row["kv_heads"] = _cell(text, "kv_heads", int) if "kv_heads" in given else row["heads"]
    row["ffn_hidden"] = _cell(text, "ffn_hidden", int) if "ffn_hidden" in given else 4 * row["hidden"]
    row["cp"] = _cell(text, "cp", int) if "cp" in given else 1
    row["dp"] = _cell(text, "dp", int) if "dp" in given else row["gpus"] // (row["tp"] * row["pp"] * row["cp"])
    row["activation_cpu_offload"] = "activation_cpu_offload" in given and _cell(text, "activation_cpu_offload", bool)
    row["recompute"] = _cell(text, "activation_checkpointing", bool)
    row["mixed_precision_mode"] = text.get("mixed_precision_mode", "")
    row |= {col: text.get(col, "") for col in THROUGHPUT_RUN}
    if row["measured_tokens_per_s_per_gpu"] or "measured_tokens_per_s_total" not in given:
        row["tokens_per_s_per_gpu"] = _cell(text, "measured_tokens_per_s_per_gpu", float)
    else:
        row["tokens_per_s_per_gpu"] = _cell(text, "measured_tokens_per_s_total", float) / row["gpus"]
    return row


def attention_kernel(row: dict) -> str | None:
    """The kernel a throughput row's attention_impl names (ATTENTION_IMPLS); None where the cell is
    empty (the system's own); ValueError where it names none the model prices."""
    words = [w for w in re.split(r"[^a-z0-9.]+", row.get("attention_impl", "").lower()) if w]
    if not words:
        return None
    name = words[0]
    if name in ("flash", "flashattention") and any(re.fullmatch(r"v?2(\.[0-9.]*)?", w) for w in words[1:]):
        name = "flash2"
    if name not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl {words[0]!r}: not one the model prices (its first word one of "
                         f"{', '.join(ATTENTION_IMPLS)}, or flash with its version 2; a bare 'flash' does not "
                         f"say which flash-attn ran)")
    return ATTENTION_IMPLS[name]


def _throughput_refusal(row: dict) -> str | None:
    """Why the model cannot express a throughput row beyond its layout and its attention kernel, or None."""
    if row["cp"] > 1:
        return "context parallelism > 1: not modelled"
    if row["activation_cpu_offload"]:
        return "activation CPU offload: not modelled"
    if row["precision"].removeprefix("amp_") not in st.PRECISION_BYTES:
        return f"precision {row['precision']!r}: not modelled"
    if not any(name in row["sharding"] for name in SHARDING_STAGES):
        return f"sharding {row['sharding']!r}: not modelled"
    return None


def _throughput_outcome(index: int, text: dict, row: dict, system: str | None, cluster: str | None) -> Outcome:
    tokens = row["global_batch"] * row["seq_len"]
    base = Outcome(index, row, row["tokens_per_s_per_gpu"], tokens / (row["tokens_per_s_per_gpu"] * row["gpus"]),
                   tokens_per_step=tokens)
    try:
        attention, unpriced = attention_kernel(row), None
    except ValueError as e:
        attention, unpriced = None, str(e)
    why = _shape_refusal(row, row["pp"] * row["cp"]) or unpriced or _throughput_refusal(row)
    if why:
        return _refused(base, why)
    stage = next(stage for name, stage in SHARDING_STAGES.items() if name in row["sharding"])
    source = next((name for name in SOURCE_SYSTEMS if name in row["source"]), None)
    if system is None and source is None:
        return _refused(base, f"no system models {row['source'] or 'this source'}'s stack "
                              "(system= names one: zero_repro predicts this engine at the row's ZeRO stage)")
    if cluster is None and row["gpu"] not in GPU_CLUSTERS:
        return _refused(base, f"no step-time profile for GPU {row['gpu']!r} (give cluster= to predict on one)")
    model = {"layers": row["layers"], "hidden": row["hidden"], "heads": row["heads"], "seq_len": row["seq_len"],
             "vocab_size": row["vocab"], "ffn_hidden": row["ffn_hidden"], "kv_heads": row["kv_heads"],
             **SOURCE_MODELS.get(source, {})}
    mode = next((bytes_ for name, bytes_ in REDUCE_BYTES.items() if name in row["mixed_precision_mode"]), None)
    x = st.StepInputs(**st.shape_inputs(model, row["tp"]), micro_batch=row["micro_batch"], tp=row["tp"],
                      dp=row["dp"], stage=stage, recompute=row["recompute"],
                      grad_accum=row["global_batch"] // (row["micro_batch"] * row["dp"]),
                      element_bytes=st.PRECISION_BYTES[row["precision"].removeprefix("amp_")], reduce_bytes=mode,
                      attention=attention)
    return _predicted(base, x, system or SOURCE_SYSTEMS[source], cluster or GPU_CLUSTERS[row["gpu"]])


def predict_file(path: str | Path, system: str | System | None = None,
                 cluster: str | None = None) -> tuple[Schema, list[Outcome]]:
    """Every row of the file predicted or refused; `system` (a name, or a System: a variant of one,
    reports/dev_set.py's with its host constants left one source out) and `cluster` replace each
    row's own."""
    schema, rows = read(path)
    typed, outcome = (vtrain_row, _vtrain_outcome) if schema is VTRAIN else (throughput_row, _throughput_outcome)
    outcomes = []
    for i, text in enumerate(rows):
        try:
            row = typed(text)
        except ValueError as e:   # the row alone is refused, naming its column; the file goes on
            outcomes.append(Outcome(i, text, None, None, reason=f"unreadable: {e}"))
            continue
        row["seq_band"] = seq_band(row["seq_len"])
        outcomes.append(outcome(i, text, row, system, cluster))
    return schema, outcomes


# -- the summary ------------------------------------------------------------------------------
def error_stats(ratios: list[float]) -> dict:
    """Rows, median ratio and |ratio - 1|'s median, 90th percentile and worst; the worst factor."""
    errors = [abs(r - 1) for r in ratios]
    return {"rows": len(ratios), "median_ratio": median(ratios), "median_error": median(errors),
            "p90_error": quantile(errors, 0.9), "worst_error": max(errors),
            "worst_factor": max(max(r, 1 / r) for r in ratios)}


def families(outcomes: list[Outcome]) -> list[list[Outcome]]:
    """The predicted throughput rows grouped by FAMILY_KEY: families of two rows or more, each in
    file order."""
    groups = defaultdict(list)
    for o in outcomes:
        if o.prediction is not None:
            groups[tuple(o.row[k] for k in FAMILY_KEY)].append(o)
    return [f for f in groups.values() if len(f) > 1]


def _rule_pick(family: list[Outcome]) -> Outcome:
    """FAMILY_RULE's row: the largest micro-batch among the rows without checkpointing (among all
    where every row checkpoints), the first in file order at a tie."""
    plain = [o for o in family if not o.row["recompute"]] or family
    return max(plain, key=lambda o: (o.row["micro_batch"], -o.index))


def fastest_in_family(schema: Schema, outcomes: list[Outcome]) -> dict | None:
    """The ranking check on a throughput file (issue 36: the fastest right in >= 80% of families):
    among the families of predicted rows alike but for micro-batch and activation checkpointing
    (`families`, FAMILY_KEY), how often the row the model predicts fastest (the highest predicted
    tokens/s/GPU; the first in file order at a tie) is the measured fastest (the highest measured
    tokens/s/GPU; at a measured tie, any of the tied rows is right); the same for FAMILY_RULE, the
    trivial rule; and the measured runner-up's gap (fastest / runner-up throughput - 1, 0 at a
    tie), its median and smallest over the families. fraction and the gaps are None without a
    family. None for a vTrain file (its families are TP's: reports/validation.tp_ranking)."""
    if schema is not THROUGHPUT:
        return None
    found = families(outcomes)

    def right(pick: Outcome, family: list[Outcome]) -> bool:
        return pick.measured == max(o.measured for o in family)

    model = sum(right(max(f, key=lambda o: (o.predicted, -o.index)), f) for f in found)
    rule = sum(right(_rule_pick(f), f) for f in found)
    gaps = [top / second - 1 for top, second in (sorted((o.measured for o in f), reverse=True)[:2] for f in found)]
    return {"families": len(found), "rows": sum(len(f) for f in found), "right": model,
            "fraction": model / len(found) if found else None, "rule": FAMILY_RULE, "rule_right": rule,
            "runner_up_gap_median": median(gaps) if gaps else None, "runner_up_gap_min": min(gaps) if gaps else None}


def fastest_in_family_text(f: dict) -> str:
    """fastest_in_family's result as one line (validate's table, dev_set's reports)."""
    head = "fastest in family (predicted rows alike but for micro-batch and activation checkpointing): "
    if not f["families"]:
        return head + "no family of 2 or more rows, untested"
    return head + (f"right in {f['right']} of {f['families']} ({f['fraction']:.0%}); {f['rule']} (no model): "
                   f"{f['rule_right']}; the measured runner-up {f['runner_up_gap_median']:.1%} slower at the median "
                   f"(closest {f['runner_up_gap_min']:.1%})")


def summary(schema: Schema, outcomes: list[Outcome]) -> dict:
    """Rows predicted (by system and cluster) and refused (by reason), the error over the
    predicted rows (None without any), the median ratio by each of the schema's groups, and for
    a throughput file the fastest-in-family check (fastest_in_family; None for vTrain's)."""
    done = [o for o in outcomes if o.prediction is not None]
    out = {"schema": schema.name, "description": schema.description, "unit": schema.unit, "rows": len(outcomes),
           "predicted": len(done),
           "predicted_by": dict(Counter(f"{o.system} on {o.cluster}" for o in done)),
           "refused": len(outcomes) - len(done),
           "refused_by_reason": dict(Counter(o.reason for o in outcomes if o.prediction is None).most_common()),
           "error": None, "median_ratio_by_group": {}, "fastest_in_family": fastest_in_family(schema, outcomes)}
    if not done:
        return out
    stats = error_stats([o.ratio for o in done])
    worst = max(done, key=lambda o: abs(o.ratio - 1))
    out["error"] = {"median": stats["median_error"], "p90": stats["p90_error"], "worst": stats["worst_error"],
                    "worst_row": worst.index, "median_ratio": stats["median_ratio"]}
    for label, key in schema.groups:
        parts = defaultdict(list)
        for o in done:
            parts[o.row[key]].append(o.ratio)
        out["median_ratio_by_group"][label] = {str(v): {"rows": len(r), "median_ratio": median(r)}
                                               for v, r in sorted(parts.items(), key=_group_order)}
    return out


def _group_order(item: tuple) -> tuple:
    """Numbers in numeric order, the sequence bands in SEQ_BANDS' order, text after."""
    value = item[0]
    bands = [label for _, label in SEQ_BANDS]
    if isinstance(value, (int, float)):
        return (0, value, "")
    return (1, bands.index(value), "") if value in bands else (2, 0, str(value))


def per_row(schema: Schema, o: Outcome) -> dict:
    """One row's JSON object: predicted or refused, in the file's unit, with the step's terms (s)."""
    return {"index": o.index, "status": "predicted" if o.prediction else "refused", "reason": o.reason,
            "system": o.system, "cluster": o.cluster, "unit": schema.unit, "predicted": o.predicted,
            "measured": o.measured, "ratio": o.ratio, "measured_step_s": o.measured_step_s,
            "predicted_step_s": o.prediction.step_s if o.prediction else None,
            "terms": dict(o.prediction.terms) if o.prediction else None}
