"""PYTORCH_CUDA_ALLOC_CONF as the replay reads it: the options that change where blocks go.

Parsed as torch 2.13 parses them (c10/core/AllocatorConfig.cpp AcceleratorAllocatorConfig::parseArgs
and c10/cuda/CUDAAllocatorConfig.cpp parseArgs; keys and defaults from the installed
AllocatorConfig.h and CUDAAllocatorConfig.h), with torch 2.13's defaults:

- large_segment_size_mb (20; > 10): the large pool's shared segment, formerly kLargeBuffer
  (get_allocation_size, and an expandable segment's large page). parseArgs reads it before every
  other key, wherever it stands, and it is the lower bound of max_split_size_mb and
  max_non_split_rounding_mb and the latter's default;
- max_split_size_mb (no limit; >= large_segment_size_mb), max_non_split_rounding_mb
  (large_segment_size_mb; >= it), roundup_power2_divisions (0 everywhere: a power of two, or a
  list `[256:1,512:2,>:8]` of intervals in MB), expandable_segments (False),
  garbage_collection_threshold (0; in (0, 1));
- per_process_memory_fraction (1; in [0, 1]): DeviceCachingAllocator's constructor calls
  setMemoryFraction with it, and alloc_block then refuses a segment past fraction x the device's
  memory as cudaMalloc refuses one past the device (the replay: fraction x its capacity, on a
  bounded device only). With it, malloc runs garbage_collect_cached_blocks under
  garbage_collection_threshold, which the replay does not: the two together are refused;
- backend: native only (cudaMallocAsync is another allocator, not replayed);
- keys that change no device-side caching are accepted and recorded as ignored: the host
  (pinned) allocator's, release_lock_on_cudamalloc (lock handling), graph_capture_record_stream_reuse
  (CUDA graph capture, not replayed), throw_on_cudamalloc_oom (where an out-of-memory is raised,
  not which blocks are cached).

An unknown key is an error here, as in torch 2.13's CUDA build ("Unrecognized key").
"""
from __future__ import annotations

import dataclasses

from experiments.allocator.sizes import K_LARGE_BUFFER, K_MIN_LARGE_ALLOC, SIZE_MAX

MB = 1 << 20
# AllocatorConfig.cpp: 16 intervals of one power of two each, from 1 MiB up (the last one open)
ROUNDUP_INTERVALS = 16
_ROUNDUP_START_LOG2 = 20
_IGNORED = ("release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
            "pinned_use_hip_host_register", "pinned_num_register_threads", "pinned_use_background_threads",
            "pinned_reserve_segment_size_mb", "pinned_free_catch_all", "pinned_max_round_threshold_mb",
            "pinned_max_cached_size_mb", "graph_capture_record_stream_reuse", "throw_on_cudamalloc_oom")
KEYS = ("large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions",
        "expandable_segments", "garbage_collection_threshold", "per_process_memory_fraction", "backend") + _IGNORED


class AllocatorConfigError(ValueError):
    """A PYTORCH_CUDA_ALLOC_CONF string the allocator would refuse (or a key it does not know)."""


@dataclasses.dataclass(frozen=True)
class AllocatorConfig:
    """The caching allocator's options (torch 2.13's defaults)."""

    large_segment_size: int = K_LARGE_BUFFER
    max_split_size: int = SIZE_MAX
    max_non_split_rounding_size: int = K_LARGE_BUFFER  # parse_conf: large_segment_size unless given
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    expandable_segments: bool = False
    garbage_collection_threshold: float = 0.0  # acts only under a memory fraction: recorded, not replayed
    per_process_memory_fraction: float = 1.0
    ignored: tuple[str, ...] = ()  # "key:value" options accepted that change no device-side caching

    def divisions(self, size: int) -> int:
        """AcceleratorAllocatorConfig::roundup_power2_divisions(size): this size's interval's value."""
        log_size = size.bit_length() - 1
        index = log_size - _ROUNDUP_START_LOG2 if log_size > _ROUNDUP_START_LOG2 else 0
        return self.roundup_power2_divisions[min(index, ROUNDUP_INTERVALS - 1)]

    def as_conf(self) -> str:
        """The PYTORCH_CUDA_ALLOC_CONF that sets these options ("" for the defaults; the ignored
        ones left out)."""
        parts = []
        if self.large_segment_size != K_LARGE_BUFFER:
            parts.append(f"large_segment_size_mb:{self.large_segment_size // MB}")
        if self.max_split_size != SIZE_MAX:
            parts.append(f"max_split_size_mb:{self.max_split_size // MB}")
        if self.max_non_split_rounding_size != self.large_segment_size:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_size // MB}")
        divs = self.roundup_power2_divisions
        if any(divs):
            if len(set(divs)) == 1:
                parts.append(f"roundup_power2_divisions:{divs[0]}")
            else:
                parts.append("roundup_power2_divisions:[" + ",".join(
                    f"{1 << i}:{d}" for i, d in enumerate(divs[:-1])) + f",>:{divs[-1]}]")
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold:g}")
        if self.per_process_memory_fraction != 1.0:
            parts.append(f"per_process_memory_fraction:{self.per_process_memory_fraction:g}")
        return ",".join(parts)

    def as_dict(self) -> dict:
        """For a record: every option by name (sizes in bytes, None for no limit) and the env string."""
        return {"large_segment_size": self.large_segment_size,
                "max_split_size": None if self.max_split_size == SIZE_MAX else self.max_split_size,
                "max_non_split_rounding_size": self.max_non_split_rounding_size,
                "roundup_power2_divisions": list(self.roundup_power2_divisions),
                "expandable_segments": self.expandable_segments,
                "garbage_collection_threshold": self.garbage_collection_threshold,
                "per_process_memory_fraction": self.per_process_memory_fraction,
                "ignored": list(self.ignored), "PYTORCH_CUDA_ALLOC_CONF": self.as_conf()}


def _split_options(text: str) -> list[tuple[str, str]]:
    """'a:1,b:[x:1,>:2]' -> [("a", "1"), ("b", "[x:1,>:2]")] (commas inside brackets kept)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            item = text[start:i].strip()
            start = i + 1
            if not item:
                continue
            key, sep, value = item.partition(":")
            if not sep or not value.strip():
                raise AllocatorConfigError(f"allocator option {item!r}: expected key:value")
            items.append((key.strip(), value.strip()))
    if depth:
        raise AllocatorConfigError(f"allocator options {text!r}: unbalanced brackets")
    return items


def _size_mb(key: str, value: str, least_mb: int) -> int:
    """A size in MB of at least `least_mb`, in bytes (capped at SIZE_MAX's whole MB, as torch caps it)."""
    try:
        mb = int(value)
    except ValueError:
        raise AllocatorConfigError(f"allocator option {key}: expected an integer number of MB, got {value!r}") from None
    if mb < least_mb:
        raise AllocatorConfigError(f"allocator option {key}: too small, must be >= {least_mb}, got {mb}")
    return min(mb * MB, SIZE_MAX // MB * MB)


def _power_of_two_or_zero(key: str, value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise AllocatorConfigError(f"allocator option {key}: expected an integer, got {value!r}") from None
    if n < 0 or n & (n - 1):
        raise AllocatorConfigError(f"allocator option {key}: the divisions have to be a power of 2 or 0, got {n}")
    return n


def _roundup(value: str) -> tuple[int, ...]:
    """parseRoundUpPower2Divisions: one value for every size, or [MB:divisions,...,>:divisions]."""
    key = "roundup_power2_divisions"
    if not value.startswith("["):
        n = _power_of_two_or_zero(key, value)
        if n == 0:
            raise AllocatorConfigError(f"allocator option {key}: a single value must be a power of 2, got 0")
        return (n,) * ROUNDUP_INTERVALS
    if not value.endswith("]"):
        raise AllocatorConfigError(f"allocator option {key}: expected [interval:divisions,...], got {value!r}")
    divs, first, last = [0] * ROUNDUP_INTERVALS, True, 0
    for entry in filter(None, (e.strip() for e in value[1:-1].split(","))):
        boundary, sep, n_text = entry.partition(":")
        if not sep:
            raise AllocatorConfigError(f"allocator option {key}: entry {entry!r}: expected MB:divisions or >:divisions")
        n = _power_of_two_or_zero(key, n_text)
        if boundary.strip() == ">":
            divs[last + 1:] = [n] * (ROUNDUP_INTERVALS - last - 1)
            continue
        try:
            mb = int(boundary)
        except ValueError:
            raise AllocatorConfigError(f"allocator option {key}: interval {boundary!r} is not a number of MB") from None
        if mb <= 0 or mb & (mb - 1):
            raise AllocatorConfigError(f"allocator option {key}: the intervals have to be powers of 2, got {mb}")
        index = min(mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if first:
            divs[:index] = [n] * index
            first = False
        divs[index], last = n, index
    return tuple(divs)


def _bool(key: str, value: str) -> bool:
    if value not in ("True", "False", "true", "false"):
        raise AllocatorConfigError(f"allocator option {key}: expected True or False, got {value!r}")
    return value.lower() == "true"


def _number(key: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise AllocatorConfigError(f"allocator option {key}: expected a number, got {value!r}") from None


def parse_conf(text: str | None) -> AllocatorConfig:
    """An AllocatorConfig from a PYTORCH_CUDA_ALLOC_CONF string ("" or None: the defaults)."""
    items = _split_options(text or "")
    # parseArgs reads large_segment_size_mb before the rest, wherever it stands (parseLargeSegmentSize:
    # "must be > 10 MB", kMinLargeAlloc): it bounds the other sizes and is max_non_split_rounding's default
    large = K_LARGE_BUFFER
    for key, value in items:
        if key == "large_segment_size_mb":
            large = _size_mb(key, value, K_MIN_LARGE_ALLOC // MB + 1)
    options: dict = {"large_segment_size": large, "max_non_split_rounding_size": large}
    ignored = []
    for key, value in items:
        if key == "large_segment_size_mb":
            continue
        if key == "max_split_size_mb":
            options["max_split_size"] = _size_mb(key, value, large // MB)
        elif key == "max_non_split_rounding_mb":
            options["max_non_split_rounding_size"] = _size_mb(key, value, large // MB)
        elif key == "roundup_power2_divisions":
            options["roundup_power2_divisions"] = _roundup(value)
        elif key == "expandable_segments":
            options["expandable_segments"] = _bool(key, value)
        elif key == "garbage_collection_threshold":
            threshold = _number(key, value)
            if not 0.0 < threshold < 1.0:
                raise AllocatorConfigError(f"allocator option {key}: must be in (0.0, 1.0), got {value!r}")
            options["garbage_collection_threshold"] = threshold
        elif key == "per_process_memory_fraction":
            fraction = _number(key, value)
            if not 0.0 <= fraction <= 1.0:  # setMemoryFraction: "Please set within [0, 1]"
                raise AllocatorConfigError(f"allocator option {key}: must be in [0.0, 1.0], got {value!r}")
            options["per_process_memory_fraction"] = fraction
        elif key == "backend":
            if value != "native":
                raise AllocatorConfigError(f"allocator option backend:{value}: only the native caching allocator is "
                                           "replayed (cudaMallocAsync leaves caching to the driver)")
        elif key in _IGNORED:
            ignored.append(f"{key}:{value}")
        else:
            raise AllocatorConfigError(f"unknown allocator option {key!r}: allowed are {', '.join(KEYS)}")
    if options.get("garbage_collection_threshold") and options.get("per_process_memory_fraction", 1.0) < 1.0:
        # malloc runs garbage_collect_cached_blocks only when a fraction is set; the replay has no such pass
        raise AllocatorConfigError("allocator options garbage_collection_threshold and per_process_memory_fraction < 1 "
                                   "together: garbage_collect_cached_blocks, which they turn on, is not replayed")
    return AllocatorConfig(**options, ignored=tuple(ignored))
