"""The kernels one GPU runs for a GPT training step at its per-GPU shape (after TP slicing), each
with its FLOPs and the bytes it moves, and its time on a Hardware profile.

The list is Megatron-LM 2019's unfused layer (`mpu/transformer.py` @ a1d04b79, the model the
ZeRO paper's runs and baselines used; ../shared/perf/SOURCES.md §2 lists it): per layer, with
T = b·s tokens, h hidden, a heads, t the MP degree, e bytes per element, S = b·(a/t)·s² scores,

- replicated on every TP rank (T·h elements): two layernorms, the two bias adds after the
  row-parallel all-reduces, two dropouts, two residual adds;
- partitioned (T·h/t, T·4h/t): the QKV and MLP-up bias adds, q and k scaled by 1/(h/a)^(1/4)
  each, the permute().contiguous() copies of q, k, v and the context, the GeLU;
- on the scores (S): mask multiply and subtract (two kernels), softmax, attention dropout;
- GEMMs: QKV (T, 3h/t, h), scores (b·a/t batches of (s, s, h/a)), context (s, h/a, s),
  projection (T, h, h/t), MLP up (T, 4h/t, h), down (T, h, 4h/t).

Per step: the embedding (gather, position add, dropout), the final layernorm, the logits GEMM
(T, V/t, h) and the vocab-parallel cross entropy in fp32 (the logits up-cast, clone, max,
subtract, exp, sum, divide; pretrain_gpt2.py:274, mpu/cross_entropy.py). Backward: every GEMM's two (input and weight
gradients), every elementwise op's backward (listed per op below). With recomputation each
layer's forward runs again in backward (the logits and loss are not recomputed).

A kernel's time is max(FLOPs / (peak x gemm efficiency(m, n, k)), bytes / (HBM x achievable
fraction)) + count x the per-kernel floor (launch and host overhead). Under the paper's systems
the memory-bound fp16 kernels of torch itself stream at a further fraction
(System.scalar_half_load_fraction): torch's elementwise loop loaded one element per access
until torch 1.5 (pytorch/pytorch#32383), and its fused dropout, the TorchScript-fused GeLU,
softmax, the bias-gradient reductions and the embedding's index kernels are taken to do the
same [assumption]; apex's FusedLayerNorm and the fp32 cross entropy (mixed fp16/fp32 at its
casts) are taken at the hardware's rate [assumption].
"""
from __future__ import annotations

from dataclasses import dataclass

from experiments.analysis.attention import AttentionCall
from experiments.analysis.hardware import Hardware

MASK_BYTES = 1  # a dropout mask element (torch's bool/uint8)
ATTENTION_DROPOUT = "attention dropout"  # Megatron-LM 2019 forks the RNG state around it (systems.py)


@dataclass(frozen=True)
class Kernel:
    """One kernel (or `count` identical launches): its FLOPs, bytes moved, and for a GEMM the
    shape the GemmModel is asked, (batch·m, n, k)."""

    name: str
    flops: float = 0.0
    bytes: float = 0.0
    gemm: tuple[int, int, int] | None = None
    count: int = 1
    scalar_half_loads: bool = False   # a torch kernel loading fp16 one element per access (module docstring)
    # > 0: not a kernel but where the layer calls a TP all-reduce of this many bytes (count 0:
    # no launch, no bytes of its own; step_time.host_windows prices it in issue order)
    all_reduce_bytes: float = 0.0
    # a fused attention kernel: its FLOPs run at the rate its authors measured (attention.py)
    attention: AttentionCall | None = None

    def times(self, hw: Hardware, scalar_half_load_fraction: float = 1.0) -> tuple[float, float]:
        """(device seconds, floor seconds): max(FLOP time, byte time), count x the floor; a
        kernel with scalar half loads streams at that fraction of the hardware's rate; a fused
        attention kernel's FLOPs at its measured rate on hw's GPU."""
        if self.attention:
            flop_s = self.flops / self.attention.flops_per_s(hw)
        else:
            flop_s = self.flops / (hw.peak_flops * hw.gemm.efficiency(*self.gemm)) if self.gemm else 0.0
        stream = hw.stream_bytes_per_s * (scalar_half_load_fraction if self.scalar_half_loads else 1.0)
        return max(flop_s, self.bytes / stream), self.count * hw.kernel_floor_s


def gemm(name: str, m: int, n: int, k: int, e: int, batch: int = 1) -> Kernel:
    """(m x k) @ (k x n), `batch` times: reads both operands, writes the output."""
    return Kernel(name, flops=2.0 * batch * m * n * k, bytes=float(batch * (m * k + k * n + m * n) * e),
                  gemm=(batch * m, n, k))


def elementwise(name: str, elements: float, reads: float, writes: float, e: int, extra_bytes: float = 0.0,
                count: int = 1, torch_kernel: bool = True) -> Kernel:
    """A memory-bound op over `elements`: `reads` + `writes` passes of e bytes each (+ extra);
    torch_kernel=False for apex's layernorm and the fp32 cross entropy (module docstring)."""
    return Kernel(name, bytes=elements * (reads + writes) * e + extra_bytes, count=count,
                  scalar_half_loads=torch_kernel and e == 2)


@dataclass(frozen=True)
class LayerShape:
    """One GPU's share of a GPT layer: micro-batch b, sequence s, hidden h, heads a, MP t."""

    micro_batch: int
    seq_len: int
    hidden: int
    heads: int
    tp: int
    vocab: int           # padded, whole (the logits GEMM gets vocab / tp columns)
    element_bytes: int
    # the block's options (torch_block.py reads them; Megatron's layers above are GPT-2's):
    ffn_hidden: int = 0          # the MLP's width; 0: 4 x hidden
    kv_heads: int = 0            # key/value heads (grouped-query attention); 0: heads
    bias: bool = True            # biases in the linear layers
    swiglu: bool = False         # a gated SiLU MLP (fc1 2 x ffn_hidden wide) instead of GeLU
    rmsnorm: bool = False        # RMSNorm instead of LayerNorm
    rotary: bool = False         # rotary positions (applied to q and k) instead of a learned table
    tied: bool = True            # the logits reuse the word embedding
    attention: str = "unfused"   # "unfused" or a fused kernel of attention.MEASURED
    fused_loss: bool = False     # a fused cross-entropy kernel (flash-attn's xentropy) instead of torch's

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def scores(self) -> int:
        return self.micro_batch * self.heads // self.tp * self.seq_len ** 2


def gemm_pair(name: str, m: int, n: int, k: int, e: int, batch: int = 1) -> list[Kernel]:
    """The backward of Y = X W (m x k @ k x n): dX = dY W^T (m, k, n) and dW = X^T dY (k, n, m)."""
    return [gemm(f"{name} dgrad", m, k, n, e, batch), gemm(f"{name} wgrad", k, n, m, e, batch)]


def layer_forward(x: LayerShape) -> list[Kernel]:
    """One layer's forward (and its recomputation): module docstring."""
    T, h, t, e, s = x.tokens, x.hidden, x.tp, x.element_bytes, x.seq_len
    d, batch, S = h // x.heads, x.micro_batch * x.heads // t, x.scores
    rep, part, ffn = T * h, T * h // t, T * 4 * h // t
    return [
        elementwise("layernorm 1", rep, 1, 1, e, torch_kernel=False),
        gemm("QKV", T, 3 * h // t, h, e),
        elementwise("QKV bias", 3 * part, 1, 1, e),
        elementwise("q, k, v permute copies", 3 * part, 1, 1, e, count=3),
        elementwise("q, k scaling", 2 * part, 1, 1, e, count=2),
        gemm("scores", s, s, d, e, batch),
        elementwise("mask multiply, subtract", S, 2, 2, e, count=2),
        elementwise("softmax", S, 1, 1, e),
        elementwise(ATTENTION_DROPOUT, S, 1, 1, e, extra_bytes=S * MASK_BYTES),
        gemm("context", s, d, s, e, batch),
        elementwise("context permute copy", part, 1, 1, e),
        gemm("projection", T, h, h // t, e),
        elementwise("projection bias", rep, 1, 1, e),
        elementwise("dropout", rep, 1, 1, e, extra_bytes=rep * MASK_BYTES),
        elementwise("residual add", rep, 2, 1, e),
        elementwise("layernorm 2", rep, 1, 1, e, torch_kernel=False),
        gemm("MLP up", T, 4 * h // t, h, e),
        elementwise("MLP up bias", ffn, 1, 1, e),
        elementwise("GeLU", ffn, 1, 1, e),
        gemm("MLP down", T, h, 4 * h // t, e),
        elementwise("MLP down bias", rep, 1, 1, e),
        elementwise("dropout", rep, 1, 1, e, extra_bytes=rep * MASK_BYTES),
        elementwise("residual add", rep, 2, 1, e),
    ]


def layer_backward(x: LayerShape) -> list[Kernel]:
    """One layer's backward: two GEMMs per forward GEMM; per elementwise op its gradient kernel
    (layernorm: dx from x and dy, and a pass for its weights; a bias: a sum over the tokens;
    dropout and mask: a multiply by the mask; softmax: dx from y and dy; GeLU: dx from x and dy;
    residual: the two branches' gradients added; copies and scalings: one pass each)."""
    T, h, t, e, s = x.tokens, x.hidden, x.tp, x.element_bytes, x.seq_len
    d, batch, S = h // x.heads, x.micro_batch * x.heads // t, x.scores
    rep, part, ffn = T * h, T * h // t, T * 4 * h // t
    return [
        elementwise("residual grad add", rep, 2, 1, e),
        elementwise("dropout bwd", rep, 1, 1, e, extra_bytes=rep * MASK_BYTES),
        elementwise("MLP down bias grad", rep, 1, 0, e),
        *gemm_pair("MLP down", T, h, 4 * h // t, e),
        elementwise("GeLU bwd", ffn, 2, 1, e),
        elementwise("MLP up bias grad", ffn, 1, 0, e),
        *gemm_pair("MLP up", T, 4 * h // t, h, e),
        elementwise("layernorm 2 bwd", rep, 2, 1, e, torch_kernel=False),
        elementwise("layernorm 2 weight grads", rep, 2, 0, e, torch_kernel=False),
        elementwise("residual grad add", rep, 2, 1, e),
        elementwise("dropout bwd", rep, 1, 1, e, extra_bytes=rep * MASK_BYTES),
        elementwise("projection bias grad", rep, 1, 0, e),
        *gemm_pair("projection", T, h, h // t, e),
        elementwise("context permute copy bwd", part, 1, 1, e),
        gemm("context dP", s, s, d, e, batch),
        gemm("context dV", s, d, s, e, batch),
        elementwise("attention dropout bwd", S, 1, 1, e, extra_bytes=S * MASK_BYTES),
        elementwise("softmax bwd", S, 2, 1, e),
        elementwise("mask bwd", S, 1, 1, e),
        gemm("scores dQ", s, d, s, e, batch),
        gemm("scores dK", s, d, s, e, batch),
        elementwise("q, k scaling bwd", 2 * part, 1, 1, e, count=2),
        elementwise("q, k, v permute copies bwd", 3 * part, 1, 1, e, count=3),
        elementwise("QKV bias grad", 3 * part, 1, 0, e),
        *gemm_pair("QKV", T, 3 * h // t, h, e),
        elementwise("layernorm 1 bwd", rep, 2, 1, e, torch_kernel=False),
        elementwise("layernorm 1 weight grads", rep, 2, 0, e, torch_kernel=False),
    ]


def head_forward(x: LayerShape) -> list[Kernel]:
    """Once per micro-batch: embedding, final layernorm, logits, fp32 cross entropy."""
    T, h, t, e = x.tokens, x.hidden, x.tp, x.element_bytes
    rep, logits = T * h, T * x.vocab // t
    return [
        elementwise("word embedding gather", rep, 0, 1, e),
        elementwise("position embedding gather", rep, 0, 1, e),
        elementwise("embedding add", rep, 2, 1, e),
        elementwise("embedding dropout", rep, 1, 1, e, extra_bytes=rep * MASK_BYTES),
        elementwise("final layernorm", rep, 1, 1, e, torch_kernel=False),
        gemm("logits", T, x.vocab // t, h, e),
        # mpu/cross_entropy.py @ a1d04b79: up-cast (e in, 4 out), clone (8), max (4), subtract (8),
        # exp (8), sum (4), divide (8): e + 44 bytes a logit in 7 kernels
        elementwise("cross entropy (fp32)", logits, 0, 0, e, extra_bytes=logits * (e + 44), count=7, torch_kernel=False),
    ]


def head_backward(x: LayerShape) -> list[Kernel]:
    T, h, t, e = x.tokens, x.hidden, x.tp, x.element_bytes
    rep, logits = T * h, T * x.vocab // t
    return [
        # the target's one-hot subtracted in place (T elements, a floor), times the loss gradient
        # (8 bytes fp32), down-cast (4 in, e out)
        elementwise("cross entropy bwd (fp32)", logits, 0, 0, e, extra_bytes=logits * (8 + 4 + e), count=3, torch_kernel=False),
        *gemm_pair("logits", T, x.vocab // t, h, e),
        elementwise("final layernorm bwd", rep, 2, 1, e, torch_kernel=False),
        elementwise("final layernorm weight grads", rep, 2, 0, e, torch_kernel=False),
        elementwise("embedding dropout bwd", rep, 1, 1, e, extra_bytes=rep * MASK_BYTES),
        elementwise("word embedding grad (zero, scatter)", rep, 1, 1, e,
                    extra_bytes=x.vocab // t * h * e, count=2),
        elementwise("position embedding grad", rep, 1, 1, e),
    ]


# -- Megatron-DeepSpeed 2023's fused layer ------------------------------------------------------
# megatron/model/transformer.py, fused_softmax.py, fused_bias_gelu.py, mpu/layers.py @ f01c9e6e
# (2023-06-30), on PyTorch 2.0.1 and apex 2386a912 built with its CUDA extensions, fp16, the
# defaults --masked-softmax-fusion, --bias-gelu-fusion, --bias-dropout-fusion; [s, b, h] layout.
# Per layer forward, at T = b·s tokens, t the TP degree:
#   apex FusedLayerNorm; QKV F.linear with its bias in cuBLASLt's epilogue (one GEMM); the scores
#   by torch.baddbmm with alpha = 1/sqrt(h/a) (one GEMM, the scaling inside); apex's
#   scaled_upper_triang_masked_softmax (scale, causal mask and softmax in one kernel); attention
#   dropout; the context bmm; permute(2, 0, 1, 3).contiguous(); the projection F.linear without its
#   bias (skip_bias_add); TorchScript's bias_dropout_add_fused_train (bias, dropout, residual: one
#   fused kernel); FusedLayerNorm; two torch.tensor(0.0, device=...) (moe_loss, mlp_bias: an H2D
#   copy each, non_blocking=False, so a cudaStreamSynchronize: the host waits for the GPU,
#   transformer.py:537-538); MLP up without bias; bias_gelu_impl (one jit kernel); MLP down; the
#   second bias_dropout_add. With TP the two row-parallel outputs are all-reduced (step_time).
# Backward (autograd): each GEMM's two; the fused kernels' backward (bias_dropout_add: the
# masked gradient and the bias gradient's sum; bias-GeLU: its gradient and the bias sum; the
# softmax's; dropout's mask multiply); baddbmm's two bmm and their alpha multiplies; the QKV split's
# gradient concatenated; QKV's bias sum; apex layernorm backward, three kernels
# (cuComputePartGradGammaBeta, cuComputeGradGammaBeta, cuComputeGradInput); the residual branches'
# gradients added; and per parameter Megatron's LocalDDP hook main_grad.add_(grad) (12 a layer,
# megatron/model/distributed.py: its contiguous gradient buffer) [assumption: Megatron's own DDP,
# not DeepSpeed's engine].
def tp_all_reduce(name: str, x: LayerShape, nbytes: float) -> list[Kernel]:
    """Where the layer calls Megatron's TP all-reduce (none at TP 1)."""
    return [Kernel(name, count=0, all_reduce_bytes=float(nbytes))] if x.tp > 1 else []


def fused_softmax_runs(x: LayerShape) -> bool:
    """Whether FusedScaleMaskSoftmax takes apex's fused kernel (fused_softmax.py @ f01c9e6e:
    16 < sk <= 2048, sq % 4 == 0 and b·(a/t) % 4 == 0); else it falls back to torch: up-cast to
    fp32, the query-key layer scaling's multiply, masked_fill_, softmax, down-cast (TP 8 with 16
    heads at micro-batch 1: b·a/t = 2)."""
    return 16 < x.seq_len <= 2048 and x.seq_len % 4 == 0 and (x.micro_batch * x.heads // x.tp) % 4 == 0


def _softmax_forward(x: LayerShape) -> list[Kernel]:
    S, e = x.scores, x.element_bytes
    if fused_softmax_runs(x):
        return [elementwise("scale, causal mask, softmax (apex, fused)", S, 1, 1, e)]
    return [elementwise("softmax fallback: up-cast to fp32", S, 0, 0, e, extra_bytes=S * (e + 4)),
            elementwise("softmax fallback: layer scaling multiply (fp32)", S, 0, 0, e, extra_bytes=S * 8),
            elementwise("softmax fallback: masked_fill_ (fp32)", S, 0, 0, e, extra_bytes=S * (8 + MASK_BYTES)),
            elementwise("softmax fallback: softmax (fp32)", S, 0, 0, e, extra_bytes=S * 8),
            elementwise("softmax fallback: down-cast", S, 0, 0, e, extra_bytes=S * (4 + e))]


def _softmax_backward(x: LayerShape) -> list[Kernel]:
    S, e = x.scores, x.element_bytes
    if fused_softmax_runs(x):
        return [elementwise("softmax bwd (apex, fused)", S, 2, 1, e)]
    return [elementwise("softmax fallback bwd: up-cast", S, 0, 0, e, extra_bytes=S * (e + 4)),
            elementwise("softmax fallback bwd: softmax (fp32)", S, 0, 0, e, extra_bytes=S * 12),
            elementwise("softmax fallback bwd: masked_fill (fp32)", S, 0, 0, e, extra_bytes=S * (8 + MASK_BYTES)),
            elementwise("softmax fallback bwd: layer scaling multiply (fp32)", S, 0, 0, e, extra_bytes=S * 8),
            elementwise("softmax fallback bwd: down-cast", S, 0, 0, e, extra_bytes=S * (4 + e))]


def layer_forward_fused(x: LayerShape) -> list[Kernel]:
    """One layer's forward (and its recomputation) as Megatron-DeepSpeed 2023 issues it."""
    T, h, t, e, s = x.tokens, x.hidden, x.tp, x.element_bytes, x.seq_len
    d, batch, S = h // x.heads, x.micro_batch * x.heads // t, x.scores
    rep, part, ffn = T * h, T * h // t, T * 4 * h // t
    return [
        elementwise("layernorm 1 (apex)", rep, 1, 1, e, torch_kernel=False),
        gemm("QKV (bias in the epilogue)", T, 3 * h // t, h, e),
        gemm("scores (baddbmm, scaled)", s, s, d, e, batch),
        *_softmax_forward(x),
        elementwise(ATTENTION_DROPOUT, S, 1, 1, e, extra_bytes=S * MASK_BYTES),
        gemm("context (bmm)", s, d, s, e, batch),
        elementwise("context permute copy", part, 1, 1, e),
        gemm("projection", T, h, h // t, e),
        *tp_all_reduce("TP all-reduce: projection output", x, rep * e),
        elementwise("bias, dropout, residual (jit, fused)", rep, 2, 1, e, extra_bytes=rep * MASK_BYTES),
        elementwise("layernorm 2 (apex)", rep, 1, 1, e, torch_kernel=False),
        Kernel("moe_loss, mlp_bias: torch.tensor on the device (H2D copy, stream sync)", bytes=4 * e, count=2),
        gemm("MLP up", T, 4 * h // t, h, e),
        elementwise("bias, GeLU (jit, fused)", ffn, 1, 1, e),
        gemm("MLP down", T, h, 4 * h // t, e),
        *tp_all_reduce("TP all-reduce: MLP output", x, rep * e),
        elementwise("bias, dropout, residual (jit, fused)", rep, 2, 1, e, extra_bytes=rep * MASK_BYTES),
    ]


# host syncs in one layer's forward (the two H2D copies above): the GPU cannot run ahead of them
FUSED_LAYER_FORWARD_SYNCS = 2
LOCAL_DDP_HOOKS_PER_LAYER = 12   # parameters of a layer (systems.parameter_tensors)


def layer_backward_fused(x: LayerShape) -> list[Kernel]:
    """One layer's backward as autograd runs Megatron-DeepSpeed 2023's layer (comment above)."""
    T, h, t, e, s = x.tokens, x.hidden, x.tp, x.element_bytes, x.seq_len
    d, batch, S = h // x.heads, x.micro_batch * x.heads // t, x.scores
    rep, part, ffn = T * h, T * h // t, T * 4 * h // t
    layer_params = 12 * h * h // t + 7 * h + 6 * h // t   # QKV, projection, MLP weights and their biases, 2 layernorms
    return [
        elementwise("bias, dropout, residual bwd (masked grad)", rep, 1, 1, e, extra_bytes=rep * MASK_BYTES),
        elementwise("MLP down bias grad (sum)", rep, 1, 0, e),
        *gemm_pair("MLP down", T, h, 4 * h // t, e),
        elementwise("bias, GeLU bwd (jit)", ffn, 2, 1, e),
        elementwise("MLP up bias grad (sum)", ffn, 1, 0, e),
        *gemm_pair("MLP up", T, 4 * h // t, h, e),
        *tp_all_reduce("TP all-reduce: MLP input grad", x, rep * e),
        elementwise("layernorm 2 bwd (apex, 3 kernels)", rep, 2, 1, e, extra_bytes=rep * e, count=3, torch_kernel=False),
        elementwise("residual grad add", rep, 2, 1, e),
        elementwise("bias, dropout, residual bwd (masked grad)", rep, 1, 1, e, extra_bytes=rep * MASK_BYTES),
        elementwise("projection bias grad (sum)", rep, 1, 0, e),
        *gemm_pair("projection", T, h, h // t, e),
        elementwise("context permute copy bwd", part, 1, 1, e),
        gemm("context dP", s, s, d, e, batch),
        gemm("context dV", s, d, s, e, batch),
        elementwise("attention dropout bwd", S, 1, 1, e, extra_bytes=S * MASK_BYTES),
        *_softmax_backward(x),
        gemm("scores dQ", s, d, s, e, batch),
        gemm("scores dK", s, d, s, e, batch),
        elementwise("baddbmm's alpha on dQ, dK", 2 * part, 1, 1, e, count=2),
        elementwise("QKV split grad (cat)", 3 * part, 1, 1, e),
        elementwise("QKV bias grad (sum)", 3 * part, 1, 0, e),
        *gemm_pair("QKV", T, 3 * h // t, h, e),
        *tp_all_reduce("TP all-reduce: QKV input grad", x, rep * e),
        elementwise("layernorm 1 bwd (apex, 3 kernels)", rep, 2, 1, e, extra_bytes=rep * e, count=3, torch_kernel=False),
        elementwise("residual grad add", rep, 2, 1, e),
        elementwise("LocalDDP hooks: main_grad.add_(grad)", layer_params, 2, 1, e, count=LOCAL_DDP_HOOKS_PER_LAYER),
    ]


def head_forward_fused(x: LayerShape) -> list[Kernel]:
    """Once per micro-batch, Megatron-DeepSpeed 2023: get_batch (the tokens' H2D copies, the
    causal mask and position ids: get_ltor_masks_and_position_ids), the vocab-parallel embedding
    (with TP: the out-of-range mask, the shifted ids, two masked fills), position embedding, add,
    dropout, the transpose to [s, b, h], the final layernorm, the logits, the fp32 vocab-parallel
    cross entropy (mpu/cross_entropy.py: up-cast, max, subtract, target mask and gather, exp,
    sum, log, divide; 17 kernels) and the loss mask's sum and mean."""
    T, h, t, e, s = x.tokens, x.hidden, x.tp, x.element_bytes, x.seq_len
    rep, logits = T * h, T * x.vocab // t
    tp_masking = 5 if t > 1 else 0
    return [
        Kernel("get_batch: H2D copies, slices, causal mask, position ids", bytes=float(s * s + 4 * T * 8), count=12),
        elementwise("word embedding gather", rep, 0, 1, e, extra_bytes=T * 8.0, count=1 + tp_masking),
        *tp_all_reduce("TP all-reduce: embedding output", x, rep * e),
        elementwise("position embedding gather", rep, 0, 1, e),
        elementwise("embedding add", rep, 2, 1, e),
        elementwise("embedding dropout", rep, 1, 1, e, extra_bytes=rep * MASK_BYTES),
        elementwise("transpose to [s, b, h]", rep, 1, 1, e),
        elementwise("final layernorm (apex)", rep, 1, 1, e, torch_kernel=False),
        gemm("logits", T, x.vocab // t, h, e),
        # up-cast (e in, 4 out), max (4), subtract in place (8), exp (8), sum (4), divide (8)
        elementwise("cross entropy (fp32)", logits, 0, 0, e, extra_bytes=logits * (e + 32), count=17, torch_kernel=False),
        *[k for name in ("max", "target logit", "sum of exp") for k in tp_all_reduce(f"TP all-reduce: cross entropy {name}", x, T * 4)],
        Kernel("loss mask, sum, mean; loss averaged over DP (cat, divide)", bytes=T * 12.0, count=7),
    ]


def head_backward_fused(x: LayerShape) -> list[Kernel]:
    T, h, t, e = x.tokens, x.hidden, x.tp, x.element_bytes
    rep, logits = T * h, T * x.vocab // t
    return [
        Kernel("loss mask bwd", bytes=T * 12.0, count=3),
        # softmax minus the one-hot (in place, 8), times the loss gradient (8), down-cast (4 in, e out)
        elementwise("cross entropy bwd (fp32)", logits, 0, 0, e, extra_bytes=logits * (8 + 8 + 4 + e), count=5, torch_kernel=False),
        *gemm_pair("logits", T, x.vocab // t, h, e),
        *tp_all_reduce("TP all-reduce: logits input grad", x, rep * e),
        elementwise("final layernorm bwd (apex, 3 kernels)", rep, 2, 1, e, extra_bytes=rep * e, count=3, torch_kernel=False),
        elementwise("transpose bwd", rep, 1, 1, e),
        elementwise("embedding dropout bwd", rep, 1, 1, e, extra_bytes=rep * MASK_BYTES),
        elementwise("word embedding grad (embedding_dense_backward: sort, count, scatter)", rep, 1, 1, e,
                    extra_bytes=x.vocab // t * h * e, count=6),
        elementwise("position embedding grad", rep, 1, 1, e, count=2),
        elementwise("LocalDDP hooks on the embeddings and final layernorm", x.vocab // t * h + x.seq_len * h,
                    2, 1, e, count=4),
    ]


@dataclass(frozen=True)
class ComputeTime:
    """Seconds of a set of kernels: GEMMs, memory-bound kernels, floors."""

    gemm_s: float = 0.0
    memory_bound_s: float = 0.0
    floors_s: float = 0.0
    flops: float = 0.0

    @property
    def total_s(self) -> float:
        return self.gemm_s + self.memory_bound_s + self.floors_s

    def __add__(self, other: "ComputeTime") -> "ComputeTime":
        return ComputeTime(self.gemm_s + other.gemm_s, self.memory_bound_s + other.memory_bound_s,
                           self.floors_s + other.floors_s, self.flops + other.flops)


def compute_time(kernels: list[tuple[Kernel, int]], hw: Hardware, scalar_half_load_fraction: float = 1.0) -> ComputeTime:
    """Sum over (kernel, repeats): a GEMM's or a fused attention kernel's device time counts as
    GEMM (FLOP bound), the rest memory-bound."""
    g = m = f = flops = 0.0
    for kernel, repeats in kernels:
        device, floor = kernel.times(hw, scalar_half_load_fraction)
        if kernel.gemm or kernel.attention:
            g += device * repeats
        else:
            m += device * repeats
        f += floor * repeats
        flops += kernel.flops * repeats
    return ComputeTime(g, m, f, flops)
