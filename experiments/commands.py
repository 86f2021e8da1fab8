"""Commands the suite prints for a user to paste: spelled so that they run as printed.

A printed `python experiments/train.py ...` fails with `No module named 'hydra'` in a shell where
the project's `.venv` is not activated. So a printed command names the interpreter that is running
now: `python` (and `torchrun`) when that is what the shell's PATH finds, else its path
(`.venv/bin/python`, relative to the current folder when it lies under it).
"""
from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]


def _from_here(path: Path) -> str:
    """A path as a pasted command in the current folder needs it: relative under it, else absolute."""
    path = Path(os.path.abspath(path))
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _spelled(tool: str) -> str:
    here = Path(sys.executable).parent  # the venv's bin/ (unresolved: its python is a symlink)
    found = shutil.which(tool)
    if found and Path(os.path.abspath(found)).parent == Path(os.path.abspath(here)):
        return tool
    return _from_here(here / tool)


def script(name: str) -> str:
    """The repository's experiments/<name> (or slurm/<name>) as a command run from here names it."""
    return _from_here(REPO / name)


def python_command() -> str:
    """This interpreter as a pasted command should name it."""
    return _spelled("python")


def script_command(name: str, args: str = "") -> str:
    """The repository's Python script `name` (experiments/sweep.py, ...) run with `args` by this
    interpreter, as a command pasted here runs it."""
    return f"{python_command()} {script(name)}" + (f" {args}" if args else "")


def torchrun_command(nproc_per_node: int) -> str:
    """torchrun of this interpreter's environment, starting `nproc_per_node` local ranks."""
    return f"{_spelled('torchrun')} --nproc-per-node={nproc_per_node}"


def train_command(overrides: str, gpus: int, gpus_per_node: int) -> str:
    """experiments/train.py for one point, with the launcher it needs: none for one rank,
    torchrun for a node's worth; for several nodes slurm/launch.sh, which starts a torchrun per
    node of the Slurm allocation it runs in (sbatch slurm/run_point.sh makes one)."""
    if gpus <= 1:
        return script_command("experiments/train.py", overrides)
    if gpus <= gpus_per_node:
        return f"{torchrun_command(gpus)} {script('experiments/train.py')} {overrides}"
    return f"{script('slurm/launch.sh')} {overrides}   # inside a Slurm allocation of {gpus // gpus_per_node} nodes"


def quoted(words: list[str]) -> str:
    """Words as one shell line."""
    return " ".join(shlex.quote(w) for w in words)
