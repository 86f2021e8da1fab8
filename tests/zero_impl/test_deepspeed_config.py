"""DeepSpeed's JSON config read as ZeroConfig (zero_impl/deepspeed.py): the shapes of DeepSpeed's
own docs and examples (our copies) parse to the values DeepSpeed gives them, bad input is one
line naming the key, and the loss scaler's hysteresis follows DeepSpeed's DynamicLossScaler."""
from __future__ import annotations

import json

import pytest
import torch

import zero_impl
from zero_impl import DeepSpeedConfigError, ZeroConfig, checkpoint, parse_deepspeed
from zero_impl.checkpoint.state_dict import pack, unpack
from zero_impl.loss_scaler import LossScaler
from helpers import make_model, param_groups

# The shape of the example at the top of DeepSpeed's config-json docs page: ZeRO as a bare
# boolean (DeepSpeed's deprecated form, stage 1), fp16 with every scaling default.
DOCS_EXAMPLE = {"train_batch_size": 8, "gradient_accumulation_steps": 1,
                "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
                "fp16": {"enabled": True}, "zero_optimization": True}
# The shape of the ZeRO tutorial's stage-2 block plus DeepSpeedExamples' Megatron-LM
# ds_zero_stage_2_config.json (its max_grad_norm left out: DeepSpeed itself refuses it).
MEGATRON_ZERO2 = {
    "train_batch_size": 512, "gradient_accumulation_steps": 1, "steps_per_print": 1,
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "reduce_scatter": True,
                          "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                          "overlap_comm": True, "contiguous_gradients": True},
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "betas": [0.9, 0.95]}},
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    "wall_clock_breakdown": True, "zero_allow_untested_optimizer": False}
# The shape of the ZeRO-3 tutorial's block, nothing offloaded.
ZERO3 = {
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "contiguous_gradients": True, "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 1e7,
                          "stage3_param_persistence_threshold": 1e5, "reduce_bucket_size": 1e7,
                          "sub_group_size": 1e8, "offload_optimizer": {"device": "none"},
                          "offload_param": {"device": "none", "pin_memory": True},
                          "stage3_gather_16bit_weights_on_model_save": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}}}
# A bf16 ZeRO-1 config in DeepSpeed's older bfloat16 spelling, with ZeRO-R's switches.
BF16_ZERO1 = {
    "train_batch_size": 64, "train_micro_batch_size_per_gpu": 8,
    "bfloat16": {"enabled": True}, "zero_optimization": {"stage": 1},
    "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                 "contiguous_memory_optimization": True, "number_checkpoints": 4,
                                 "synchronize_checkpoint_boundary": False, "profile": False},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-6,
                                              "weight_decay": 0.01, "torch_adam": True}}}


def test_docs_example_takes_deepspeeds_defaults():
    ds = parse_deepspeed(DOCS_EXAMPLE)
    z = ds.zero
    assert (z.stage, z.precision, z.grad_accum_steps, z.clip_grad_norm) == (1, "fp16", 1, 0.0)
    # DeepSpeedZeroConfig's defaults (deepspeed/runtime/zero/config.py), not this engine's 4e7; its
    # sub_group_size is stage 3's alone (stage_1_and_2.py steps the whole shard): the engine's chunks stay
    assert (z.reduce_bucket_size, z.allgather_bucket_size) == (500_000_000, 500_000_000)
    assert z.optimizer_bucket_size == ZeroConfig.optimizer_bucket_size
    assert z.overlap_comm is False and z.stage3_prefetch_bucket_size == 50_000_000
    assert z.stage3_param_persistence_threshold == 100_000
    # fp16's defaults (deepspeed/runtime/constants.py): dynamic from 2**16, window 1000, hysteresis 2, min 1
    assert (z.loss_scale, z.initial_scale_power, z.loss_scale_window, z.hysteresis, z.consecutive_hysteresis,
            z.min_loss_scale) == (0.0, 16, 1000, 2, False, 1.0)
    # DeepSpeed's Adam is AdamW; FusedAdam's defaults for what the block omits
    assert ds.optimizer == {"type": "adamw", "lr": 0.00015, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    assert (ds.micro_batch, ds.train_batch_size, ds.grad_accum_steps, ds.ignored) == (None, 8, 1, {})
    assert ds.batch_for(2) == (4, 1) and ds.batch_for(8) == (1, 1)
    assert {"stage", "precision", "reduce_bucket_size", "clip_grad_norm", "hysteresis",
            "grad_accum_steps"} <= set(ds.decides) and "partition_activations" not in ds.decides
    assert "optimizer_bucket_size" not in ds.decides


def test_sub_group_size_acts_at_stage_3_only_and_adamw_takes_adam_w_mode():
    stage2 = parse_deepspeed({"train_batch_size": 8, "zero_optimization": {"stage": 2, "sub_group_size": 1e8},
                              "optimizer": {"type": "AdamW", "params": {"adam_w_mode": True, "weight_decay": 0.1}}})
    assert stage2.zero.optimizer_bucket_size == ZeroConfig.optimizer_bucket_size
    assert "zero_optimization.sub_group_size" in stage2.ignored and stage2.optimizer["weight_decay"] == 0.1
    stage3 = parse_deepspeed({"train_batch_size": 8, "zero_optimization": {"stage": 3, "sub_group_size": 1e8}})
    assert stage3.zero.optimizer_bucket_size == 100_000_000 and "optimizer_bucket_size" in stage3.decides


def test_megatron_zero2_example(tmp_path):
    path = tmp_path / "ds_zero_stage_2_config.json"
    path.write_text(json.dumps(MEGATRON_ZERO2))
    ds = parse_deepspeed(path)
    z = ds.zero
    assert (z.stage, z.precision, z.clip_grad_norm, z.overlap_comm) == (2, "fp16", 1.0, True)
    assert (z.reduce_bucket_size, z.allgather_bucket_size) == (50_000_000, 50_000_000)
    assert (z.hysteresis, z.loss_scale_window, z.min_loss_scale) == (2, 1000, 1.0)
    assert ds.optimizer["betas"] == [0.9, 0.95] and ds.optimizer["lr"] == 0.00015
    assert ds.source == str(path)
    assert sorted(ds.ignored) == ["steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer"]
    assert ds.batch_for(64) == (8, 1) and ds.batch_for(512) == (1, 1)  # 512 = micro x 1 x DP
    assert ZeroConfig.from_deepspeed(path) == z


def test_zero3_example():
    ds = parse_deepspeed(ZERO3)
    z = ds.zero
    assert (z.stage, z.precision, z.grad_accum_steps) == (3, "bf16", 2)
    assert z.overlap_comm is True  # DeepSpeed's default at stage 3 only
    assert (z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (10_000_000, 100_000)
    assert (z.reduce_bucket_size, z.optimizer_bucket_size) == (10_000_000, 100_000_000)
    assert z.hysteresis == 1  # loss scaling is fp16's only: bf16 keeps the engine's default
    assert ds.optimizer == {"type": "adamw", "lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}
    assert set(ds.ignored) == {"zero_optimization.stage3_max_live_parameters",
                               "zero_optimization.stage3_max_reuse_distance",
                               "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                               "zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device"}
    assert "stage3_max_live_units" in ds.ignored["zero_optimization.stage3_max_live_parameters"]
    assert ds.batch_for(4) == (4, 2)  # no train_batch_size: DeepSpeed computes it, nothing to check
    # bf16: the loss scaling is not the JSON's to decide; no activation_checkpointing block: nor ZeRO-R
    assert not {"hysteresis", "loss_scale", "partition_activations", "cpu_checkpointing"} & set(ds.decides)


def test_bf16_zero1_example_maps_zero_r():
    ds = parse_deepspeed(BF16_ZERO1)
    z = ds.zero
    assert (z.stage, z.precision, z.grad_accum_steps) == (1, "bf16", 1)  # accumulation: batch_for's
    assert (z.partition_activations, z.cpu_checkpointing, z.contiguous_memory_optimization,
            z.number_checkpoints) == (True, True, True, 4)
    # torch_adam: DeepSpeed builds torch.optim.AdamW, given weight decay 0.01 here
    assert ds.optimizer == {"type": "adamw", "lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.01}
    assert ds.batch_for(4) == (8, 2)  # 64 = 8 x accumulation x 4
    assert {"partition_activations", "number_checkpoints"} <= set(ds.decides) and "grad_accum_steps" not in ds.decides
    assert set(ds.ignored) == {"activation_checkpointing.profile",
                               "activation_checkpointing.synchronize_checkpoint_boundary",
                               "optimizer.params.torch_adam"}


def test_torch_adam_weight_decay_default_is_torchs():
    block = {"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}
    assert parse_deepspeed(block).optimizer["weight_decay"] == 0.01  # torch.optim.AdamW's default
    assert parse_deepspeed({"optimizer": {"type": "AdamW"}}).optimizer["weight_decay"] == 0.0  # FusedAdam's


@pytest.mark.parametrize("values, message", [
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage: must be one of [0, 1, 2, 3], got 4"),
    ({"zero_optimization": {"stage": "2"}}, 'zero_optimization.stage: must be an integer, got "2"'),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": [5e8]}},
     "zero_optimization.reduce_bucket_size: must be an integer, got [500000000.0]"),
    ({"zero_optimization": {"overlap_comm": 1}}, "zero_optimization.overlap_comm: must be true or false, got 1"),
    ({"train_micro_batch_size_per_gpu": True}, "train_micro_batch_size_per_gpu: must be an integer, got true"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     "train_batch_size: 10 != train_micro_batch_size_per_gpu x gradient_accumulation_steps x DP = 4 x 2 x DP"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}},
     "zero_optimization.offload_optimizer.device: offloading to the CPU/NVMe (ZeRO-Offload, ZeRO-Infinity) is not "
     'implemented by this engine; remove the block or set device "none"'),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "zero_optimization.offload_param.device"),
    ({"zero_optimization": {"cpu_offload": True}}, "zero_optimization.cpu_offload: offloading"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
     "zero_optimization.zero_quantized_weights: ZeRO++'s quantized collectives are not implemented"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}, "zero_optimization.zero_hpz_partition_size"),
    ({"zero_optimization": {"contiguous_gradients": False}}, "zero_optimization.contiguous_gradients: this engine "
                                                             "always does it"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "optimizer.type: Lamb is not implemented here"),
    ({"optimizer": {"type": "OneBitAdam"}}, "optimizer.type: OneBitAdam is not implemented here"),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}},
     "optimizer.params.adam_w_mode: false makes weight decay an L2 term"),
    ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}},
     "optimizer.params.max_grad_norm: is not an optimizer parameter: use gradient_clipping"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}},
     "scheduler: this benchmark trains at a constant learning rate"),
    ({"amp": {"enabled": True}}, "amp: NVIDIA Apex AMP is not used"),
    ({"zero_optimization": {"stage": 2, "reduce_buket_size": 5e8}},
     "zero_optimization.reduce_buket_size: unknown DeepSpeed key; known here: ["),
    ({"train_batch_sise": 8}, "train_batch_sise: unknown DeepSpeed key"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled: true together with bf16.enabled"),
    ({"train_micro_batch_size_per_gpu": "auto"}, 'train_micro_batch_size_per_gpu: "auto" is a placeholder'),
    ({"fp16": {"enabled": "auto"}}, 'fp16.enabled: "auto" is a placeholder'),
    ({"activation_checkpointing": {"cpu_checkpointing": True}},
     "activation_checkpointing.cpu_checkpointing: (Pa+cpu) moves the partitioned checkpoints to the host"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis: must be >= 1, got 0"),
])
def test_bad_input_is_one_line_naming_the_key(values, message):
    with pytest.raises(DeepSpeedConfigError) as error:
        parse_deepspeed(values)
    text = str(error.value)
    assert text.startswith(f"deepspeed_config {message}") and "\n" not in text, text


def test_inconsistent_batch_at_a_dp_degree():
    ds = parse_deepspeed({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2})
    assert ds.batch_for(2) == (3, 2)
    with pytest.raises(DeepSpeedConfigError, match=r"train_batch_size: 12 != .* = 3 x 2 x 3 \(DeepSpeed's rule\)"):
        ds.batch_for(3)
    inferred = parse_deepspeed({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3})
    assert inferred.batch_for(2) == (3, 2)
    with pytest.raises(DeepSpeedConfigError, match=r"= 3 x \? x 8 for any whole \?"):
        inferred.batch_for(8)
    assert parse_deepspeed({"train_batch_size": 12, "gradient_accumulation_steps": 3}).batch_for(2) == (2, 3)
    assert parse_deepspeed({"train_micro_batch_size_per_gpu": 3}).batch_for(5) == (3, 1)  # DeepSpeed: accumulation 1
    assert parse_deepspeed({}).batch_for(4) == (None, None)


def test_disabled_blocks_and_harmless_values_are_ignored():
    ds = parse_deepspeed({"amp": {"enabled": False}, "flops_profiler": {"enabled": True}, "prescale_gradients": False,
                          "gradient_predivide_factor": 1.0, "dump_state": False, "memory_breakdown": False,
                          "zero_optimization": {"stage": 2, "round_robin_gradients": True, "cpu_offload": False,
                                                "load_from_fp32_weights": True, "elastic_checkpoint": False,
                                                "ignore_unused_parameters": True}})
    assert ds.ignored["amp"] == "disabled"
    assert set(ds.ignored) == {"amp", "flops_profiler", "prescale_gradients", "gradient_predivide_factor",
                               "dump_state", "memory_breakdown", "zero_optimization.round_robin_gradients",
                               "zero_optimization.load_from_fp32_weights", "zero_optimization.elastic_checkpoint",
                               "zero_optimization.ignore_unused_parameters"}
    assert all(ds.ignored.values())


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(DeepSpeedConfigError, match=f"deepspeed_config {tmp_path}/missing.json: cannot read it"):
        parse_deepspeed(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"train_batch_size": 8,}')
    with pytest.raises(DeepSpeedConfigError, match=f"deepspeed_config {tmp_path}/bad.json: not valid JSON"):
        parse_deepspeed(str(tmp_path / "bad.json"))


# -- the loss scaler's hysteresis -------------------------------------------------------------------
# DeepSpeed's DynamicLossScaler.update_scale (deepspeed/runtime/fp16/loss_scaler.py) worked by hand
# with init_scale 16, scale_window 3, delayed_shift (hysteresis) 2: (overflow?, scale after, counter after)
TRACE = [(True, 16, 1),    # the counter takes the first overflow
         (True, 8, 1),     # down to 1: halve (the counter stays at 1)
         (True, 4, 1),
         (False, 4, 1), (False, 4, 1), (False, 8, 2),  # 3 clean steps since the last overflow: grow, refill
         (True, 8, 1),
         (False, 8, 1),    # one clean step refills nothing without consecutive_hysteresis
         (True, 4, 1)]
# consecutive_hysteresis: every clean step refills the counter
CONSECUTIVE = [(True, 16, 1), (False, 16, 2), (True, 16, 1), (True, 8, 1), (False, 8, 2), (False, 8, 2),
               (False, 16, 2)]


@pytest.mark.parametrize("consecutive, trace", [(False, TRACE), (True, CONSECUTIVE)])
def test_hysteresis_follows_deepspeeds_scaler(consecutive, trace):
    scaler = LossScaler(enabled=True, initial_scale_power=4, window=3, hysteresis=2,
                        consecutive_hysteresis=consecutive)
    for overflow, scale, left in trace:
        scaler.update(overflow)
        assert (scaler.scale, scaler.hysteresis_left) == (scale, left)


def test_hysteresis_one_halves_on_every_overflow():
    scaler = LossScaler(enabled=True, initial_scale_power=4, window=3)
    for expected in (8, 4, 2):
        scaler.update(True)
        assert scaler.scale == expected


def build_fp16(hysteresis: int) -> zero_impl.ZeroEngine:
    model = make_model()
    return zero_impl.initialize(model, ZeroConfig(stage=0, precision="fp16", hysteresis=hysteresis),
                                optimizer=lambda g: torch.optim.AdamW(g, lr=1e-3), param_groups=param_groups(model))


def test_checkpoint_keeps_the_hysteresis_counter(tmp_path):
    engine = build_fp16(hysteresis=3)
    engine.scaler.update(True)  # the counter from 3 to 2, the scale kept
    assert (engine.scaler.hysteresis_left, engine.scaler.scale) == (2, 2.0 ** 16)
    checkpoint.save(engine, tmp_path / "step_0")
    resumed = build_fp16(hysteresis=3)
    checkpoint.load(resumed, tmp_path / "step_0")
    assert resumed.scaler.hysteresis_left == 2
    # a checkpoint written before the counter existed: the counter full
    sd = engine.state_dict()
    meta = unpack(sd["engine"])
    del meta["hysteresis_left"]
    sd["engine"] = pack(meta)
    older = build_fp16(hysteresis=3)
    older.scaler.hysteresis_left = 1
    older.load_state_dict(sd)
    assert older.scaler.hysteresis_left == 3
