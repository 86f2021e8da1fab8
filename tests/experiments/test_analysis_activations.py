"""Memory per GPU beyond model states (experiments/analysis/activations.py) and the dry run's
verdicts for the paper's points, each checked against a calculation written out here."""
from __future__ import annotations

import dataclasses

import pytest

from experiments.sweeps.dry_run import dry_run
from experiments.analysis.activations import (activation_memory, attention_working_bytes, checkpoint_bytes,
                                              engine_buffer_bytes, head_bytes, layer_activation_bytes,
                                              layer_params_per_tp_rank, logits_bytes, root_params_per_tp_rank,
                                              score_buffer_bytes)
from experiments.models.gpt_shape import (GPTShape, padded_vocab_size, parameter_count,
                                          parameters_per_tp_rank)
from experiments.points import expand, predicted_memory_bytes
from zero_impl import MAX_INFLIGHT_STAGING

V100 = 32e9  # conf/cluster/dgx2_v100.yaml device_memory_gb, x 1e9 as the paper's Table 2


def _points(compose, experiment: str) -> dict:
    cfg = compose(f"experiment={experiment}", "dry_run=true")
    return {(p.model["name"], p.stage, p.gpus, p.tp, p.micro_batch): p for p in expand(cfg)}


# -- each term against a hand calculation ------------------------------------------------------
def test_layer_activations_korthikanti_eq1_eq2():
    s, b, h, a = 1024, 32, 8192, 64
    sbh = s * b * h
    # Eq. 1's linear part, t = 1, and megatron-core's attention: the fp32 softmax output (4), the
    # mask (1) and dropout's output (2) a score, where the paper's fused fp16 softmax keeps 2 + 1 + 2:
    # sbh(34 + 7as/h) = sbh(34 + 56)
    assert layer_activation_bytes(s, b, h, a) == sbh * 90
    # Eq. 2, t = 16, no sequence parallelism: sbh(10 + 24/16 + 7as/(16h)) = sbh(10 + 1.5 + 3.5)
    assert layer_activation_bytes(s, b, h, a, tp=16) == pytest.approx(sbh * 15, rel=1e-12)
    # No dropout: no masks (2sbh) and no dropout output; the fp32 softmax output and the 16-bit
    # probabilities the context bmm saves: 32sbh + (4 + 2)as²b at t = 1
    assert layer_activation_bytes(s, b, h, a, dropout=False) == 32 * sbh + 6 * a * s * s * b
    # fp32, no dropout: every stored tensor twice as wide: 64sbh + 4as²b.
    assert layer_activation_bytes(s, b, h, a, bytes_per_element=4, dropout=False) == 64 * sbh + 4 * a * s * s * b


def test_checkpoints_head_and_logits():
    # 100B (125 layers, h 8192), micro-batch 32: one fp16 layer input per layer, on every TP rank.
    assert checkpoint_bytes(1024, 32, 8192, 125) == 125 * 2 * 1024 * 32 * 8192 == 67_108_864_000
    assert checkpoint_bytes(1024, 32, 8192, 125, bytes_per_element=4) == 2 * 67_108_864_000
    # Final LayerNorm input + output-layer input (2 bytes each) + embedding dropout mask (1 byte).
    assert head_bytes(1024, 2, 4096) == 5 * 1024 * 2 * 4096
    assert head_bytes(1024, 2, 4096, dropout=False) == 4 * 1024 * 2 * 4096
    # fp16 logits (2 bytes) beside their fp32 softmax (4 bytes), vocabulary split over TP.
    assert logits_bytes(1024, 2, 50304) == 6 * 1024 * 2 * 50304
    assert logits_bytes(1024, 32, 51200, tp=16) == 6 * 1024 * 32 * 3200
    assert logits_bytes(1024, 2, 50304, bytes_per_element=4) == 4 * 1024 * 2 * 50304  # fp32: .float() is a no-op


def test_attention_working_set_and_score_buffer_by_hand():
    """One layer's local attention at s 64, b 1, h 32, a 4 (a·s/h = 8): U = a·s²·b/t = 16384
    score elements. fp16 holds 12 bytes of them at once (its softmax's backward: the saved fp32
    output, the fp32 gradient of the probabilities, the fp32 gradient of the scores), fp32 16
    (the in-place mask's CopySlices backward); beside them the norm's input and output and two
    gradients, 4·p·sbh, and Q, K, V and the context's gradient, (3h + h)·s·b·p/t. megatron's
    score buffer holds p·U bytes for good."""
    s, b, h, a = 64, 1, 32, 4
    assert attention_working_bytes(s, b, h, a) == 12 * 16384 + 2 * 4 * 2048 + 2 * 128 * 64 == 229_376
    assert attention_working_bytes(s, b, h, a, bytes_per_element=4) == 16 * 16384 + 4 * 4 * 2048 + 4 * 128 * 64 \
        == 327_680
    # TP 2: scores, Q, K, V and the context's gradient halve; the norm's tensors and 2 gradients do not
    assert attention_working_bytes(s, b, h, a, tp=2) == 12 * 8192 + 2 * 4 * 2048 + 2 * 128 * 64 / 2 == 122_880
    # K and V kept 8 wide each, RMSNorm's normalized input beside the norm's input and output
    assert attention_working_bytes(s, b, h, a, kv_hidden=8, rmsnorm=True) == \
        12 * 16384 + 2 * 5 * 2048 + 2 * (32 + 2 * 8 + 32) * 64 == 227_328
    assert score_buffer_bytes(s, b, a) == 2 * 16384 and score_buffer_bytes(s, b, a, tp=2) == 16384
    assert score_buffer_bytes(s, b, a, bytes_per_element=4) == 4 * 16384
    # a flash-style kernel: neither
    assert attention_working_bytes(s, b, h, a, fused_attention=True) == score_buffer_bytes(s, b, a,
                                                                                         fused_attention=True) == 0


def test_activation_total_keeps_the_larger_working_set():
    s, b, h, a, l, v = 1024, 2, 4096, 32, 62, 50304
    sbh, scores = s * b * h, a * s * s * b
    layer, logits = sbh * (34 + 7 * a * s / h), 6 * s * b * v     # 755.0 MB, 618.1 MB
    attention = 12 * scores + 16 * sbh                             # 939.5 MB: the recomputed layer's peak
    m = activation_memory(seq_len=s, micro_batch=b, hidden=h, heads=a, layers=l, vocab=v, recompute=True)
    assert m["recomputed_layer"] == attention > layer and m["score_buffer"] == 2 * scores
    assert m["total"] == l * 2 * sbh + 5 * sbh + 2 * scores + max(layer, attention, logits)
    m = activation_memory(seq_len=s, micro_batch=b, hidden=h, heads=a, layers=l, vocab=v, recompute=False)
    # the last layer's attention adds 184.5 MB beyond what it keeps: less than the loss's
    assert m["last_layer_transient"] == attention - layer < logits
    assert m["total"] == l * layer + 5 * sbh + 2 * scores + logits
    # TE's fused attention: neither term, the numbers of before
    m = activation_memory(seq_len=s, micro_batch=b, hidden=h, heads=a, layers=l, vocab=v, fused_attention=True)
    fused = layer_activation_bytes(s, b, h, a, fused_attention=True)
    assert m["total"] == l * 2 * sbh + 5 * sbh + max(fused, logits)


def test_long_sequence_recomputed_layer_by_hand():
    """s 64, b 1, h 32, a 4, 3 layers, vocabulary 64, fp16 with dropout (the paper's recipe): the
    layer keeps sbh(34 + 7as/h) = 2048·90 = 184,320 bytes, its attention's working set is 229,376
    (test above), the loss's 6·s·b·V = 24,576, the checkpoints 3·2sbh = 12,288, the head 5sbh =
    10,240, the score buffer 2·a·s²·b = 32,768."""
    common = dict(seq_len=64, micro_batch=1, hidden=32, heads=4, layers=3, vocab=64)
    m = activation_memory(recompute=True, **common)
    assert m["total"] == 12_288 + 10_240 + 32_768 + 229_376 == 284_672
    # without recomputation the last layer's attention adds 229,376 - 184,320 = 45,056 > the loss's
    m = activation_memory(recompute=False, **common)
    assert m["last_layer_transient"] == 45_056
    assert m["total"] == 3 * 184_320 + 10_240 + 32_768 + 45_056 == 641_024


def test_unit_sizes_add_up_to_the_megatron_count():
    for shape, tp in ((GPTShape(125, 8192, 64), 16), (GPTShape(62, 4096, 32), 1), (GPTShape(2, 16, 4, 8, 256), 2)):
        v = padded_vocab_size(shape.vocab_size, tp)
        total = shape.layers * layer_params_per_tp_rank(shape.hidden, tp) + root_params_per_tp_rank(
            shape.hidden, shape.seq_len, v, tp)
        assert total == parameters_per_tp_rank(shape, tp)


def test_engine_buffers():
    h, s, v, b = 4096, 1024, 50304, 40_000_000
    emb = v * h  # 206M elements: larger than a bucket, so a bucket of its own
    common = dict(hidden=h, seq_len=s, vocab=v, params=12.7e9, reduce_bucket_size=b)
    assert engine_buffer_bytes(stage=0, **common)["total"] == emb * 2  # the tied embedding's gradient only
    assert engine_buffer_bytes(stage=1, **common)["total"] == emb * 2
    stage2 = engine_buffer_bytes(stage=2, **common)
    assert stage2["grad_staging"] == (MAX_INFLIGHT_STAGING * b + emb) * 2
    assert stage2["total"] == (MAX_INFLIGHT_STAGING * b + emb) * 2 + emb * 2
    # A model smaller than a bucket stages at most itself.
    assert engine_buffer_bytes(stage=2, hidden=16, seq_len=8, vocab=256, params=10_000,
                               reduce_bucket_size=b)["grad_staging"] == 10_000 * 2
    stage3 = engine_buffer_bytes(stage=3, stage3_max_live_units=3, **common)
    layer, root = 12 * h * h + 13 * h, emb + s * h + 2 * h
    assert stage3["gathered_units"] == (root + 2 * layer) * 2
    assert stage3["grad_staging"] == (MAX_INFLIGHT_STAGING * layer + root) * 2


# -- verdicts for the paper's points -----------------------------------------------------------
def test_fig2_100b_does_not_fit_without_partitioned_activations(compose):
    """100B at MP 16 on 400 GPUs, micro-batch 32, stage 2, fp16: the activation checkpoints
    alone, 125 layers x 2·1024·32·8192 bytes = 67.1 GB, are twice a V100; ZeRO-R's Pa (the
    point runs Table 3's C4) keeps 1/16 of each, 4.2 GB, and the point fits."""
    point = _points(compose, "fig2")[("fig2_100b", 2, 400, 16, 32)]
    assert point.train["recompute"] and point.dp == 25 and point.zero["partition_activations"]
    without = dataclasses.replace(point, zero=dict(point.zero, partition_activations=False))
    m = predicted_memory_bytes(without, "fp16")
    assert m["terms"]["activations"]["layers_kept"] == 125 * 2 * 1024 * 32 * 8192 == pytest.approx(67.1e9, rel=1e-3)
    psi = parameters_per_tp_rank(point.shape, 16)  # 6.3B per TP rank
    assert m["model_states"] == pytest.approx(2 * psi + 14 * psi / 25)  # 16.2 GB: fits on its own
    assert m["model_states"] < V100 < m["total"]
    pa = predicted_memory_bytes(point, "fp16")
    assert pa["terms"]["activations"]["layers_kept"] == 125 * 2 * 1024 * 32 * 8192 / 16
    assert pa["total"] == pytest.approx(m["total"] - 125 * 2 * 1024 * 32 * 8192 * 15 / 16) and pa["total"] < V100
    c5 = dataclasses.replace(point, zero=dict(point.zero, cpu_checkpointing=True))  # Pa+cpu: on the host
    host = predicted_memory_bytes(c5, "fp16")["terms"]["activations"]
    assert host["layers_kept"] == 0 and host["host_checkpoints"] == 125 * 2 * 1024 * 32 * 8192 / 16


def test_fig2_small_point_fits(compose):
    """1.5B (48 x 1600, 16 heads), stage 2, 400 GPUs, MP 1, micro-batch 24, fp16: the loss's
    working set is the larger, and it runs before the engine holds any gradient buffer."""
    point = _points(compose, "fig2")[("fig2_1.5b", 2, 400, 1, 24)]
    s, b, h, a, l, v = 1024, 24, 1600, 16, 48, 50304
    sbh = s * b * h
    psi = parameter_count(point.shape)
    states = 2 * psi + 14 * psi / 400                                         # 3.17 GB
    scores = a * s * s * b                                                     # 0.80 GB score buffer at 2 B
    held = l * 2 * sbh + 5 * sbh + 2 * scores                                  # 3.77 + 0.20 + 0.80 GB
    layer = max(sbh * (34 + 5 * a * s / h), 12 * scores + 16 * sbh)            # layer 3.13, attention 5.46 GB
    logits = 6 * s * b * v                                                     # 7.42 GB
    bucket = point.zero["reduce_bucket_size"]
    buffers = (MAX_INFLIGHT_STAGING * bucket + max(bucket, v * h)) * 2 + v * h * 2   # 0.48 GB
    m = predicted_memory_bytes(point, "fp16")
    assert m["activations"] == pytest.approx(held + logits, rel=1e-12) and m["buffers"] == buffers
    assert logits > layer + buffers
    assert m["total"] == pytest.approx(states + held + logits, rel=1e-12) == pytest.approx(15.36e9, rel=1e-3)
    assert m["total"] < 16e9 < V100


def test_fig4_13b_without_mp_fits(compose):
    """Figure 4's largest ZeRO model: 13B (62 x 4096, 32 heads) on 128 GPUs, MP 1, stage 2,
    micro-batch 2, fp16: 26.8 GB of model states + 2.16 GB of activations (1.04 GB of
    checkpoints, the score buffer 0.13 GB, one recomputed layer's peak 0.94 GB, its attention's
    working set, > what it keeps 0.62 GB and the loss's 0.62 GB) + the engine's buffers (0.98 GB
    with 4e7-element buckets; 3.4 GB with DeepSpeed's 5e8) = 29.9 GB (32.3 GB): fits a 32 GB
    V100, as the paper trains it, but with little room."""
    point = _points(compose, "fig4")[("fig4_13b", 2, 128, 1, 2)]
    s, b, h, a, l, v = 1024, 2, 4096, 32, 62, 50304
    sbh, scores = s * b * h, a * s * s * b
    psi = parameter_count(point.shape)
    states = 2 * psi + 14 * psi / 128
    activations = l * 2 * sbh + 5 * sbh + 2 * scores + max(sbh * (34 + 5 * a * s / h), 12 * scores + 16 * sbh,
                                                            6 * s * b * v)
    bucket = point.zero["reduce_bucket_size"]
    buffers = (MAX_INFLIGHT_STAGING * bucket + max(bucket, v * h)) * 2 + v * h * 2
    m = predicted_memory_bytes(point, "fp16")
    assert m["total"] == pytest.approx(states + activations + buffers, rel=1e-12)
    assert states == pytest.approx(26.78e9, rel=1e-3) and activations == pytest.approx(2.156e9, rel=1e-3)
    assert m["total"] < V100


def test_the_score_buffer_is_held_through_the_optimizer_step(compose):
    """Figure 4's DDP baseline 1.16B (24 x 1920, 16 heads), micro-batch 8, fp16: its peak is the
    whole-model step, which megatron's score buffer, 2·a·s²·b = 268 MB, outlives."""
    point = _points(compose, "fig4")[("fig4_1.16b", 0, 128, 1, 8)]
    m = predicted_memory_bytes(point, "fp16")
    assert m["peak_phase"] == "step"
    assert m["total"] == m["model_states"] + m["step_temporaries"] + 2 * 16 * 1024 * 1024 * 8


def test_dry_run_prints_the_terms_and_the_verdicts(compose, capsys):
    points = _points(compose, "fig2")
    dry_run(list(points.values()))
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip().strip("|").split("|")]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| fig2_")}
    big = rows[points[("fig2_100b", 2, 400, 16, 32)].point_id]
    small = rows[points[("fig2_1.5b", 2, 400, 1, 24)].point_id]
    # | point | ... | micro-batch | recompute | model states | activations | buffers | step temporaries | total
    # | fits | here |: the step's temporaries, one 4e7-element chunk at 8 B, stay below backward's peak
    assert big[10:12] == ["32", "yes"] and big[12] == "16.21 GB" and big[13] == "9.83 GB" and big[17] == "yes"
    assert big[15] == "320.00 MB" and small[17] == "yes"
