"""zero_impl: a compact ZeRO (stages 0-3) for PyTorch, from Rajbhandari et al., SC20.

    import zero_impl
    engine = zero_impl.initialize(model, zero_impl.ZeroConfig(stage=2, precision="bf16"),
                                  optimizer=lambda groups: torch.optim.AdamW(groups, lr=3e-4))
"""
from . import loss_scaler
from .config import ZeroConfig
from .engine import ZeroEngine, initialize

__all__ = ["ZeroConfig", "ZeroEngine", "initialize", "checkpoint"]


def __getattr__(name: str):
    """`zero_impl.checkpoint` on first use (imported late so `python -m zero_impl.checkpoint` runs cleanly)."""
    if name == "checkpoint":
        import importlib
        return importlib.import_module(".checkpoint", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
