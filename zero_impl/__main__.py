"""zero_impl's command line: `python -m zero_impl export CHECKPOINT_DIR OUT.pt` writes the model of
a checkpoint (zero_impl.checkpoint.save) as the bare model's state_dict() in fp32, in one process."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from .checkpoint import export, latest


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "export":
        print(f"usage: {_python()} -m zero_impl export CHECKPOINT_DIR OUT.pt", file=sys.stderr)
        return 2
    problem = _check_paths(Path(argv[1]), Path(argv[2]))
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        exported = export(argv[1], argv[2])
    except (ValueError, FileNotFoundError) as e:  # no manifest, or a file that differs from it (manifest.py)
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{argv[2]}: {len(exported)} tensors, "
          f"{sum(t.numel() for t in exported.values() if t.is_floating_point()):,} floating-point elements")
    return 0


def _python() -> str:
    """This interpreter as a pasted command must name it: `python` where the shell's PATH finds it
    (an activated .venv), else its path; a bare `python` of another environment lacks torch.
    (experiments/commands.py spells the suite's commands so; zero_impl imports nothing of experiments.)"""
    found = shutil.which("python")
    ours = os.path.dirname(os.path.abspath(sys.executable))
    return "python" if found and os.path.dirname(os.path.abspath(found)) == ours else sys.executable


def _check_paths(checkpoint: Path, out: Path) -> str | None:
    """Why the export cannot start, in one line, or None."""
    if not checkpoint.is_dir():
        return f"CHECKPOINT_DIR {checkpoint} is not a folder"
    if not (checkpoint / ".metadata").is_file():
        newest = latest(checkpoint)
        return (f"CHECKPOINT_DIR {checkpoint} holds no DCP checkpoint (no .metadata): "
                + (f"its newest is {newest}" if newest else "give the folder zero_impl.checkpoint.save wrote"))
    if out.is_dir():
        return f"OUT.pt {out} is a folder: give a file name"
    folder = out.resolve().parent
    if not folder.is_dir():
        return f"OUT.pt {out}: {folder} " + ("is a file" if folder.exists() else "does not exist")
    if not os.access(folder, os.W_OK):
        return f"OUT.pt {out}: {folder} is not writable here"
    return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
