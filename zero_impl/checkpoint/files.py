"""Checkpoints on disk: save (every rank its own shards, atomically), load (at any DP degree,
stage or bucket size), latest (the newest complete one) and export (one fp32 file for the bare
model). What they hold is the engine's state dict (state_dict.py)."""
from __future__ import annotations

import errno
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

from . import manifest
from .state_dict import check, load_state_dict, pack, rank, state_dict, unpack

T = TypeVar("T")

# torch.distributed.checkpoint is imported where it is used: it takes a second to import, and
# every `import zero_impl` imports this module.


def save(engine, path: str | os.PathLike, extra: Any = None, process_group=None) -> Path:
    """Every rank writes its shards to `path` in parallel. They go to `path`.tmp first, then the
    manifest (manifest.py) once every rank's files are on disk; rank 0 renames the folder to
    `path` after that, so a save that dies half-way (a rank killed, a full disk) never looks like
    a checkpoint. A save that fails with an error raises on every rank, naming the ranks and
    their first error, and rank 0 removes what it wrote. `extra`: any picklable object stored
    beside (load() returns it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    path, first = Path(path), rank(process_group) == 0
    tmp = path.with_name(path.name + ".tmp")
    sd = engine.state_dict()
    if extra is not None:
        sd["extra"] = pack(extra)
    _on_first_rank(lambda: _fresh_folder(tmp), process_group, f"checkpoint {path} was not saved: rank 0 could not "
                   f"create {tmp}")
    try:
        metadata = _quiet(dcp.save, sd, storage_writer=dcp.FileSystemWriter(tmp), process_group=process_group)
    except CheckpointException as e:  # DCP hands every rank's failures to every rank
        if first:
            shutil.rmtree(tmp, ignore_errors=True)
        failed = sorted(e.failures)
        error = e.failures[failed[0]][0]
        raise OSError(f"checkpoint {path} was not saved: rank(s) {failed} failed to write it, rank {failed[0]}: "
                      f"{type(error).__name__}: {error}; the newest complete checkpoint beside it is unchanged") from None
    try:
        manifest.write(tmp, metadata, process_group)  # on disk on every rank's return: the folder may be renamed
    except OSError:
        if first:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _on_first_rank(lambda: _publish(tmp, path), process_group, f"checkpoint {path}: rank 0 could not rename "
                   f"{tmp.name} to it (complete, with its manifest)")
    return path


def _fresh_folder(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    # on NFS a file still open somewhere is only renamed (.nfsXXXX) and its folder stays: not the
    # checkpoint's (the manifest lists DCP's files only), so it may stay too
    tmp.mkdir(parents=True, exist_ok=True)


def _publish(tmp: Path, path: Path) -> None:
    """Rename the finished `tmp` to `path`, a checkpoint already there moved aside to .old for
    the instant of the rename (latest() takes it meanwhile), and sync the parent folder."""
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # FUSE and SMB file systems cannot sync a folder (EINVAL): the rename stands
        if e.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)
    shutil.rmtree(old, ignore_errors=True)


def _on_first_rank(work: Callable[[], T], process_group, failure: str) -> T:
    """`work()` on the group's first rank alone, its result handed to every rank, which wait for
    it there (one gather); an OSError it raises is raised on every rank as `failure: error`,
    rather than leaving the others at a barrier."""
    result, error = None, None
    if rank(process_group) == 0:
        try:
            result = work()
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    result, error = manifest.gather((result, error), process_group)[0]
    if error is not None:
        raise OSError(f"{failure}: {error}")
    return result


def load(engine, path: str | os.PathLike, process_group=None, verify: bool = True) -> Any:
    """Load a checkpoint written by save() at any DP degree, stage or bucket size (same model and
    TP degree) into `engine`, on every rank; returns save()'s `extra`. `verify`: check every
    file against the manifest first (manifest.verify: each file read once more); False skips it."""
    import torch.distributed.checkpoint as dcp
    path = Path(path)
    if verify:
        manifest.verify(path, process_group)  # every file as the save wrote it, or refused by name
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
    """The complete checkpoint root/step_<N> with the largest N, or None: one with a manifest,
    or one saved before manifests existed (manifest.is_legacy). Unfinished saves (step_<N>.tmp,
    folders without a manifest) are never picked. A step_<N>.old counts for
    step_<N> while that is missing: save() moves a checkpoint it replaces aside there for an
    instant, and a kill in that instant leaves it so."""
    found = _steps(root)
    return max(found)[1] if found else None


def unfinished(root: str | os.PathLike) -> list[Path]:
    """Folders under `root` newer than latest(root) that a save left unfinished (step_<N>.tmp,
    with its manifest too if killed before the rename, or step_<N> without a manifest), oldest
    first: what a resume passes over."""
    done = latest(root)
    newest = _step_of(done) if done is not None else -1
    return sorted((p for p in Path(root).glob("step_*") if _step_of(p) is not None and _step_of(p) > newest
                   and (p.name.endswith(".tmp") or not manifest.is_complete(p))), key=_step_of)


def resume_point(root: str | os.PathLike, process_group=None) -> tuple[Path | None, list[Path]]:
    """(latest(root), unfinished(root)) as the group's first rank sees them, on every rank
    (collective on the group): right after a save, ranks listing a shared file system may see
    different folders (NFS caches listings), and each picking its own would resume different
    steps. The ranks then load what they were handed (load() refuses it on every rank if one
    cannot see its manifest)."""
    return _on_first_rank(lambda: (latest(root), unfinished(root)), process_group,
                          f"checkpoints in {root} could not be listed")


def _steps(root) -> list[tuple[int, Path]]:
    """(N, folder) of every complete checkpoint: step_<N>, else step_<N>.old."""
    complete = {}
    for p in sorted(Path(root).glob("step_*"), key=lambda p: p.name.endswith(".old")):
        m = re.fullmatch(r"step_(\d+)(\.old)?", p.name)
        if m and manifest.is_complete(p):
            complete.setdefault(int(m.group(1)), p)
    return list(complete.items())


def _step_of(p: Path) -> int | None:
    m = re.fullmatch(r"step_(\d+)(\.tmp|\.old)?", p.name)
    return int(m.group(1)) if m else None


def export(path: str | os.PathLike, out: str | os.PathLike | None = None) -> dict[str, torch.Tensor]:
    """The model of a checkpoint as the bare model's state_dict() in fp32 (the masters' dtype:
    fp64 for precision "fp64"), in one process, no torch.distributed; loadable with
    model.load_state_dict(); written with torch.save to `out` when given. Refuses a checkpoint
    whose files differ from its manifest, naming the first (manifest.verify)."""
    import torch.distributed.checkpoint as dcp
    manifest.verify(path, alone=True)  # every file as the save wrote it, or refused by name
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


def _quiet(fn, *args, **kwargs) -> Any:
    """DCP warns that it runs in one process when torch.distributed is not initialized: intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        return fn(*args, **kwargs)
