"""experiments/allocator: the caching allocator's replay against sequences worked by hand from
c10/cuda/CUDACachingAllocator.cpp (each derivation in its test's docstring, with the functions
it reads), its invariants over every event, its options, and the replay CLI on hand-built
snapshot dicts (pickle and JSON; bad input exits 2 with one line)."""
from __future__ import annotations

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


def test_eight_16mib_freed_then_four_32mib_reserve_256mib():
    """16 MiB >= kMinLargeAlloc (10 MiB): get_allocation_size rounds it to 2 MiB, so each of the
    eight gets its own 16 MiB segment (128 MiB). Freed, they stay cached, unsplit and unmerged
    (try_merge_blocks only joins blocks of one segment). A 32 MiB request: get_free_block's
    lower_bound finds no cached block >= 32 MiB, so alloc_block cudaMallocs a 32 MiB segment, four
    times: 128 + 128 = 256 MiB reserved, 12 segments, the allocated peak 128 MiB."""
    r = replay(allocs([16 * MiB] * 8) + frees(range(8)) + allocs([32 * MiB] * 4, first_key=100))
    assert (r.reserved_peak_bytes, r.segments_peak, r.allocated_peak_bytes) == (256 * MiB, 12, 128 * MiB)
    assert r.fragmentation == pytest.approx(0.5)


def test_reverse_order_reserves_128mib():
    """Four 32 MiB segments (128 MiB), freed. Each 16 MiB request: get_free_block returns a
    cached 32 MiB block (best fit); should_split: the 16 MiB remainder > kSmallSize (1 MiB) and
    16 MiB < max_split_size (no limit), so it splits and the remainder serves the next request:
    eight 16 MiB blocks in the four segments, 128 MiB reserved, nothing new."""
    r = replay(allocs([32 * MiB] * 4) + frees(range(4)) + allocs([16 * MiB] * 8, first_key=100))
    assert (r.reserved_peak_bytes, r.segments_peak, r.allocated_peak_bytes) == (128 * MiB, 4, 128 * MiB)
    assert r.fragmentation == 0.0


def test_a_thousand_4kib_blocks_fill_two_small_segments():
    """4 KiB <= kSmallSize: the small pool, whose segments are kSmallBuffer = 2 MiB
    (get_allocation_size). should_split in the small pool splits any remainder >= kMinBlockSize
    (512 B), so a segment holds 2 MiB / 4 KiB = 512 blocks: 1000 blocks need two segments, 4 MiB."""
    r = replay(allocs([4 * KiB] * 1000))
    assert (r.reserved_peak_bytes, r.segments_peak, r.allocated_peak_bytes) == (4 * MiB, 2, 4_096_000)


def test_two_5mib_share_a_20mib_segment_and_12mib_gets_its_own():
    """5 MiB is in (1 MiB, 10 MiB): get_allocation_size gives kLargeBuffer, 20 MiB; should_split:
    the 15 MiB remainder > 1 MiB, so the second 5 MiB is cut from it (10 MiB left). 12 MiB:
    get_free_block's best fit is the 10 MiB remainder, too small; 12 MiB >= 10 MiB rounds to
    2 MiB: a 12 MiB segment. Reserved 20 + 12 = 32 MiB in two segments."""
    r = replay(allocs([5 * MiB, 5 * MiB, 12 * MiB]))
    assert (r.reserved_peak_bytes, r.segments_peak, r.allocated_peak_bytes) == (32 * MiB, 2, 22 * MiB)


def test_capacity_too_small_releases_cached_segments_and_retries_once():
    """Capacity 64 MiB. 32 MiB allocated and freed: a cached 32 MiB segment. 48 MiB: no cached
    block fits (get_free_block); alloc_block's cudaMalloc fails (32 + 48 > 64);
    release_available_cached_blocks does nothing without max_split_size_mb; release_cached_blocks
    cudaFrees the unsplit 32 MiB segment and alloc_block(isRetry=true) succeeds: one retry
    (num_alloc_retries), reserved peak 48 MiB, no OOM. With 40 MiB of capacity the retry fails too:
    out of memory, the replay stops there."""
    log = allocs([32 * MiB]) + frees([0]) + allocs([48 * MiB], first_key=1)
    r = replay(log, capacity=64 * MiB)
    assert (r.alloc_retries, r.oom, r.reserved_peak_bytes, r.reserved_end_bytes) == (1, False, 48 * MiB, 48 * MiB)
    r = replay(log, capacity=40 * MiB)
    assert (r.alloc_retries, r.oom, r.oom_event, r.oom_request_bytes) == (1, True, 3, 48 * MiB)
    assert replay(log).alloc_retries == 0  # unbounded: the cached segment stays


def test_expandable_segments_map_pages_instead_of_new_segments():
    """expandable_segments:True: alloc_block maps pages (kLargeBuffer = 20 MiB in the large pool)
    into one segment per stream (find_expandable_block) instead of cudaMalloc. 5 MiB maps one
    page (20 MiB) and splits (should_split with expandable segments: remainder >= 512 B); the
    second 5 MiB comes from the 15 MiB remainder; 12 MiB: the free 10 MiB block is followed by
    unmapped space, so try_allocate_expandable_block maps one more page after it and the blocks
    merge (map_block -> try_merge_blocks): 40 MiB reserved, one segment (one mapped range). The
    sixteen 16 MiB blocks that cost 16 segments without it are 13 pages (260 MiB) in one."""
    conf = parse_conf("expandable_segments:True")
    r = replay(allocs([5 * MiB, 5 * MiB, 12 * MiB]), conf)
    assert (r.reserved_peak_bytes, r.segments_peak) == (40 * MiB, 1)
    r = replay(allocs([16 * MiB] * 16), conf)
    assert (r.reserved_peak_bytes, r.segments_peak) == (13 * 20 * MiB, 1)
    assert replay(allocs([16 * MiB] * 16)).segments_peak == 16


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
                       ("garbage_collection_threshold:2", "garbage_collection_threshold"), ("max_split_size_mb", "key:value")]:
        with pytest.raises(AllocatorConfigError, match=words):
            parse_conf(bad)
    assert parse_conf("expandable_segments:True,max_split_size_mb:512").as_conf() == \
        "max_split_size_mb:512,expandable_segments:True"


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


def trace_of_16_then_32():
    """What the GPU records for the first test: eight segment_alloc + alloc, eight
    free_requested + free_completed, then four segment_alloc + alloc of 32 MiB."""
    entries, addr = [], 0x7f0000000000
    for i in range(8):
        entries += [{"action": "segment_alloc", "addr": addr + i * 16 * MiB, "size": 16 * MiB, "stream": 0},
                    {"action": "alloc", "addr": addr + i * 16 * MiB, "size": 16 * MiB, "stream": 0}]
    for i in range(8):
        entries += [{"action": a, "addr": addr + i * 16 * MiB, "size": 16 * MiB, "stream": 0}
                    for a in ("free_requested", "free_completed")]
    for i in range(4):
        a = addr + 128 * MiB + i * 32 * MiB
        entries += [{"action": "segment_alloc", "addr": a, "size": 32 * MiB, "stream": 0},
                    {"action": "alloc", "addr": a, "size": 32 * MiB, "stream": 0}]
    return entries


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "experiments.allocator", "replay", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_cli_replays_a_pickle_and_json(tmp_path):
    snap = snapshot_dict(trace_of_16_then_32())
    (tmp_path / "s.pickle").write_bytes(pickle.dumps(snap))
    (tmp_path / "s.json").write_text(json.dumps(snap))
    for name in ("s.pickle", "s.json"):
        p = run_cli(str(tmp_path / name))
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout)
        assert (out["reserved_peak_bytes"], out["allocated_peak_bytes"], out["segments_peak"]) == (256 * MiB, 128 * MiB, 12)
        assert (out["alloc_retries"], out["oom"], out["fragmentation"]) == (0, False, 0.5)
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
