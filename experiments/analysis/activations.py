"""Memory per GPU beyond model states: activations, the loss's logits, and the engine's buffers.

Table 1 of the ZeRO paper counts model states only (`memory.py`); whether a point fits a GPU
also depends on what its micro-batch keeps for backward. Sources and formulas, bytes, with
s = sequence length, b = micro-batch, h = hidden, a = heads, L = layers, V = padded vocabulary,
t = tensor-parallel degree, p = bytes per activation element (2 for fp16/bf16):

- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv 2205.05198), §4.1 Eq. (1): one transformer layer keeps s·b·h·(34 + 5·a·s/h) bytes
  for backward (16-bit activations, 1-byte dropout masks); §4.2 Eq. (2), tensor parallelism
  without sequence parallelism: s·b·h·(10 + 24/t + 5·a·s/(h·t)). By tensor:
      replicated on every TP rank: LayerNorm inputs 2·2sbh, QKV and FC1 inputs 2·2sbh, two
          dropout masks 2·sbh                                  -> sbh·(4p + 2)
      sharded: Q, K, V 6sbh, projection input 2sbh, GeLU input 8sbh, FC2 input 8sbh
                                                               -> sbh·12p / t
      attention: softmax output 2as²b, its dropout mask as²b, dropout output 2as²b
                                                               -> as²b·(2p + 1) / t
  That attention part is the fused fp16 softmax's; megatron-core's local attention runs its
  softmax in fp32 and keeps the fp32 output too: as²b·(p + 5)/t with dropout, (p + 4)/t
  without at 16 bits (`kept_per_score`), what this model counts (`layer_activation_bytes`;
  with dropout off the masks and the dropout output go: the paper trains GPT-2 with dropout
  0.1, the benchmark model here runs without).
- §5, full activation recomputation (one checkpoint per layer, as the paper trains): only each
  layer's input is kept, p·s·b·h bytes per layer = 2sbh at fp16, held whole by every TP rank
  (not divided by t) unless ZeRO-R's Pa partitions it; backward then recomputes one layer at a
  time, whose full activations (Eq. 2) exist while it runs (`checkpoint_bytes`).
- Beyond Eq. 1-2, what megatron-core 0.16.1's local (unfused) attention holds while a layer
  runs, measured op by op (`attention_working_bytes`, `score_buffer_bytes`): its s x s
  working set peaks at 12·a·s²·b/t bytes at 16 bits (16 in fp32), not the p·a·s²·b/t of the
  softmax output the paper keeps, and a persistent p-byte buffer of one layer's scores is held
  from the first forward on. The recomputed layer's peak (or, without recomputation, the last
  layer's) is the larger of what it keeps and that working set with the tensors around it. A
  flash-style kernel (TE's) has neither.
- §4.3, outside the layers: the final LayerNorm's and the output layer's inputs (p·sbh each)
  and the embedding dropout mask (sbh), replicated (`head_bytes`); the cross entropy keeps the
  fp32 softmax of the vocabulary-parallel logits, 4·s·b·V/t. While it runs the p-byte logits
  (or, in backward, their gradient) exist beside it: megatron-core's vocab_parallel_cross_entropy
  casts the logits with `.float()` and exponentiates in place, so the loss's working set peaks
  at (p + 4)·s·b·V/t = 6·s·b·V/t at fp16 (4·s·b·V/t in fp32, where `.float()` copies
  nothing) (`logits_bytes`). It is freed after the output layer's backward, before any layer
  is recomputed, so only the larger of the two working sets counts.
- The engine (zero_impl), during backward (`engine_buffer_bytes`):
      stages 0-1: none beyond model states (the full gradient buffer is Table 1's 2Ψ);
      stage 2: bucket staging in the reduce dtype, MAX_INFLIGHT_STAGING buckets of
          reduce_bucket_size elements in flight plus the one filling, which is the tied
          embedding's own bucket at the end of backward (zero_impl/grad_reducer.py);
      stage 3: the gathered units, at most stage3_max_live_units of them, the root (the
          embeddings) among them, in model precision, plus the same gradient staging with one
          bucket per unit;
  and at every stage the tied word-embedding/output-layer gradient, V·h/t elements: the
  output layer's part is produced first and waits for the embedding lookup's, at the very end
  of backward, before its accumulation hook fires.

Peak per GPU (`activation_memory`, `points.predicted_memory_bytes`):
    model states + kept activations + score buffer
        + max(loss working set + stage 3's gathered units, one layer's peak + the engine's buffers):
    the loss runs before any gradient exists, so the engine's gradient buffers come with the layers.
"""
from __future__ import annotations

from zero_impl import MAX_INFLIGHT_STAGING


def layer_activation_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1, *,
                           bytes_per_element: int = 2, dropout: bool = True, kv_hidden: int | None = None,
                           ffn: int | None = None, swiglu: bool = False, rotated_copies: bool = False,
                           rmsnorm: bool = False, fused_attention: bool = False) -> float:
    """Bytes one transformer layer keeps for backward on one TP rank: Korthikanti et al. 2022
    Eq. 1 at t = 1, Eq. 2 for TP t without sequence parallelism, for its linear part; its
    attention's s x s part as megatron-core's local attention keeps it (`kept_per_score`: 7 bytes
    a score with dropout at p = 2, where the paper's fused fp16 softmax keeps 5), so p = 2 with
    dropout gives s·b·h·(10 + 24/t + 7·a·s/(h·t)).

    Shapes beyond GPT-2's (the defaults keep its numbers), as megatron-core's local layers keep
    them (tests/experiments/test_model_choices.py counts what autograd saves): kv_hidden, the
    width of the K and V kept (kv_heads x head dim where the attention keeps them so, as TE's
    fused attention does; megatron's local DotProductAttention repeats them to every head and
    keeps those: hidden each); ffn, the MLP's width f (4h): GeLU keeps its input and FC2's,
    2f; SwiGLU keeps FC1's output (gate and up, 2f), the SiLU's output, megatron's copy of the
    up half (`x_linear + glu_linear_offset`) and FC2's input: 5f. rotated_copies: rotary
    embeddings make new Q and K (2h) while V, a view of the QKV output, keeps all of it (multi-
    head attention on the local spec; with grouped K/V the repeat copies V instead); rmsnorm:
    torch's RMSNorm keeps its normalized input besides its input, p·sbh more per norm. Biases
    keep nothing more. fused_attention: a flash-style kernel (TE's DotProductAttention) keeps no
    s x s tensor, only its softmax statistics, an fp32 log-sum-exp a row: 4·a·s·b/t.

    test_model_choices.py measures the kept set of megatron's layer in fp32 and in bf16."""
    s, b, h, a, t, p = seq_len, micro_batch, hidden, heads, tp, bytes_per_element
    masks = 1 if dropout else 0
    replicated = s * b * h * (4 * p + 2 * masks) + (2 * p * s * b * h if rmsnorm else 0)
    if kv_hidden is None and ffn is None and not (swiglu or rotated_copies):
        sharded = s * b * h * 12 * p / t
    else:
        kv = h if kv_hidden is None else kv_hidden
        f = 4 * h if ffn is None else ffn
        qkv = h + 2 * kv + (2 * h if rotated_copies else 0)
        sharded = s * b * (qkv + h + f * (5 if swiglu else 2)) * p / t
    attention = (4 * a * s * b if fused_attention else a * s * s * b * kept_per_score(p, dropout)) / t
    return replicated + sharded + attention


def kept_per_score(bytes_per_element: int, dropout: bool) -> int:
    """Bytes per score element (a·s²·b/t of them) one layer's local attention keeps for backward.
    megatron-core 0.16.1 runs the softmax in fp32 (attention_softmax_in_fp32, masked_softmax_fusion
    off: FusedScaleMaskSoftmax.forward_torch_softmax) and softmax saves its fp32 output
    (fusions/fused_softmax.py:335): 4; the context bmm saves its p-byte input, the probabilities
    cast back to p bytes (:340; at fp32 the softmax output itself, nothing more) or, with dropout,
    dropout's p-byte output beside its 1-byte mask. So p + 4 at 16 bits (6), 4 at fp32, p + 5
    with dropout. Korthikanti et al.'s Eq. 1 counts the fused fp16 kernel's p-byte softmax output,
    5 with dropout at p = 2, where megatron-core's local path keeps 7."""
    p = bytes_per_element
    if dropout:
        return 4 + 1 + p
    return 4 + (p if p < 4 else 0)


def attention_working_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1, *,
                            bytes_per_element: int = 2, kv_hidden: int | None = None, rotated_copies: bool = False,
                            rmsnorm: bool = False, fused_attention: bool = False) -> float:
    """Bytes alive at once on one TP rank while one layer's local (unfused) attention runs, at the
    layer's peak: its s x s working set and the tensors of the layer alive beside it, the score
    buffer (`score_buffer_bytes`) left out. U = a·s²·b/t elements; megatron-core 0.16.1 paths
    (megatron/core/...), with attention_softmax_in_fp32 (build_gpt sets it, megatron's default)
    and masked_softmax_fusion off (megatron's default: FusedScaleMaskSoftmax.forward_torch_softmax;
    its fused CUDA kernel, where turned on, takes 16 < s <= 4096 only, fused_softmax.py:256, so a
    longer sequence runs this path anyway):

    16-bit (p = 2), 12·U bytes, at two moments:
      forward, at the probabilities' cast (fusions/fused_softmax.py:340, `.bfloat16()`; :338
      `.half()`): the p-byte raw scores, baddbmm's output (transformer/dot_product_attention.py:194,
      out of place although beta=0; referenced by `matmul_result`/`attention_scores` until the
      attention returns), their fp32 up-cast (fused_softmax.py:314 `input.float()`, masked in
      place by transformer/utils.py:50 `masked_fill_`), the fp32 softmax output (fused_softmax.py:335,
      saved by softmax for its backward) and the p-byte probabilities (:340, saved by the context
      bmm, dot_product_attention.py:239): p + 4 + 4 + p = 12.
      backward, at the softmax's backward (autograd's _softmax_backward_data): the saved fp32
      softmax output, the gradient of the probabilities cast back to fp32 (the backward of :340's
      cast; the bmm's p-byte gradient is freed by then, and so is the saved p-byte probabilities)
      and the fp32 gradient of the scores it returns: 4 + 4 + 4 = 12. With dropout (the paper's
      recipe) its mask and output are gone by then: still 12 (dropout's forward moment, p + 4 +
      p + 1 + p, is less).
    fp32 (p = 4), 16·U bytes: `.float()` is a no-op, so masked_fill_ masks a view of baddbmm's
      output in place (utils.py:50 on the view of dot_product_attention.py:203); its backward is
      autograd's CopySlices, which holds a gradient of the whole scores (new_empty_strided), a
      contiguous clone of the view's gradient and masked_fill's output beside the view's
      backward zero-filled gradient of the base (new_zeros): 4 tensors of 4 bytes (the softmax's
      backward, 12, comes before).

    Beside it, of the layer (its MLP's tensors are not made yet in forward, and freed in
    backward): the attention's input side it keeps, the norm's input and output p·sbh each
    (+ torch RMSNorm's normalized input, p·sbh) and Q, K, V (kv_hidden, rotated_copies:
    `layer_activation_bytes`), and in backward three gradients: the layer output's and the
    residual's, p·sbh each, and the context's, p·sbh/t. A flash-style kernel (fused_attention)
    has no s x s tensor: 0 (the layer's kept set is then its peak)."""
    if fused_attention:
        return 0.0
    s, b, h, t, p = seq_len, micro_batch, hidden, tp, bytes_per_element
    kv = h if kv_hidden is None else kv_hidden
    qkv = h + 2 * kv + (2 * h if rotated_copies else 0)
    around = s * b * h * p * (4 + (1 if rmsnorm else 0)) + s * b * (qkv + h) * p / t
    return score_working_bytes(seq_len, micro_batch, heads, tp, bytes_per_element=p) + around


def score_working_bytes(seq_len: int, micro_batch: int, heads: int, tp: int = 1, *, bytes_per_element: int = 2,
                        fused_attention: bool = False) -> float:
    """The s x s part of `attention_working_bytes`: the most score-sized tensors one layer's local
    attention holds at once, 12·a·s²·b/t bytes at 16 bits, 16·a·s²·b/t in fp32 (by tensor there),
    the score buffer left out; 0 with a fused kernel."""
    if fused_attention:
        return 0.0
    return heads * seq_len * seq_len * micro_batch / tp * (12 if bytes_per_element < 4 else 16)


def score_buffer_bytes(seq_len: int, micro_batch: int, heads: int, tp: int = 1, *, bytes_per_element: int = 2,
                       fused_attention: bool = False) -> float:
    """megatron's preallocated input of the scores' baddbmm, p·a·s²·b/t bytes on one TP rank:
    transformer/dot_product_attention.py:189 asks parallel_state's GlobalMemoryBuffer for a
    [b·a/t, s, s] tensor of the query's dtype (name "mpu"); utils.py:628 allocates it once, the
    first time a layer's attention runs, and keeps it for the process's life (baddbmm with
    beta=0 writes a new tensor and never frees it). So it is there in every phase after the
    first forward, the loss's and the optimizer step's included. None with a fused kernel."""
    if fused_attention:
        return 0.0
    return bytes_per_element * heads * seq_len * seq_len * micro_batch / tp


def checkpoint_bytes(seq_len: int, micro_batch: int, hidden: int, layers: int, *, bytes_per_element: int = 2) -> float:
    """Layer inputs kept with full recomputation: p·s·b·h per layer (2sbh at fp16, Korthikanti
    §5), on every TP rank."""
    return layers * bytes_per_element * seq_len * micro_batch * hidden


def head_bytes(seq_len: int, micro_batch: int, hidden: int, *, bytes_per_element: int = 2,
               dropout: bool = True) -> float:
    """Outside the layers (Korthikanti §4.3): final LayerNorm input and output-layer input,
    p·sbh each, and the embedding dropout mask, sbh; replicated over TP."""
    return seq_len * micro_batch * hidden * (2 * bytes_per_element + (1 if dropout else 0))


def logits_bytes(seq_len: int, micro_batch: int, vocab: int, tp: int = 1, *, bytes_per_element: int = 2) -> float:
    """The loss's working set: the fp32 softmax of the vocabulary-parallel logits, 4·s·b·V/t
    (Korthikanti §4.3), plus the p-byte logits or their gradient beside it, (p + 4)·s·b·V/t in
    all (6·s·b·V/t at fp16; 4·s·b·V/t in fp32, where megatron's `.float()` copies nothing)."""
    extra = 0 if bytes_per_element == 4 else bytes_per_element
    return seq_len * micro_batch * vocab / tp * (4 + extra)


def activation_memory(*, seq_len: int, micro_batch: int, hidden: int, heads: int, layers: int, vocab: int,
                      tp: int = 1, recompute: bool = True, bytes_per_element: int = 2,
                      dropout: bool = True, partition_activations: bool = False,
                      cpu_checkpointing: bool = False, kv_hidden: int | None = None, ffn: int | None = None,
                      swiglu: bool = False, rotated_copies: bool = False, rmsnorm: bool = False,
                      fused_attention: bool = False) -> dict[str, float]:
    """Activation bytes per GPU by term, and `total`: what is kept through forward, the local
    attention's score buffer (`score_buffer`, held from the first forward on), and the larger
    of the two transient working sets (the loss's, or one layer's peak).
    With recomputation, `recomputed_layer` is the recomputed layer's peak: the larger of what it
    keeps (Eq. 2, at the end of its forward) and its attention's working set with the tensors
    around it (`attention_working_bytes`, in its softmax's backward). Without, every layer keeps
    Eq. 2 and the last one's attention adds what its working set holds beyond that
    (`last_layer_transient`), when the loss's does not dominate.
    With recomputation, ZeRO-R's Pa keeps 1/t of each checkpoint (zero_impl/activations.py; the
    gathered copy is the recomputed layer's input, already in its Eq. 2 working set) and Pa+cpu
    keeps that slice in host memory: `host_checkpoints`, outside the device total.
    kv_hidden, ffn, swiglu, rotated_copies, rmsnorm, fused_attention: the layer's shape beyond
    GPT-2's and its attention kernel (`layer_activation_bytes`)."""
    layer = layer_activation_bytes(seq_len, micro_batch, hidden, heads, tp, bytes_per_element=bytes_per_element,
                                   dropout=dropout, kv_hidden=kv_hidden, ffn=ffn, swiglu=swiglu,
                                   rotated_copies=rotated_copies, rmsnorm=rmsnorm, fused_attention=fused_attention)
    attention = attention_working_bytes(seq_len, micro_batch, hidden, heads, tp, bytes_per_element=bytes_per_element,
                                        kv_hidden=kv_hidden, rotated_copies=rotated_copies, rmsnorm=rmsnorm,
                                        fused_attention=fused_attention)
    kept = checkpoint_bytes(seq_len, micro_batch, hidden, layers, bytes_per_element=bytes_per_element)
    if recompute and partition_activations:
        kept = layers * bytes_per_element * -(-seq_len * micro_batch * hidden // tp)
    host = kept if recompute and partition_activations and cpu_checkpointing else 0.0
    out = {
        "layers_kept": (kept - host if recompute else layers * layer),
        "host_checkpoints": host,
        "head": head_bytes(seq_len, micro_batch, hidden, bytes_per_element=bytes_per_element, dropout=dropout),
        "score_buffer": score_buffer_bytes(seq_len, micro_batch, heads, tp, bytes_per_element=bytes_per_element,
                                           fused_attention=fused_attention),
        "recomputed_layer": max(layer, attention) if recompute else 0.0,
        "last_layer_transient": 0.0 if recompute else max(0.0, attention - layer),
        "logits": logits_bytes(seq_len, micro_batch, vocab, tp, bytes_per_element=bytes_per_element),
    }
    out["total"] = (out["layers_kept"] + out["head"] + out["score_buffer"]
                    + max(out["recomputed_layer"] + out["last_layer_transient"], out["logits"]))
    return out


def layer_params_per_tp_rank(hidden: int, tp: int) -> float:
    """Parameters of one transformer layer on one TP rank: (12h² + 7h)/t sharded (QKV, projection
    and MLP weights, QKV and FC1 biases) + 6h replicated (two LayerNorms, two row-parallel biases)."""
    return (12 * hidden * hidden + 7 * hidden) / tp + 6 * hidden


def root_params_per_tp_rank(hidden: int, seq_len: int, vocab: int, tp: int) -> float:
    """Parameters outside the layers on one TP rank: word embeddings V·h/t (tied to the output
    layer), position embeddings s·h, final LayerNorm 2h."""
    return vocab * hidden / tp + seq_len * hidden + 2 * hidden


def engine_buffer_bytes(*, stage: int, hidden: int, seq_len: int, vocab: int, tp: int = 1, params: float,
                        reduce_bucket_size: int, stage3_max_live_units: int = 3, param_bytes: int = 2,
                        reduce_bytes: int = 2, layer_params: float | None = None,
                        root_params: float | None = None) -> dict[str, float]:
    """The engine's buffers during backward on one GPU, by term, and `total` (module docstring).

    params: the parameters of this TP rank (Ψ of Table 1); a bucket never holds more.
    Gradient staging: MAX_INFLIGHT_STAGING buckets in flight plus the one filling. A parameter
    larger than reduce_bucket_size gets a bucket of its own; in GPT that is the tied word
    embedding (V·h/t), the last parameter to report its gradient, so at most one staged bucket
    is that large: MAX_INFLIGHT_STAGING·B + max(B, V·h/t) elements, B = reduce_bucket_size.
    Stage 3 stages one bucket per unit, the root unit (embeddings) last, and keeps the root plus
    stage3_max_live_units - 1 layers gathered.
    layer_params, root_params: one layer's and the root's parameters on this TP rank where the
    shape is not GPT-2's (gpt_shape.layer_parameters, root_parameters; None: GPT-2's). An untied
    output layer is in the root; its gradient is staged as soon as backward produces it, and
    the word embedding's, last, is still the V·h/t counted as embedding_grad.
    """
    layer = layer_params_per_tp_rank(hidden, tp) if layer_params is None else layer_params
    root = root_params_per_tp_rank(hidden, seq_len, vocab, tp) if root_params is None else root_params
    embedding = vocab * hidden / tp
    out = {"grad_staging": 0.0, "gathered_units": 0.0, "embedding_grad": embedding * param_bytes}
    if stage == 2:
        bucket = min(reduce_bucket_size, params)
        out["grad_staging"] = min(params, MAX_INFLIGHT_STAGING * bucket + max(bucket, embedding)) * reduce_bytes
    elif stage == 3:
        out["grad_staging"] = (MAX_INFLIGHT_STAGING * layer + max(layer, root)) * reduce_bytes
        out["gathered_units"] = (root + (stage3_max_live_units - 1) * layer) * param_bytes
    out["total"] = sum(out.values())
    return out
