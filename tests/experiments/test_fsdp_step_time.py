"""Sharded data parallelism as FSDP runs it, fused attention and the torch block, each term of
the step-time model worked by hand on round numbers (test_step_time.py's hardware: 100 TFLOPs at
50%, 500 GB/s streaming, 10 us a kernel, a flat 1 us + bytes / 10 GB/s per collective)."""
from __future__ import annotations

from dataclasses import replace

import pytest
from test_step_time import HW, inputs

from experiments.analysis import attention, kernels as kn, layers, step_time as st, systems
from experiments.analysis.hardware import profile


def test_flash_attention_runs_its_flops_at_the_rate_its_authors_measured():
    # flash-attention's convention: 4·(b·heads)·s²·d forward, halved causal, backward 2.5x
    assert attention.attention_flops(32, 2048, 128, True, "forward") == 4 * 32 * 2048 ** 2 * 128 / 2
    assert attention.attention_flops(32, 2048, 128, False, "backward") == 2.5 * 4 * 32 * 2048 ** 2 * 128
    a100 = profile("dgx_a100")
    call = attention.AttentionCall("flash2", 128, 2048, True, "forward")
    assert call.flops_per_s(a100) == 155e12                       # the figure's bar at 2k, d 128, causal
    # between 2k (155) and 4k (173) in log2: 3k is 0.585 of the way
    mid = replace(call, seq_len=3072).flops_per_s(a100)
    assert mid == pytest.approx((155 + (173 - 155) * 0.5849625) * 1e12)
    assert replace(call, seq_len=65536).flops_per_s(a100) == 189e12   # past 16k: 16k's
    assert replace(call, implementation="flash_triton", seq_len=512).flops_per_s(a100) == 55e12
    with pytest.raises(ValueError, match="no measured rate of flash2 attention .* on dgx2_v100"):
        call.flops_per_s(profile("dgx2_v100"))
    # a layer's kernel: its FLOPs at that rate, counted as GEMM (FLOP-bound) time
    x = replace(inputs(tp=1, seq_len=2048, micro_batch=1, hidden=2048, heads=16).shape("flash2"))
    kernel = next(k for k in kn_block_forward(x) if k.attention)
    device, _ = kernel.times(a100)
    assert device == pytest.approx(4 * 16 * 2048 ** 2 * 128 / 2 / 155e12)
    assert kn.compute_time([(kernel, 1)], a100).gemm_s == pytest.approx(device)


def test_the_h100_rates_are_the_fa2_figures_h100_bars_and_its_ceiling_mamfs():
    h100 = profile("dgx_h100")
    # flash2_h100_fwd_bwd_benchmark.png @ 4f285b3, panels (c) and (d): causal, d 64 and d 128
    assert attention.AttentionCall("flash2", 128, 2048, True, "forward").flops_per_s(h100) == 265e12
    assert attention.AttentionCall("flash2", 64, 16384, True, "backward").flops_per_s(h100) == 284e12
    assert attention.AttentionCall("flash_triton", 128, 512, True, "forward").flops_per_s(h100) == 98e12   # FA1
    assert attention.AttentionCall("flash_triton", 64, 8192, True, "forward").flops_per_s(h100) == 149e12
    with pytest.raises(ValueError, match="non-causal"):
        attention.AttentionCall("flash2", 128, 2048, False, "forward").flops_per_s(h100)
    # MAMF's 794.5 of 989 at 2048 x 2048 x 13312 over the model's losses there: 256 x 128 tiles,
    # 8 x 16 = 128 on 132 SMs in one wave (128/132), no k pipeline on Hopper's profile
    assert h100.gemm.efficiency(2048, 2048, 13312) == pytest.approx(h100.gemm.ceiling * 128 / 132)
    assert h100.gemm.ceiling == pytest.approx(794.5 / 989 / (128 / 132), abs=5e-4)


def kn_block_forward(x):
    return layers.LAYERS["torch_block"][0](x)


def test_the_torch_blocks_gemms_follow_the_shape_options():
    base = inputs(tp=2, micro_batch=1, seq_len=1024, hidden=1024, heads=16).shape()
    gemms = lambda x: {k.name: k.gemm for k in kn_block_forward(x) if k.gemm}  # noqa: E731
    T = 1024
    assert gemms(base) == {"QKV": (T, 3 * 1024 // 2, 1024), "scores": (8 * 1024, 1024, 64),
                           "context": (8 * 1024, 64, 1024), "projection": (T, 1024, 512),
                           "MLP fc1": (T, 4096 // 2, 1024), "MLP fc2": (T, 1024, 2048)}
    # Llama-like: 4 KV heads of 16, SwiGLU 2816 wide (fc1 twice that), no biases
    llama = replace(base, kv_heads=4, ffn_hidden=2816, swiglu=True, bias=False)
    assert gemms(llama)["QKV"] == (T, (16 + 2 * 4) * 64 // 2, 1024)
    assert gemms(llama)["MLP fc1"] == (T, 2 * 2816 // 2, 1024) and gemms(llama)["MLP fc2"] == (T, 1024, 2816 // 2)
    assert not [k for k in kn_block_forward(llama) if "bias" in k.name]
    assert [k.name for k in kn_block_forward(llama) if k.name in ("SiLU", "gate multiply")] == ["SiLU", "gate multiply"]
    # rotary: no position table in the head; untied: no second gradient added into the word embedding
    head = lambda x: {k.name for k in layers.LAYERS["torch_block"][3](x)}  # noqa: E731
    assert "position embedding grad" in head(base) and "position embedding grad" not in head(replace(base, rotary=True))
    assert any("grads added" in n for n in head(base)) and not any("grads added" in n for n in head(replace(base, tied=False)))
    # a GPT-2 shape under a Megatron system keeps Megatron's list; any other shape takes the torch block's
    assert st.layer_shape(inputs(), "zero_repro")[0] == "megatron2019"
    assert st.layer_shape(inputs(swiglu=True), "zero_repro")[0] == "torch_block"


def test_fsdp_gathers_each_unit_and_reduce_scatters_it_every_micro_batch():
    fsdp = systems.SYSTEMS["llm_foundry_fsdp1"]
    common = dict(psi=1e9, dp=8, layers=10, element_bytes=2, grad_accum=3, reduce_bucket=4e7, allgather_bucket=4e7,
                  root=1e8)
    full = systems.dp_plan(fsdp, stage=3, **common)
    unit = (1e9 - 1e8) / 10
    # a reduce-scatter per block and the root's last, every micro-batch, in the parameters' dtype
    assert full.grad_calls == (("reduce_scatter", unit * 2),) * 10 + (("reduce_scatter", 1e8 * 2),)
    assert full.grad_reductions == 3 and full.param_calls_after_step == ()
    # the root gathered once (kept from forward to backward), each block twice
    assert full.param_calls_per_micro_batch == (("all_gather", 2e8),) + (("all_gather", unit * 2),) * 20
    # SHARD_GRAD_OP: no second gather
    assert len(systems.dp_plan(fsdp, stage=2, **common).param_calls_per_micro_batch) == 11
    # DEFAULT mixed precision reduces in fp32: twice the bytes, and the cast to fp32 before it
    fp32 = systems.dp_plan(fsdp, stage=3, reduce_bytes=4, **common)
    assert [b for _, b in fp32.grad_calls] == [2 * b for _, b in full.grad_calls]
    # copies: the division of the whole gradient (2 + 2 B, 4 + 4 in fp32), the cast (2 in, 4 out);
    # on the shard its division, its cast to fp32 (2 in, 4 out: none from fp32), its sum (12)
    assert full.copy_bytes == pytest.approx(1e9 * 4 + 1e9 / 8 * (4 + 6 + 12))
    assert fp32.copy_bytes == pytest.approx(1e9 * (8 + 6) + 1e9 / 8 * (8 + 12))
    assert full.forward_gathers == 11
    assert full.copy_kernels == 3 * 11


def test_fsdp_hides_each_phases_collectives_under_that_phases_compute_but_its_edges():
    x = inputs(tp=1, dp=8, stage=3, grad_accum=2, psi=1e9)
    fsdp = systems.SYSTEMS["llm_foundry_fsdp1"]
    hw = st.system_hardware(replace(HW, compute_capability=80), fsdp)   # the flash kernel's A100 rates
    phases = st.micro_batch_compute(x, hw, fsdp)
    forward = phases["forward"].total_s
    backward = phases["recompute"].total_s + phases["backward"].total_s
    plan = st.plan(x, fsdp)
    t = lambda calls: [1e-6 + b / 10e9 for _, b in calls]  # noqa: E731   the flat collective
    gathers, grads = t(plan.param_calls_per_micro_batch), t(plan.grad_calls)
    dp = st.dp_comm(x, hw, fsdp, phases)
    # one stream in issue order: the forward's 11 gathers (the root's and the first block's with
    # nothing to hide under) under the forward; the backward's 10 and the 11 reduce-scatters (the
    # first block's and the root's last) under the recomputed forward and the backward
    exposed_f = max(gathers[0] + gathers[1], sum(gathers[:11]) - forward)
    exposed_b = max(grads[-2] + grads[-1], sum(gathers[11:]) + sum(grads) - backward)
    assert dp["exposed_s"] == pytest.approx(2 * (exposed_f + exposed_b))
    # a flat collective is not NCCL's: no SMs taken from compute
    assert dp["contention_s"] == 0.0 and dp["sm_share"] == 0.0


def test_overlapped_compute_runs_on_the_sms_nccl_leaves_it():
    # compute-bound: 10 s of compute under 4 s of collectives, 1 of them at the edges, 10% of the
    # SMs: the 3 overlapped seconds slow it by 0.3 s
    assert st.overlapped(10.0, 4.0, 1.0, 0.1) == (pytest.approx(1.0), pytest.approx(0.3))
    # collective-bound: 12 s of collectives over 10 s of compute: the slowed compute (11 s + the
    # 1 s edge) still ends under them: nothing added
    assert st.overlapped(10.0, 12.0, 1.0, 0.1) == (pytest.approx(2.0), pytest.approx(0.0))
    # in between: 11.5 s of collectives; the slowed compute ends at 10 + 1 + 1 = 12 s
    assert st.overlapped(10.0, 11.5, 1.0, 0.1) == (pytest.approx(1.5), pytest.approx(0.5))
    a100 = profile("dgx_a100")
    x = inputs(tp=1, dp=8, stage=3, grad_accum=1, psi=1e9, hidden=2048, heads=16, seq_len=2048, layers=24)
    fsdp = systems.SYSTEMS["llm_foundry_fsdp1"]
    hw = st.system_hardware(a100, fsdp)
    # one node of 8: NCCL's 12 NVLink channels, one block each, of the A100's 108 SMs
    share = st.sm_share(hw, st.dp_group(x, hw))
    assert share == pytest.approx(12 / 108)
    phases = st.micro_batch_compute(x, hw, fsdp)
    dp = st.dp_comm(x, hw, fsdp, phases)
    plan, group = st.plan(x, fsdp), st.dp_group(x, hw)
    gathers = [st._collective(hw, k, b, group) for k, b in plan.param_calls_per_micro_batch]
    grads = [st._collective(hw, k, b, group) for k, b in plan.grad_calls]
    forward = phases["forward"].total_s
    backward = phases["recompute"].total_s + phases["backward"].total_s
    _, con_f = st.overlapped(forward, sum(gathers[:25]), gathers[0] + gathers[1], share)
    _, con_b = st.overlapped(backward, sum(gathers[25:]) + sum(grads), grads[-2] + grads[-1], share)
    assert dp["contention_s"] == pytest.approx(con_f + con_b) and dp["contention_s"] > 0
    p = st.predict(x, a100, fsdp)
    assert p.terms["overlap_contention"] == pytest.approx(dp["contention_s"])
    # a system that overlaps nothing pays nothing
    serial = st.predict(replace(x, overlap=False, stage=0), a100, "megatron_ds2023")
    assert serial.terms["overlap_contention"] == 0.0


def test_fsdp_optimizer_steps_the_shard_in_fp32_pass_by_pass():
    x = inputs(tp=1, dp=8, stage=3, psi=8e8, layers=10)
    step = systems.composer_adamw(2, 3)
    per_element = sum(step.updated_passes.values())
    # the clip (norm 4, multiply 8), exp_avg (mul_ 8, add_ 12), exp_avg_sq (mul_ 8, addcmul_ 12),
    # sqrt, bias correction, eps (8 each), addcdiv_ 16; no decay at weight decay 0
    assert per_element == 4 + 8 + 8 + 12 + 8 + 12 + 8 + 8 + 8 + 16
    # FSDP shards every one of the 124 tensors over every rank: 124 x (2 + 8) kernels and 4 a step
    expected = 1e8 * per_element / 500e9 + (124 * 10 + 4) * 10e-6
    assert st.optimizer_s(x, HW, "llm_foundry_fsdp1") == pytest.approx(expected)
    # torch's foreach AdamW (FSDP2 in make bench): the decay and lerp_, one launch a pass
    torch_step = systems.torch_adamw(2, 3)
    assert sum(torch_step.updated_passes.values()) == 8 + 12 + 8 + 12 + 8 + 8 + 8 + 16
    assert torch_step.kernels_per_step == 8 and torch_step.kernels_per_updated_tensor == 0


def test_the_mpt_head_with_flash_attn_s_fused_cross_entropy():
    x = replace(inputs(tp=1, micro_batch=1, seq_len=1024, vocab=50368).shape("flash_triton"), fused_loss=True)
    fwd = {k.name: k for k in layers.LAYERS["torch_block"][2](x)}
    bwd = {k.name: k for k in layers.LAYERS["torch_block"][3](x)}
    logits = 1024 * 50368
    assert fwd["cross entropy (fused)"].bytes == logits * 2 + 1024 * 4 and fwd["cross entropy (fused)"].count == 1
    assert bwd["cross entropy bwd (fused)"].bytes == logits * 2 * 2
    torch_loss = {k.name: k for k in layers.LAYERS["torch_block"][2](replace(x, fused_loss=False))}
    assert torch_loss["cross entropy (fp32)"].bytes == logits * (2 + 16)


def test_stage_3_without_overlap_waits_for_every_gather():
    # zero_repro's gathers with overlap_comm=False are synchronous (async_op=False): nothing hides
    x = inputs(tp=1, dp=8, stage=3, grad_accum=2, psi=1e9, overlap=False)
    phases = st.micro_batch_compute(x, HW, "zero_repro")
    plan = st.plan(x, "zero_repro")
    t = lambda calls: [1e-6 + b / 10e9 for _, b in calls]  # noqa: E731
    dp = st.dp_comm(x, HW, "zero_repro", phases)
    assert dp["exposed_s"] == pytest.approx(2 * (sum(t(plan.param_calls_per_micro_batch)) + sum(t(plan.grad_calls))))
    assert dp["contention_s"] == 0.0


def test_groups_sharing_nics_each_take_their_channels_sms():
    # MP 16 x DP 25 on DGX-2s: 16 DP groups leave each node; each communicator still runs its own
    # blocks on every member GPU: the share of one group alone on its NICs (8 NICs' channels of 80 SMs)
    v100 = profile("dgx2_v100")
    assert st.sm_share(v100, (25, 1, 16)) == st.sm_share(v100, (25, 1, 1)) == pytest.approx(8 / 80)


def test_the_root_unit_keeps_megatron_s_layernorm_bias():
    assert st.root_elements(inputs(bias=False, vocab=1000, tp=1)) == 1000 * 1024 + 1024 * 1024 + 2 * 1024
    assert st.root_elements(inputs(rmsnorm=True, rotary=True, tied=False, vocab=1000, tp=1)) == 2 * 1000 * 1024 + 1024
