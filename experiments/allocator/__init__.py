"""PyTorch's CUDA caching allocator, replayed over an event log: what a step would *reserve*
(segments taken from CUDA, with the free, split and stranded blocks inside them), not only
what its tensors allocate. See caching_allocator.py for the rules and their sources."""
from experiments.allocator.caching_allocator import CachingAllocator, OutOfMemory
from experiments.allocator.config import AllocatorConfig, AllocatorConfigError, parse_conf
from experiments.allocator.replay import Event, ReplayError, ReplayResult, replay

__all__ = ["AllocatorConfig", "AllocatorConfigError", "CachingAllocator", "Event", "OutOfMemory", "ReplayError",
           "ReplayResult", "parse_conf", "replay"]
