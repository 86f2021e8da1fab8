"""python -m experiments.allocator replay SNAPSHOT [--capacity-bytes N] [--conf "k:v,..."] [--device D]

Replays a torch.cuda.memory._dump_snapshot() file (pickle, or the same dict as JSON) through
the caching allocator and prints one JSON object: reserved_peak_bytes, allocated_peak_bytes,
segments_peak, alloc_retries, oom, fragmentation, ..., and the trace's own reserved peak and
segment count beside them. --conf defaults to the PYTORCH_CUDA_ALLOC_CONF the snapshot records.
Bad input: one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import json
import sys

from experiments.allocator import snapshot
from experiments.allocator.config import AllocatorConfigError, parse_conf
from experiments.allocator.replay import ReplayError, replay


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bytes, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {n}")
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.allocator",
                                     description="Replay PyTorch's CUDA caching allocator over a memory snapshot.")
    sub = parser.add_subparsers(dest="command", required=True)
    rp = sub.add_parser("replay", help="replay a _dump_snapshot() pickle or JSON; print one JSON object")
    rp.add_argument("snapshot")
    rp.add_argument("--capacity-bytes", type=_positive, default=None,
                    help="bytes cudaMalloc can hand out (default: unbounded)")
    rp.add_argument("--conf", default=None, help="PYTORCH_CUDA_ALLOC_CONF, e.g. expandable_segments:True "
                                                 "(default: the snapshot's own)")
    rp.add_argument("--device", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        recorded = snapshot.trace(snapshot.load(args.snapshot), args.device)
        conf = args.conf if args.conf is not None else recorded.alloc_conf
        result = replay(recorded.events, parse_conf(conf), args.capacity_bytes, recorded.segment_addresses)
    except (snapshot.SnapshotError, AllocatorConfigError, ReplayError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = {**result.as_dict(), "trace": {"reserved_peak_bytes": recorded.reserved_peak_bytes,
                                         "segments_peak": recorded.segments_peak, "ooms": recorded.ooms}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
