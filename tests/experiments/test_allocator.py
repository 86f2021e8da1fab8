"""experiments/allocator: the caching allocator's replay against sequences worked by hand from
c10/cuda/CUDACachingAllocator.cpp (each derivation in its test's docstring, with the functions
it reads), its invariants over every event, its options (torch 2.13's keys: those that move
blocks replayed, the rest recorded as ignored), and the replay CLI reproducing every hand-worked
sequence from a snapshot (pickle and JSON; bad input exits 2 with one line)."""
from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys

import pytest

from experiments.allocator import AllocatorConfigError, Event, ReplayError, parse_conf, replay
from experiments.allocator.sizes import get_allocation_size, round_size, roundup_power2_next_division
from experiments.records import REPO

KiB, MiB = 1 << 10, 1 << 20


def allocs(sizes, first_key=0, stream=0):
    return [Event("alloc", first_key + i, n, stream) for i, n in enumerate(sizes)]


def frees(keys):
    return [Event("free", k) for k in keys]


@dataclasses.dataclass(frozen=True)
class HandWorked:
    """A sequence worked by hand from the allocator's source (the derivation is in the docstring of
    the test that replays it directly), and what the replay must report for it: ReplayResult.as_dict
    fields, the same the CLI prints."""

    log: list
    expected: dict
    conf: str = ""
    capacity: int | None = None

    def replay(self, **changes):
        case = dataclasses.replace(self, **changes)
        return replay(case.log, parse_conf(case.conf), case.capacity)

    def check(self, printed: dict) -> None:
        assert {k: printed[k] for k in self.expected} == self.expected


# The six hand-worked sequences: each replayed directly below and through the CLI
# (test_cli_reproduces_the_hand_worked_sequences), from these definitions only.
HAND_WORKED = {
    "eight_16mib_freed_then_four_32mib": HandWorked(
        allocs([16 * MiB] * 8) + frees(range(8)) + allocs([32 * MiB] * 4, first_key=100),
        {"reserved_peak_bytes": 256 * MiB, "segments_peak": 12, "allocated_peak_bytes": 128 * MiB,
         "fragmentation": 0.5}),
    "reverse_order": HandWorked(
        allocs([32 * MiB] * 4) + frees(range(4)) + allocs([16 * MiB] * 8, first_key=100),
        {"reserved_peak_bytes": 128 * MiB, "segments_peak": 4, "allocated_peak_bytes": 128 * MiB,
         "fragmentation": 0.0}),
    "a_thousand_4kib": HandWorked(
        allocs([4 * KiB] * 1000),
        {"reserved_peak_bytes": 4 * MiB, "segments_peak": 2, "allocated_peak_bytes": 4_096_000}),
    "two_5mib_and_a_12mib": HandWorked(
        allocs([5 * MiB, 5 * MiB, 12 * MiB]),
        {"reserved_peak_bytes": 32 * MiB, "segments_peak": 2, "allocated_peak_bytes": 22 * MiB}),
    "capacity_too_small_retries_once": HandWorked(
        allocs([32 * MiB]) + frees([0]) + allocs([48 * MiB], first_key=1),
        {"alloc_retries": 1, "oom": False, "reserved_peak_bytes": 48 * MiB, "reserved_end_bytes": 48 * MiB},
        capacity=64 * MiB),
    "expandable_segments_map_pages": HandWorked(
        allocs([5 * MiB, 5 * MiB, 12 * MiB]), {"reserved_peak_bytes": 40 * MiB, "segments_peak": 1},
        conf="expandable_segments:True"),
}


def test_eight_16mib_freed_then_four_32mib_reserve_256mib():
    """16 MiB >= kMinLargeAlloc (10 MiB): get_allocation_size rounds it to 2 MiB, so each of the
    eight gets its own 16 MiB segment (128 MiB). Freed, they stay cached, unsplit and unmerged
    (try_merge_blocks only joins blocks of one segment). A 32 MiB request: get_free_block's
    lower_bound finds no cached block >= 32 MiB, so alloc_block cudaMallocs a 32 MiB segment, four
    times: 128 + 128 = 256 MiB reserved, 12 segments, the allocated peak 128 MiB."""
    case = HAND_WORKED["eight_16mib_freed_then_four_32mib"]
    case.check(case.replay().as_dict())


def test_reverse_order_reserves_128mib():
    """Four 32 MiB segments (128 MiB), freed. Each 16 MiB request: get_free_block returns a
    cached 32 MiB block (best fit); should_split: the 16 MiB remainder > kSmallSize (1 MiB) and
    16 MiB < max_split_size (no limit), so it splits and the remainder serves the next request:
    eight 16 MiB blocks in the four segments, 128 MiB reserved, nothing new."""
    case = HAND_WORKED["reverse_order"]
    case.check(case.replay().as_dict())


def test_a_thousand_4kib_blocks_fill_two_small_segments():
    """4 KiB <= kSmallSize: the small pool, whose segments are kSmallBuffer = 2 MiB
    (get_allocation_size). should_split in the small pool splits any remainder >= kMinBlockSize
    (512 B), so a segment holds 2 MiB / 4 KiB = 512 blocks: 1000 blocks need two segments, 4 MiB."""
    case = HAND_WORKED["a_thousand_4kib"]
    case.check(case.replay().as_dict())


def test_two_5mib_share_a_20mib_segment_and_12mib_gets_its_own():
    """5 MiB is in (1 MiB, 10 MiB): get_allocation_size gives large_segment_size (kLargeBuffer),
    20 MiB; should_split: the 15 MiB remainder > 1 MiB, so the second 5 MiB is cut from it (10 MiB
    left). 12 MiB: get_free_block's best fit is the 10 MiB remainder, too small; 12 MiB >= 10 MiB
    rounds to 2 MiB: a 12 MiB segment. Reserved 20 + 12 = 32 MiB in two segments."""
    case = HAND_WORKED["two_5mib_and_a_12mib"]
    case.check(case.replay().as_dict())


def test_capacity_too_small_releases_cached_segments_and_retries_once():
    """Capacity 64 MiB. 32 MiB allocated and freed: a cached 32 MiB segment. 48 MiB: no cached
    block fits (get_free_block); alloc_block's cudaMalloc fails (32 + 48 > 64);
    release_available_cached_blocks does nothing without max_split_size_mb; release_cached_blocks
    cudaFrees the unsplit 32 MiB segment and alloc_block(isRetry=true) succeeds: one retry
    (num_alloc_retries), reserved peak 48 MiB, no OOM. With 40 MiB of capacity the retry fails too:
    out of memory, the replay stops there."""
    case = HAND_WORKED["capacity_too_small_retries_once"]
    case.check(case.replay().as_dict())
    r = case.replay(capacity=40 * MiB)
    assert (r.alloc_retries, r.oom, r.oom_event, r.oom_request_bytes) == (1, True, 3, 48 * MiB)
    assert case.replay(capacity=None).alloc_retries == 0  # unbounded: the cached segment stays


def test_expandable_segments_map_pages_instead_of_new_segments():
    """expandable_segments:True: alloc_block maps pages (large_segment_size = 20 MiB in the large
    pool) into one segment per stream (find_expandable_block) instead of cudaMalloc. 5 MiB maps one
    page (20 MiB) and splits (should_split with expandable segments: remainder >= 512 B); the
    second 5 MiB comes from the 15 MiB remainder; 12 MiB: the free 10 MiB block is followed by
    unmapped space, so try_allocate_expandable_block maps one more page after it and the blocks
    merge (map_block -> try_merge_blocks): 40 MiB reserved, one segment (one mapped range). The
    sixteen 16 MiB blocks that cost 16 segments without it are 13 pages (260 MiB) in one."""
    case = HAND_WORKED["expandable_segments_map_pages"]
    case.check(case.replay().as_dict())
    r = case.replay(log=allocs([16 * MiB] * 16))
    assert (r.reserved_peak_bytes, r.segments_peak) == (13 * 20 * MiB, 1)
    assert case.replay(log=allocs([16 * MiB] * 16), conf="").segments_peak == 16


def test_expandable_segments_unmap_free_pages_on_oom():
    """Capacity 80 MiB, expandable: 60 MiB (3 pages) allocated and freed stays mapped; 70 MiB:
    no cached block is that large, so find_expandable_block takes the free 60 MiB block just
    before the unmapped range and map_block adds one page after it: 80 MiB, 10 MiB split off. A second 40 MiB needs 2 pages more: mapping fails,
    release_cached_blocks unmaps the free pages wholly inside free blocks (unmap_block: the
    10 MiB tail of the last page is not a whole page, so nothing), the retry fails: OOM."""
    conf = parse_conf("expandable_segments:True")
    r = replay(allocs([60 * MiB]) + frees([0]) + allocs([70 * MiB, 40 * MiB], first_key=1), conf, capacity=80 * MiB)
    assert (r.reserved_peak_bytes, r.segments_peak, r.oom, r.alloc_retries) == (80 * MiB, 1, True, 1)


def test_stream_pools_are_separate():
    """Blocks are per stream (BlockComparatorSize orders by stream first; get_free_block stops
    at another stream): a 16 MiB block freed on stream 1 does not serve stream 2."""
    r = replay(allocs([16 * MiB], stream=1) + frees([0]) + allocs([16 * MiB], first_key=1, stream=2))
    assert (r.reserved_peak_bytes, r.segments_peak) == (32 * MiB, 2)
    r = replay(allocs([16 * MiB], stream=1) + frees([0]) + allocs([16 * MiB], first_key=1, stream=1))
    assert r.reserved_peak_bytes == 16 * MiB


def test_max_split_size_makes_oversize_blocks_unsplittable():
    """max_split_size_mb:64. A freed 128 MiB block is oversize: get_free_block refuses it to a
    32 MiB request (request < max_split_size, block >= it): a new 32 MiB segment. An oversize
    request takes a cached oversize block only within max_non_split_rounding (20 MiB): 120 MiB
    takes the 128 MiB block whole (unsplit: should_split requires request < max_split_size),
    so 128 MiB is allocated for it; 100 MiB would not (128 >= 100 + 20): a new segment."""
    conf = parse_conf("max_split_size_mb:64")
    base = allocs([128 * MiB]) + frees([0])
    r = replay(base + allocs([32 * MiB], first_key=1), conf)
    assert (r.reserved_peak_bytes, r.segments_peak) == (160 * MiB, 2)
    r = replay(base + allocs([120 * MiB], first_key=1), conf)
    assert (r.reserved_peak_bytes, r.allocated_peak_bytes, r.segments_peak) == (128 * MiB, 128 * MiB, 1)
    r = replay(base + allocs([100 * MiB], first_key=1), conf)
    assert r.reserved_peak_bytes == 228 * MiB
    # and on OOM it frees just enough oversize blocks (release_available_cached_blocks), no retry counted
    r = replay(base + allocs([100 * MiB], first_key=1), conf, capacity=200 * MiB)
    assert (r.oom, r.alloc_retries, r.reserved_peak_bytes, r.reserved_end_bytes) == (False, 0, 128 * MiB, 100 * MiB)


def test_rounding_rules():
    """round_size: < 512 -> 512; else a multiple of 512, or with roundup_power2_divisions the
    next of N steps between powers of two (roundup_power2_next_division's own example: 1200
    with 4 divisions is 1280). get_allocation_size: 2 MiB, 20 MiB, or up to 2 MiB."""
    assert [round_size(n) for n in (1, 512, 513, 4096)] == [512, 512, 1024, 4096]
    assert roundup_power2_next_division(1200, 4) == 1280
    conf = parse_conf("roundup_power2_divisions:4")
    # ...but only above kMinBlockSize * divisions (2 KiB): 1200 stays a multiple of 512
    assert (round_size(1200, conf.divisions(1200)), round_size(9000, conf.divisions(9000))) == (1536, 10240)
    assert round_size(600 * MiB, conf.divisions(600 * MiB)) == 640 * MiB
    assert [get_allocation_size(n) for n in (512, MiB, MiB + 512, 10 * MiB - 512, 10 * MiB, 11 * MiB)] == \
        [2 * MiB, 2 * MiB, 20 * MiB, 20 * MiB, 10 * MiB, 12 * MiB]
    # intervals: [256:1,512:2,>:8] -> 2 divisions for sizes in [512 MiB, 1 GiB), 8 above
    conf = parse_conf("roundup_power2_divisions:[256:1,512:2,>:8]")
    assert (conf.divisions(300 * MiB), conf.divisions(600 * MiB), conf.divisions(3 << 30)) == (1, 2, 8)


def test_conf_errors_name_the_key():
    for bad, words in [("max_split_size_mb:10", "max_split_size_mb"), ("foo:1", "unknown allocator option 'foo'"),
                       ("expandable_segments:yes", "expandable_segments"), ("roundup_power2_divisions:3", "power of 2"),
                       ("garbage_collection_threshold:2", "garbage_collection_threshold"), ("max_split_size_mb", "key:value"),
                       ("large_segment_size_mb:10", "large_segment_size_mb: too small, must be >= 11"),
                       ("per_process_memory_fraction:1.5", "per_process_memory_fraction: must be in \\[0.0, 1.0\\]"),
                       ("backend:cudaMallocAsync", "backend:cudaMallocAsync"),
                       ("per_process_memory_fraction:0.5,garbage_collection_threshold:0.6",
                        "garbage_collect_cached_blocks")]:
        with pytest.raises(AllocatorConfigError, match=words):
            parse_conf(bad)
    assert parse_conf("expandable_segments:True,max_split_size_mb:512").as_conf() == \
        "max_split_size_mb:512,expandable_segments:True"


# torch 2.13's keys: AcceleratorAllocatorConfig::getMutableKeys (c10/core/AllocatorConfig.cpp; in
# libc10.so's strings) and CUDAAllocatorConfig::getKeys (c10/cuda/CUDAAllocatorConfig.h)
TORCH_2_13_KEYS = {
    "large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
    "roundup_power2_divisions", "expandable_segments", "pinned_use_background_threads",
    "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
    "backend", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "release_lock_on_hipmalloc",
    "pinned_use_hip_host_register", "graph_capture_record_stream_reuse", "pinned_reserve_segment_size_mb",
    "pinned_num_register_threads", "per_process_memory_fraction", "pinned_free_catch_all", "throw_on_cudamalloc_oom"}


def test_every_torch_2_13_key_is_accepted_and_the_host_side_ones_recorded_as_ignored():
    from experiments.allocator.config import KEYS
    assert set(KEYS) == TORCH_2_13_KEYS
    ignored = ("pinned_reserve_segment_size_mb:64,pinned_free_catch_all:True,pinned_max_round_threshold_mb:8,"
               "pinned_max_cached_size_mb:256,graph_capture_record_stream_reuse:True,throw_on_cudamalloc_oom:True,"
               "release_lock_on_cudamalloc:True,pinned_use_background_threads:True")
    conf = parse_conf(ignored + ",backend:native")
    assert dataclasses.replace(conf, ignored=()) == parse_conf("")  # nothing the replay does changes
    assert conf.as_dict()["ignored"] == ignored.split(",") and conf.as_conf() == ""


def test_large_segment_size_is_the_shared_large_segment_and_bounds_the_other_sizes():
    """large_segment_size_mb:40 (AcceleratorAllocatorConfig::large_segment_size, kLargeBuffer before
    it): get_allocation_size gives a 5 MiB request a 40 MiB segment; the second 5 MiB splits from
    its 35 MiB remainder, and 12 MiB now fits the 30 MiB left (best fit, split: 18 MiB > 1 MiB):
    one segment of 40 MiB where 20 MiB segments took two (32 MiB). Expandable segments' large pages
    are 40 MiB: sixteen 16 MiB blocks (256 MiB) map 7 of them, 280 MiB. parseArgs reads it before
    the other keys wherever it stands: max_split_size_mb and max_non_split_rounding_mb must be at
    least it, and the latter defaults to it."""
    r = replay(HAND_WORKED["two_5mib_and_a_12mib"].log, parse_conf("large_segment_size_mb:40"))
    assert (r.reserved_peak_bytes, r.segments_peak, r.allocated_peak_bytes) == (40 * MiB, 1, 22 * MiB)
    r = replay(allocs([16 * MiB] * 16), parse_conf("large_segment_size_mb:40,expandable_segments:True"))
    assert (r.reserved_peak_bytes, r.segments_peak) == (7 * 40 * MiB, 1)
    conf = parse_conf("large_segment_size_mb:64")
    assert (conf.max_non_split_rounding_size, conf.as_conf()) == (64 * MiB, "large_segment_size_mb:64")
    for text in ("large_segment_size_mb:64,max_split_size_mb:32", "max_split_size_mb:32,large_segment_size_mb:64",
                 "max_non_split_rounding_mb:63,large_segment_size_mb:64"):
        with pytest.raises(AllocatorConfigError, match="must be >= 64"):
            parse_conf(text)
    assert parse_conf("max_split_size_mb:20").max_split_size == 20 * MiB  # >= 20 by default (parseMaxSplitSize)
    with pytest.raises(AllocatorConfigError, match="must be >= 20"):
        parse_conf("max_split_size_mb:19")


def test_per_process_memory_fraction_caps_what_alloc_block_takes():
    """per_process_memory_fraction:0.5 on 100 MiB: setMemoryFraction allows 50 MiB. 32 MiB
    allocated and freed stays cached; 40 MiB: no cached block fits, alloc_block refuses (32 + 40 >
    50, though the device has room), release_cached_blocks frees the 32 MiB segment and the retry
    takes 40 MiB: one retry, reserved peak 40 MiB. Without the fraction both segments fit (72 MiB,
    no retry); on an unbounded device there is nothing to take a fraction of."""
    log = allocs([32 * MiB]) + frees([0]) + allocs([40 * MiB], first_key=1)
    conf = parse_conf("per_process_memory_fraction:0.5")
    r = replay(log, conf, capacity=100 * MiB)
    assert (r.alloc_retries, r.oom, r.reserved_peak_bytes) == (1, False, 40 * MiB)
    assert r.config["PYTORCH_CUDA_ALLOC_CONF"] == "per_process_memory_fraction:0.5"  # recorded
    for unlimited in (replay(log, capacity=100 * MiB), replay(log, conf)):
        assert (unlimited.alloc_retries, unlimited.reserved_peak_bytes) == (0, 72 * MiB)
    r = replay(allocs([32 * MiB, 40 * MiB]), conf, capacity=100 * MiB)  # nothing cached to free: out of memory
    assert (r.oom, r.alloc_retries, r.reserved_peak_bytes) == (True, 1, 32 * MiB)


def test_invariants_over_a_mixed_log():
    """reserved >= allocated >= rounded requests after every event, on a log mixing pools,
    streams, splits and frees; the rounded peak equals a per-storage 512-byte ledger's peak."""
    import random
    rng = random.Random(0)
    log, live, ledger, ledger_peak, key = [], [], 0, 0, 0
    for _ in range(3000):
        if live and rng.random() < 0.45:
            k, n = live.pop(rng.randrange(len(live)))
            log.append(Event("free", k))
            ledger -= -(-n // 512) * 512
        else:
            n = rng.choice([100, 4096, 700 * KiB, 3 * MiB, 12 * MiB + 7, 40 * MiB])
            log.append(Event("alloc", key, n, rng.choice([0, 0, 0, 1])))
            live.append((key, n))
            key += 1
            ledger += -(-n // 512) * 512
            ledger_peak = max(ledger_peak, ledger)

    def check(a):
        s = a.stats
        assert s.reserved_bytes.current >= s.allocated_bytes.current >= s.rounded_bytes.current >= s.requested_bytes.current

    for conf in ("", "expandable_segments:True", "max_split_size_mb:32"):
        r = replay(log, parse_conf(conf), on_event=check)
        assert r.rounded_peak_bytes == ledger_peak, conf
        assert r.reserved_peak_bytes >= r.allocated_peak_bytes >= ledger_peak


def test_replay_rejects_a_free_of_nothing():
    with pytest.raises(ReplayError, match="not live"):
        replay([Event("free", 3)])


# -- the CLI on hand-built snapshots ---------------------------------------------------------------
def snapshot_dict(entries, conf=""):
    return {"segments": [], "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": conf}, "device_traces": [entries]}


def trace_entries(log, with_segments=False):
    """A log as a GPU's trace records it: alloc, then free_requested and free_completed, each at
    its allocation's address; `with_segments`: each allocation preceded by the segment_alloc of
    its own segment (true of the first sequence, where every allocation cudaMallocs)."""
    entries, sizes = [], {}
    for e in log:
        addr = 0x7F0000000000 + e.key * 64 * MiB
        if e.action == "alloc":
            sizes[e.key] = e.nbytes
            if with_segments:
                entries.append({"action": "segment_alloc", "addr": addr, "size": e.nbytes, "stream": e.stream})
            entries.append({"action": "alloc", "addr": addr, "size": e.nbytes, "stream": e.stream})
        else:
            entries += [{"action": a, "addr": addr, "size": sizes[e.key], "stream": e.stream}
                        for a in ("free_requested", "free_completed")]
    return entries


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "experiments.allocator", "replay", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", HAND_WORKED)
def test_cli_reproduces_the_hand_worked_sequences(name, tmp_path):
    """Each hand-worked sequence as a _dump_snapshot() pickle, under its options as the snapshot
    records them (allocator_settings: the CLI's default --conf), on its capacity: the CLI prints
    what the direct replay must."""
    case = HAND_WORKED[name]
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(snapshot_dict(trace_entries(case.log), case.conf)))
    p = run_cli(str(path), *(("--capacity-bytes", str(case.capacity)) if case.capacity else ()))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    case.check(out)
    assert out["allocator"]["PYTORCH_CUDA_ALLOC_CONF"] == case.conf


def test_cli_replays_a_pickle_and_json(tmp_path):
    """The first sequence as a GPU records it (segment_alloc entries too), as pickle and as JSON:
    the replay beside the trace's own reserved peak and segments; --conf overrides the snapshot's."""
    case = HAND_WORKED["eight_16mib_freed_then_four_32mib"]
    snap = snapshot_dict(trace_entries(case.log, with_segments=True))
    (tmp_path / "s.pickle").write_bytes(pickle.dumps(snap))
    (tmp_path / "s.json").write_text(json.dumps(snap))
    for name in ("s.pickle", "s.json"):
        p = run_cli(str(tmp_path / name))
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout)
        case.check(out)
        assert (out["alloc_retries"], out["oom"]) == (0, False)
        assert out["trace"] == {"reserved_peak_bytes": 256 * MiB, "segments_peak": 12, "ooms": 0}
    p = run_cli(str(tmp_path / "s.pickle"), "--conf", "expandable_segments:True", "--capacity-bytes", str(200 * MiB))
    out = json.loads(p.stdout)
    # expandable: 8 x 16 MiB in 7 pages (140 MiB), freed, stay mapped; 4 x 32 MiB reuse them and map 0 more
    assert (out["reserved_peak_bytes"], out["segments_peak"], out["oom"]) == (140 * MiB, 1, False)


def test_cli_bad_input_exits_2_with_one_line(tmp_path):
    (tmp_path / "junk").write_text("not a snapshot")
    (tmp_path / "nodev.json").write_text(json.dumps({"segments": []}))
    (tmp_path / "orphan.json").write_text(json.dumps(snapshot_dict(
        [{"action": "free_completed", "addr": 16, "size": 512, "stream": 0}])))
    (tmp_path / "ok.json").write_text(json.dumps(snapshot_dict([])))
    for args, words in [((str(tmp_path / "missing.pickle"),), "cannot read"), ((str(tmp_path / "junk"),), "neither"),
                        ((str(tmp_path / "nodev.json"),), "device_traces"), ((str(tmp_path / "orphan.json"),), "never allocated"),
                        ((str(tmp_path / "ok.json"), "--conf", "bogus:1"), "unknown allocator option"),
                        ((str(tmp_path / "ok.json"), "--device", "3"), "device 3")]:
        p = run_cli(*args)
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1 and words in p.stderr, p.stderr
