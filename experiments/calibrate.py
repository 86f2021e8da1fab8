"""Measure this machine for the step-time model: `make calibrate`.

    python experiments/calibrate.py                       # -> results/calibration/<hostname>.yaml
    python experiments/calibrate.py out=/tmp/profile.yaml

Micro-benchmarks (experiments/calibration/): GEMM throughput at the shapes the CPU sweep's
tiny_* models run plus a square sweep, streaming bandwidth, the per-op floor through autograd,
and gloo's loopback collectives at the world sizes this machine's cores can run (and how much of
one issued async hides under the rank's compute), all at the
ranks' one thread. The file is generated, ignored by git, and describes this host only;
experiments/analysis/calibrated.py loads it as a Hardware profile, and `experiments/report.py`
checks the model's predictions against the sweep's measured step times with it.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml

from experiments.analysis.calibrated import default_path, kernel_floor_s
from experiments.calibration.profile import measure_profile

def overlap_line(profile: dict) -> str:
    """The measured hidden fractions of async collectives under compute, per world and kind."""
    parts = [f"world {w} {kind} {v['hidden_fraction']:.2f} ({v['range'][0]:.2f}-{v['range'][1]:.2f})"
             for w, kinds in profile.get("collective_overlap", {}).items() for kind, v in kinds.items()]
    return ("\nfraction of an async collective hidden under compute (median over repeats, its quartiles): " + ", ".join(parts)
            if parts else "")


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    args = dict(a.split("=", 1) for a in argv if "=" in a)
    unknown = set(args) - {"out"} or [a for a in argv if "=" not in a]
    if unknown:
        print(f"error: unknown argument(s) {sorted(unknown)}; allowed: out=<path.yaml>", file=sys.stderr)
        return 2
    out = Path(args.get("out", default_path()))
    began = time.monotonic()
    profile = measure_profile()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(profile, sort_keys=False))
    best = max(g["flops_per_s"] for g in profile["gemm"])
    print(f"wrote {out} in {time.monotonic() - began:.0f} s: best GEMM {best / 1e9:.0f} GFLOP/s, "
          f"stream {profile['stream']['bytes_per_s'] / 1e9:.1f} GB/s, kernel floor "
          f"{kernel_floor_s(profile['framework']) * 1e6:.1f} us (one op {profile['op_floor']['forward_s'] * 1e6:.1f} us), "
          f"worlds {sorted(profile['collectives'])} (threads {profile['threads']}, load {profile['load_average']})\n"
          f"spread over {profile['spread']['rounds']} rounds, (max - min) / median: GEMM rates median "
          f"{profile['spread']['gemm_median']:.0%} (largest {profile['spread']['gemm_max']:.0%}), stream "
          f"{profile['spread']['stream']:.0%}, op floor {profile['spread']['op_floor_forward']:.0%}, framework step "
          f"{profile['spread']['framework_step']:.0%}" + overlap_line(profile))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
