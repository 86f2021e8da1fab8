"""zero_impl: a compact ZeRO (stages 0-3) for PyTorch, from Rajbhandari et al., SC20.

    import zero_impl
    engine = zero_impl.initialize(model, zero_impl.ZeroConfig(stage=2, precision="bf16"),
                                  optimizer=lambda groups: torch.optim.AdamW(groups, lr=3e-4))

The names below are the library's surface: the engine, its config and checkpoints, the kinds
of the tensors it holds (ZeroEngine.state_tensors), the configuration tables (dtypes, stages,
Table 3's ZeRO-R configurations), the staging buffers in flight that its memory follows, and
DeepSpeed's JSON config read as a ZeroConfig (parse_deepspeed, ZeroConfig.from_deepspeed).
"""
from . import checkpoint
from .config import DTYPES, STAGES, ZERO_R_CONFIGS, ZERO_R_SWITCHES, ZeroConfig, parse_deepspeed, zero_r_config
from .deepspeed import DeepSpeedConfig, DeepSpeedConfigError
from .engine import STATE_KINDS, ZeroEngine, initialize
from .grad_reducer import MAX_INFLIGHT_STAGING

__all__ = ["ZeroConfig", "ZeroEngine", "initialize", "checkpoint", "STATE_KINDS", "DTYPES", "STAGES",
           "ZERO_R_CONFIGS", "ZERO_R_SWITCHES", "zero_r_config", "MAX_INFLIGHT_STAGING", "parse_deepspeed",
           "DeepSpeedConfig", "DeepSpeedConfigError"]
