"""zero_impl's command line: `python -m zero_impl export CHECKPOINT_DIR OUT.pt` writes the model of
a checkpoint (zero_impl.checkpoint.save) as the bare model's state_dict() in fp32, in one process."""
from __future__ import annotations

import sys

from .checkpoint import export


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "export":
        print("usage: python -m zero_impl export CHECKPOINT_DIR OUT.pt", file=sys.stderr)
        return 2
    exported = export(argv[1], argv[2])
    print(f"{argv[2]}: {len(exported)} tensors, "
          f"{sum(t.numel() for t in exported.values() if t.is_floating_point()):,} floating-point elements")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
