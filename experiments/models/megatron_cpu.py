"""megatron-core 0.16.1 on CPU: the workarounds it needs, applied only when CUDA is unavailable.

megatron-core's tensor-parallel layers and process groups work with gloo on CPU, but a few of
its helpers assume CUDA:

1. it places new tensors with `device=torch.cuda.current_device()`: on CPU that returns "cpu";
2. it keeps named CUDA generator states (an "RNG tracker") for dropout inside tensor-parallel
   regions, and saves/restores the CUDA RNG state around activation recomputation: on CPU the
   tracker holds CPU generator states, and its CUDA-state get/set read and write the CPU one;
3. its tensor-parallel linear layers advise CUDA_DEVICE_MAX_CONNECTIONS=1 for CUDA streams
   CPU ranks do not have: the advice is silenced;
4. (no patch) with no attention mask it builds its default causal mask on device "cuda": the
   model builder here always passes an explicit causal mask.

Weights are built with `use_cpu_initialization=True` (megatron allocates them on the default
device, placing none on `torch.cuda.current_device()`), and drawn by name, whole, each
tensor-parallel rank keeping its slice (megatron_gpt.init_parameter): any TP degree starts from
the same model.
"""
from __future__ import annotations

import warnings

import torch
from megatron.core.tensor_parallel import random as megatron_random

_applied = False


class CpuRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
    """megatron's RNG tracker with named CPU generator states instead of CUDA ones."""

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        outer = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)


def apply_cpu_workarounds() -> bool:
    """Patch megatron-core for CPU (idempotent); True when applied, False when CUDA is available."""
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        warnings.filterwarnings("ignore", message="When using .* it is recommended to set the environment variable "
                                                  "CUDA_DEVICE_MAX_CONNECTIONS")
        torch.cuda.current_device = lambda: "cpu"
        megatron_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
        megatron_random._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: torch.set_rng_state(state)
        megatron_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
        _applied = True
    return True
