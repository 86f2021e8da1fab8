"""Checkpoints on disk: save (every rank its own shards, atomically), load (at any DP degree,
stage or bucket size), latest (the newest complete one) and export (one fp32 file for the bare
model). What they hold is the engine's state dict (state_dict.py)."""
from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .state_dict import check, load_state_dict, pack, rank, state_dict, unpack

# torch.distributed.checkpoint is imported where it is used: it takes a second to import, and
# every `import zero_impl` imports this module.


def save(engine, path: str | os.PathLike, extra: Any = None, process_group=None) -> Path:
    """Every rank writes its shards to `path` in parallel. They go to `path`.tmp first; rank 0
    renames it to `path` once every rank has finished, so a save that dies half-way never looks
    like a checkpoint. `extra`: any picklable object stored beside (load() returns it)."""
    import torch.distributed.checkpoint as dcp
    path, first = Path(path), rank(process_group) == 0
    tmp = path.with_name(path.name + ".tmp")
    sd = engine.state_dict()
    if extra is not None:
        sd["extra"] = pack(extra)
    if first:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(process_group)
    _quiet(dcp.save, sd, storage_writer=dcp.FileSystemWriter(tmp), process_group=process_group)
    if first:  # DCP's last collective ran after every rank's files were written and synced
        old = path.with_name(path.name + ".old")
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(process_group)
    return path


def load(engine, path: str | os.PathLike, process_group=None) -> Any:
    """Load a checkpoint written by save() at any DP degree, stage or bucket size (same model and
    TP degree) into `engine`, on every rank; returns save()'s `extra`."""
    import torch.distributed.checkpoint as dcp
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no .metadata): a save that did not finish?")
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    head = {k: None for k in ("engine", "extra") if k in keys}
    _quiet(dcp.load, head, checkpoint_id=path, process_group=process_group)
    head = {k: unpack(v) for k, v in head.items()}
    check(engine, head.get("engine"))
    # what this engine's state dict and the checkpoint share: another world size has other RNG
    # keys, and a checkpoint saved before any state existed has no optimizer states
    sd = {k: v for k, v in state_dict(engine).items() if k in keys or not k.startswith(("rng.", "optim"))}
    _quiet(dcp.load, sd, checkpoint_id=path, process_group=process_group)
    load_state_dict(engine, sd)
    return head.get("extra")


def latest(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint root/step_<N> with the largest N, or None. Unfinished saves
    (step_<N>.tmp) and folders without DCP's .metadata are never picked."""
    found = [(int(m.group(1)), p) for p in Path(root).glob("step_*")
             if (m := re.fullmatch(r"step_(\d+)", p.name)) and (p / ".metadata").is_file()]
    return max(found)[1] if found else None


def export(path: str | os.PathLike, out: str | os.PathLike | None = None) -> dict[str, torch.Tensor]:
    """The model of a checkpoint as the bare model's state_dict() in fp32 (the masters' dtype:
    fp64 for precision "fp64"), in one process, no torch.distributed; loadable with
    model.load_state_dict(); written with torch.save to `out` when given."""
    import torch.distributed.checkpoint as dcp
    metadata = dcp.FileSystemReader(path).read_metadata()
    sd = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in metadata.state_dict_metadata.items()
          if k.startswith("model.")}
    sd["engine"] = None
    _quiet(dcp.load, sd, checkpoint_id=path, no_dist=True)
    meta = unpack(sd.pop("engine"))
    values = {k[len("model."):]: t for k, t in sd.items()}
    for name, (shape, _) in meta["params"].items():
        values[name] = values[name].reshape(shape)
    result = {k: values[first].float() if values[first].dtype in (torch.float16, torch.bfloat16) else values[first]
              for k, first in meta["state_keys"].items()}
    if out is not None:
        torch.save(result, out)
    return result


def _barrier(group=None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group)


def _quiet(fn, *args, **kwargs) -> None:
    """DCP warns that it runs in one process when torch.distributed is not initialized: intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        fn(*args, **kwargs)
