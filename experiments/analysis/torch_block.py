"""The kernels of a pre-norm decoder block written in plain PyTorch, run eagerly: llm-foundry's
MPT (llmfoundry/models/mpt/modeling_mpt.py, layers/blocks.py, attention.py, ffn.py) and the
Llama-shaped blocks of torchtitan-like code, at one GPU's shape (LayerShape, TP t).

Per layer forward, at T = b·s tokens, h hidden, a heads, g = kv heads, d = h/a, f the MLP width:

- norm 1 (LayerNorm, or RMSNorm [assumption: one fused pass, as LayerNorm; torch's eager RMSNorm
  is several kernels]); the QKV GEMM (T, (a + 2g)·d/t, h) and its bias where the model has biases;
  rotary positions on q and k where the model has them (two kernels);
- the attention: a fused kernel (attention.py: its FLOPs at the rate its authors measured; q, k,
  v are views of the QKV output, as llm-foundry's Triton kernel takes them through their strides)
  or, unfused, the scores GEMM, a masked softmax and the context GEMM;
- the output projection (T, h, a·d/t), its bias; the residual add; norm 2; the MLP: fc1 (T, f/t,
  h; 2f/t for a gated SiLU), GeLU (or SiLU and the gate's multiply), fc2 (T, h, f/t), biases; the
  residual add. MPT's benchmark configs set every dropout to 0, and torch returns the input for
  p = 0 without a kernel (ATen's dropout) [assumption: no dropout kernel in any such block].

Backward: each GEMM's two; the fused attention's backward kernel (2.5x its forward FLOPs, the
convention its authors' benchmark counts in) with the Triton kernel's preprocessing pass and its
fp32 dq buffer copied back; the norms' two kernels (input gradient, weight gradients); the
activation's backward; bias gradients as sums over the tokens; the QKV split's gradient
concatenated; the two residual branches' gradients added.

Per micro-batch: the word embedding's gather (and a learned position table's gather and add), the
final norm, the logits GEMM (T, V/t, h), the cross entropy (torch's under autocast: the logits cast
to fp32, log-softmax, the NLL; or one fused kernel, flash-attn's, as llm-foundry's MPT runs it),
and in backward their gradients, the embedding's dense backward and,
where the logits reuse the word embedding, the two gradients of that weight added.
"""
from __future__ import annotations

from experiments.analysis.attention import AttentionCall, attention_flops
from experiments.analysis.kernels import MASK_BYTES, Kernel, LayerShape, elementwise, gemm, gemm_pair, tp_all_reduce


def _widths(x: LayerShape) -> tuple[int, int, int, int]:
    """(query width, QKV width, fc1 width, fc2 input width) on one TP rank."""
    d, t = x.head_dim, x.tp
    q = x.heads * d // t
    return q, (x.heads + 2 * x.kv) * d // t, (2 if x.swiglu else 1) * x.ffn // t, x.ffn // t


def _bias(name: str, elements: float, x: LayerShape) -> list[Kernel]:
    return [elementwise(name, elements, 1, 1, x.element_bytes)] if x.bias else []


def _bias_grad(name: str, elements: float, x: LayerShape) -> list[Kernel]:
    return [elementwise(name, elements, 1, 0, x.element_bytes)] if x.bias else []


def _attention_sizes(x: LayerShape) -> tuple[int, int, int, int, int, int, int]:
    """(tokens, element bytes, sequence, query width, QKV width, batched heads, head dimension)."""
    q, qkv, _, _ = _widths(x)
    return x.tokens, x.element_bytes, x.seq_len, q, qkv, x.micro_batch * x.heads // x.tp, x.head_dim


def _attention_forward(x: LayerShape) -> list[Kernel]:
    T, e, s, q, qkv, batch, d = _attention_sizes(x)
    if x.attention == "unfused":
        S = x.scores
        return [gemm("scores", s, s, d, e, batch),
                elementwise("scale, causal mask, softmax", S, 1, 1, e, extra_bytes=S * MASK_BYTES, count=2),
                gemm("context", s, d, s, e, batch),
                elementwise("q, k, v, context layout copies", T * (qkv + q), 1, 1, e, count=4)]
    call = AttentionCall(x.attention, d, s, causal=True, direction="forward")
    return [Kernel(f"fused attention forward ({x.attention})", flops=attention_flops(batch, s, d, True, "forward"),
                   bytes=float(T * (qkv + q) * e + T * x.heads // x.tp * 4), attention=call)]


def _attention_backward(x: LayerShape) -> list[Kernel]:
    T, e, s, q, qkv, batch, d = _attention_sizes(x)
    if x.attention == "unfused":
        S = x.scores
        return [elementwise("q, k, v, context layout copies bwd", T * (qkv + q), 1, 1, e, count=4),
                *gemm_pair("context", s, d, s, e, batch),
                elementwise("softmax, mask, scale bwd", S, 2, 1, e, count=2),
                *gemm_pair("scores", s, s, d, e, batch)]
    call = AttentionCall(x.attention, d, s, causal=True, direction="backward")
    return [elementwise("fused attention bwd preprocess: rowsum(o * do)", T * q, 2, 0, e),
            Kernel(f"fused attention backward ({x.attention})", flops=attention_flops(batch, s, d, True, "backward"),
                   bytes=float(T * (2 * qkv + 2 * q) * e + T * q * 4), attention=call),
            elementwise("fused attention bwd: fp32 dq to dq", T * q, 0, 0, e, extra_bytes=T * q * (4 + e))]


def _norm(name: str, x: LayerShape) -> Kernel:
    return elementwise(f"{name} ({'RMSNorm' if x.rmsnorm else 'LayerNorm'})", x.tokens * x.hidden, 1, 1,
                       x.element_bytes, torch_kernel=False)


def _norm_backward(name: str, x: LayerShape) -> list[Kernel]:
    rep, e = x.tokens * x.hidden, x.element_bytes
    return [elementwise(f"{name} bwd", rep, 2, 1, e, torch_kernel=False),
            elementwise(f"{name} weight grads", rep, 2, 0, e, torch_kernel=False)]


def _rotary(name: str, x: LayerShape, passes: int) -> list[Kernel]:
    if not x.rotary:
        return []
    qk = x.tokens * (x.heads + x.kv) * x.head_dim // x.tp
    return [elementwise(name, qk, passes, 1, x.element_bytes, count=2)]


def block_forward(x: LayerShape) -> list[Kernel]:
    """One block's forward (and its recomputation): module docstring."""
    T, h, e = x.tokens, x.hidden, x.element_bytes
    rep = T * h
    q, qkv, fc1, fc2_in = _widths(x)
    activation = [elementwise("SiLU", T * fc2_in, 1, 1, e), elementwise("gate multiply", T * fc2_in, 2, 1, e)] \
        if x.swiglu else [elementwise("GeLU", T * fc1, 1, 1, e)]
    return [
        _norm("norm 1", x),
        gemm("QKV", T, qkv, h, e), *_bias("QKV bias", T * qkv, x),
        *_rotary("rotary positions on q, k", x, 2),
        *_attention_forward(x),
        gemm("projection", T, h, q, e),
        *tp_all_reduce("TP all-reduce: projection output", x, rep * e),
        *_bias("projection bias", rep, x),
        elementwise("residual add", rep, 2, 1, e),
        _norm("norm 2", x),
        gemm("MLP fc1", T, fc1, h, e), *_bias("MLP fc1 bias", T * fc1, x),
        *activation,
        gemm("MLP fc2", T, h, fc2_in, e),
        *tp_all_reduce("TP all-reduce: MLP output", x, rep * e),
        *_bias("MLP fc2 bias", rep, x),
        elementwise("residual add", rep, 2, 1, e),
    ]


def block_backward(x: LayerShape) -> list[Kernel]:
    """One block's backward (module docstring)."""
    T, h, e = x.tokens, x.hidden, x.element_bytes
    rep = T * h
    q, qkv, fc1, fc2_in = _widths(x)
    activation = [elementwise("gate multiply bwd", T * fc2_in, 3, 2, e, count=2),
                  elementwise("SiLU bwd", T * fc2_in, 2, 1, e),
                  elementwise("fc1 halves' grads concatenated", T * fc1, 1, 1, e)] \
        if x.swiglu else [elementwise("GeLU bwd", T * fc1, 2, 1, e)]
    return [
        elementwise("residual grad add", rep, 2, 1, e),
        *_bias_grad("MLP fc2 bias grad", rep, x),
        *gemm_pair("MLP fc2", T, h, fc2_in, e),
        *activation,
        *_bias_grad("MLP fc1 bias grad", T * fc1, x),
        *gemm_pair("MLP fc1", T, fc1, h, e),
        *tp_all_reduce("TP all-reduce: MLP input grad", x, rep * e),
        *_norm_backward("norm 2", x),
        elementwise("residual grad add", rep, 2, 1, e),
        *_bias_grad("projection bias grad", rep, x),
        *gemm_pair("projection", T, h, q, e),
        *_attention_backward(x),
        *_rotary("rotary positions bwd", x, 1),
        elementwise("QKV split grads concatenated", T * qkv, 1, 1, e),
        *_bias_grad("QKV bias grad", T * qkv, x),
        *gemm_pair("QKV", T, qkv, h, e),
        *tp_all_reduce("TP all-reduce: QKV input grad", x, rep * e),
        *_norm_backward("norm 1", x),
    ]


def head_forward(x: LayerShape) -> list[Kernel]:
    """Once per micro-batch: embeddings, final norm, logits, cross entropy in fp32 (autocast)."""
    T, h, t, e = x.tokens, x.hidden, x.tp, x.element_bytes
    rep, logits = T * h, T * x.vocab // t
    positions = [] if x.rotary else [elementwise("position embedding gather", rep, 0, 1, e),
                                     elementwise("embedding add", rep, 2, 1, e)]
    return [
        elementwise("word embedding gather", rep, 0, 1, e, extra_bytes=T * 8.0),
        *tp_all_reduce("TP all-reduce: embedding output", x, rep * e),
        *positions,
        _norm("final norm", x),
        gemm("logits", T, x.vocab // t, h, e),
        _cross_entropy(x, logits),
    ]


def _cross_entropy(x: LayerShape, logits: int) -> Kernel:
    """Forward: fused (flash-attn's xentropy kernel: the logits read once, a log-sum-exp a token
    written) or torch's under autocast (the cast to fp32, e in and 4 out; log-softmax, whose max
    and sum read the row twice, 8, and write it, 4; the NLL's gather)."""
    e = x.element_bytes
    if x.fused_loss:
        return elementwise("cross entropy (fused)", logits, 1, 0, e, extra_bytes=x.tokens * 4.0, torch_kernel=False)
    return elementwise("cross entropy (fp32)", logits, 0, 0, e, extra_bytes=logits * (e + 16), count=3, torch_kernel=False)


def _cross_entropy_backward(x: LayerShape, logits: int) -> Kernel:
    """Backward: fused (the logits read, their gradient written) or torch's (NLL bwd: zeros, 4,
    and the scatter; log-softmax bwd: grad and output read, 8, written, 4; the cast back, 4 in,
    e out)."""
    e = x.element_bytes
    if x.fused_loss:
        return elementwise("cross entropy bwd (fused)", logits, 1, 1, e, torch_kernel=False)
    return elementwise("cross entropy bwd (fp32)", logits, 0, 0, e, extra_bytes=logits * (4 + 12 + 4 + e), count=4,
                       torch_kernel=False)


def head_backward(x: LayerShape) -> list[Kernel]:
    T, h, t, e = x.tokens, x.hidden, x.tp, x.element_bytes
    rep, logits, table = T * h, T * x.vocab // t, x.vocab // t * h
    tied = [elementwise("word embedding: the logits' and the gather's grads added", table, 2, 1, e)] if x.tied else []
    positions = [] if x.rotary else [elementwise("position embedding grad", rep, 1, 1, e, count=2)]
    return [
        _cross_entropy_backward(x, logits),
        *gemm_pair("logits", T, x.vocab // t, h, e),
        *tp_all_reduce("TP all-reduce: logits input grad", x, rep * e),
        *_norm_backward("final norm", x),
        *positions,
        elementwise("word embedding grad (embedding_dense_backward: sort, count, scatter)", rep, 1, 1, e,
                    extra_bytes=table * e, count=6),
        *tied,
    ]
