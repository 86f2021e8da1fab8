"""The one place a point's model, engine and tokens are built: the real run (real.py) and the
simulated rank (fake.py) both call these, so a change to how a point is built is one edit."""
from __future__ import annotations

import torch

import zero_impl
from experiments.models.megatron_gpt import build_gpt, megatron_param_init_fn
from experiments.models.gpt_shape import parameter_count
from experiments.models.tiny_gpt import synthetic_tokens
from experiments.points import Point

META_BUILD_PARAMS = 1e9  # stage 3 builds models above this size on the meta device, unit by unit


def build_model(point: Point, device: torch.device, dtype: torch.dtype = torch.float32):
    """The model and stage 3's param_init_fn. Every parameter is drawn from (train.seed, its
    name), whole on every TP rank, which keeps its slice: the meta build materialized unit by
    unit starts from the same weights as the eager one (megatron_gpt's docstring). The eager
    build is in the training dtype `dtype`, so no full fp32 copy of the model ever exists; the
    engine then re-points its parameters into its buffers bucket by bucket."""
    recompute, seed, spec = point.train["recompute"], point.train["seed"], point.train["layer_spec"]
    if point.stage == 3 and parameter_count(point.shape, point.tp) > META_BUILD_PARAMS:
        with torch.device("meta"):
            model = build_gpt(point.shape, recompute=recompute, seed=seed, dtype=dtype, layer_spec=spec)
        return model, megatron_param_init_fn(model, seed)
    # built on the device, so each weight is drawn there in chunks (megatron_gpt.init_parameter),
    # not on the host (a simulation's device is the CPU: its fake tensors stand for the GPU's)
    with torch.device(device):
        return build_gpt(point.shape, recompute=recompute, seed=seed, dtype=dtype, layer_spec=spec), None


def adamw_implementation() -> dict:
    """torch AdamW's implementation for this machine: on CUDA the fused kernel (one kernel per
    param group, 28 bytes per element read and written; it takes the engine's unscale-and-clip
    divisor and skips an fp16 overflow on the device, so a step never waits on the host). On the
    CPU torch's own default, the implementation CPU simulations step with too (fake.py), so a CPU
    run and its simulation measure the same step (with foreach, the storage tracker's peak of a
    CPU run falls below its model states plus activations: tests/experiments/test_sweep.py)."""
    return {"fused": True} if torch.cuda.is_available() else {}


def wrap_in_engine(point: Point, precision: str, model: torch.nn.Module, init_fn, dp_group, tp_group,
                   gloo_point_to_point: bool | None = None, **adamw) -> zero_impl.ZeroEngine:
    """`model` in the point's engine: its ZeroConfig, and the paper's AdamW (weight decay on
    matrices only) over ZeRO's data-parallel group; `adamw` options replace
    adamw_implementation()'s choice (fake.py's simulation asks for foreach);
    `gloo_point_to_point` replaces the point's zero.gloo_point_to_point (ZeroConfig): False makes
    gloo run the calls NCCL gets."""
    t = point.train
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trainable if p.dim() >= 2], "weight_decay": t["weight_decay"]},
              {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0}]
    config = zero_impl.ZeroConfig(stage=point.stage, precision=precision, grad_accum_steps=t["grad_accum_steps"],
                                  **{"overlap_param_gather": True, **point.zero,  # every rank runs each forward
                                     **({} if gloo_point_to_point is None else {"gloo_point_to_point": gloo_point_to_point})})
    options = adamw or adamw_implementation()

    def adamw_over(g):
        return torch.optim.AdamW(g, lr=t["lr"], betas=tuple(t["adam_betas"]), eps=t["adam_eps"], **options)
    return zero_impl.initialize(model, config, optimizer=adamw_over,
                                param_groups=groups, dp_group=dp_group, mp_group=tp_group, param_init_fn=init_fn)


def micro_batch_tokens(point: Point, step: int, micro: int, dp_rank: int) -> torch.Tensor:
    """The synthetic tokens of one micro-batch of one data-parallel rank: the same on any run."""
    t = point.train
    seed = (t["seed"] * 1_000_003 + step * t["grad_accum_steps"] + micro) * 4099 + dp_rank
    return synthetic_tokens(point.micro_batch, point.shape.seq_len + 1, point.shape.vocab_size, seed)
