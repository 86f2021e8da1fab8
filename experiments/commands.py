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


def _spelled(tool: str) -> str:
    here = Path(sys.executable).parent  # the venv's bin/ (unresolved: its python is a symlink)
    found = shutil.which(tool)
    if found and Path(os.path.abspath(found)).parent == Path(os.path.abspath(here)):
        return tool
    path = Path(os.path.abspath(here / tool))
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def python_command() -> str:
    """This interpreter as a pasted command should name it."""
    return _spelled("python")


def torchrun_command(nproc_per_node: int) -> str:
    """torchrun of this interpreter's environment, starting `nproc_per_node` local ranks."""
    return f"{_spelled('torchrun')} --nproc-per-node={nproc_per_node}"


def train_command(overrides: str, gpus: int, gpus_per_node: int) -> str:
    """experiments/train.py for one point, with the launcher it needs on one node: none for one
    rank, torchrun for a node's worth; a job of several nodes goes through sbatch (srun)."""
    script = "experiments/train.py"
    if gpus <= 1:
        return f"{python_command()} {script} {overrides}"
    if gpus <= gpus_per_node:
        return f"{torchrun_command(gpus)} {script} {overrides}"
    return f"srun {python_command()} {script} {overrides}   # inside an allocation of {gpus} GPUs"


def quoted(words: list[str]) -> str:
    """Words as one shell line."""
    return " ".join(shlex.quote(w) for w in words)
