"""A checkpoint's manifest: every file of a finished save, with its size and CRC-32.

DCP writes its shards and `.metadata` but keeps no checksum, so a shard truncated or altered
after the save (a disk that lost writes, a copy cut short) would be read back as if whole, or
fail inside an unpickler without naming the file. save() writes `manifest.json` last, after
every rank's files are on disk: a folder without one never finished. load() checks every file
against it first and refuses the first that differs, by name.

Cost: at a save, each rank hashes the files it wrote itself (DCP names rank r's `__r_*.distcp`;
the group's first rank writes `.metadata`), read back from its own page cache: no file crosses
the network again. At a load, the ranks split the files by name (the world may differ from the
save's), so a load reads each file twice, once to check it and once to load it;
load(verify=False) skips the check.
"""
from __future__ import annotations

import json
import os
import re
import warnings
import zlib
from pathlib import Path

import torch.distributed as dist

from .state_dict import rank

MANIFEST = "manifest.json"
METADATA = ".metadata"  # DCP's, written by the coordinator (the group's first rank)
FORMAT = 1
_CHUNK = 1 << 24  # bytes hashed at a time


def write(path: Path, metadata, process_group=None) -> None:
    """After DCP's save into `path` returned `metadata` (every rank's files written and synced),
    on every rank: hash the files the metadata names (not a listing of the folder, which a
    shared file system may show late) that this rank wrote, and on the group's first rank write the
    manifest, synced, under its name only once whole. Returns on every rank once it is on disk;
    if the first rank could not write it (a full disk), raises OSError on every rank."""
    files = sorted({info.relative_path for info in metadata.storage_data.values()} | {".metadata"})
    try:
        mine: dict | str = {name: _describe(path / name) for name in files
                            if _writer(name) == rank(process_group)}
    except OSError as e:  # told to every rank below, where they would otherwise wait for this one
        mine = f"{type(e).__name__}: {e}"
    everyone = gather(mine, process_group)
    unread = next(((r, e) for r, e in enumerate(everyone) if isinstance(e, str)), None)
    if unread is not None:
        raise OSError(f"checkpoint {path}: rank {unread[0]} could not read back the files it wrote: {unread[1]}")
    error = None
    if rank(process_group) == 0:
        entries = {name: entry for part in everyone for name, entry in part.items()}
        try:
            body = json.dumps({"format": FORMAT, "files": dict(sorted(entries.items()))}, indent=1)
            with open(path / (MANIFEST + ".tmp"), "w") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(path / (MANIFEST + ".tmp"), path / MANIFEST)
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    first_rank_error = gather(error, process_group)[0]  # every rank waits for the manifest here
    if first_rank_error is not None:
        raise OSError(f"checkpoint {path}: its manifest was not written on rank 0: {first_rank_error}")


def is_complete(path: Path) -> bool:
    """Whether a save into `path` finished (its manifest exists, or it is_legacy); the files are
    not read."""
    return (path / MANIFEST).is_file() or is_legacy(path)


def verify(path: str | os.PathLike, process_group=None, alone: bool = False) -> None:
    """Check every file of the checkpoint at `path` against its manifest, on every rank of the
    group, each hashing its share (`alone`: this process checks them all, no collective, as
    export does); raise on every rank the same error, naming the first file that is missing,
    truncated, longer, altered or unreadable (ValueError), or the first rank that sees no
    manifest (FileNotFoundError). A checkpoint saved before manifests existed passes, unread,
    with a warning (is_legacy)."""
    path = Path(path)
    try:  # any failure is told to every rank below, where they would otherwise wait for this one
        listed = json.loads((path / MANIFEST).read_text())["files"]
        names = sorted(listed)
        mine: dict | str = {name: why for name in (names if alone else _share(names, process_group))
                            if (why := _differs(path / name, listed[name])) is not None}
    except FileNotFoundError:
        mine = "legacy" if is_legacy(path) else "missing"
    except (OSError, ValueError, KeyError) as e:  # unreadable, or not the JSON save() writes
        mine = {MANIFEST: f"could not be read: {type(e).__name__}: {e}"}
    everyone = [mine] if alone else gather(mine, process_group)
    if all(e == "legacy" for e in everyone):
        _warn_unverified(path)
        return
    blind = next((r for r, e in enumerate(everyone) if isinstance(e, str)), None)
    if blind is not None:
        seen = f" as rank {blind} sees it" if len(everyone) > 1 else ""
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MANIFEST}{seen}): a save that did not finish?")
    found = {k: v for part in everyone for k, v in part.items()}
    if found:
        first = min(found)
        raise ValueError(f"checkpoint {path}: file {path / first} {found[first]}; the checkpoint is refused")


def is_legacy(path: Path) -> bool:
    """Whether `path` is a checkpoint saved before manifests existed: a folder renamed from its
    .tmp (so its save finished) holding DCP's .metadata and no manifest. Its files cannot be checked."""
    return not path.name.endswith(".tmp") and (path / METADATA).is_file() and not (path / MANIFEST).exists()


_warned: set[Path] = set()


def _warn_unverified(path: Path) -> None:
    if path not in _warned:
        _warned.add(path)
        warnings.warn(f"checkpoint {path} has no {MANIFEST} (saved before manifests existed): its files cannot be "
                      "verified, and are loaded as they are", stacklevel=3)


def _differs(file: Path, expected: dict) -> str | None:
    """Why `file` is not what the save wrote, or None."""
    try:
        if not file.is_file():
            return "is missing"
        size = file.stat().st_size
        if size != expected["bytes"]:
            return f"{'is truncated' if size < expected['bytes'] else 'is longer than written'}: {size} bytes, " \
                   f"the save wrote {expected['bytes']}"
        crc = _describe(file)["crc32"]
    except OSError as e:  # a stale NFS handle, an I/O error: this file is the problem, not the whole check
        return f"could not be read: {type(e).__name__}: {e}"
    if crc != expected["crc32"]:
        return f"is corrupt: CRC-32 {crc:08x}, the save wrote {expected['crc32']:08x}"
    return None


def _describe(file: Path) -> dict:
    crc, size = 0, 0
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"bytes": size, "crc32": crc}


def _writer(name: str) -> int:
    """The group rank that wrote the checkpoint file `name`: DCP's `__<rank>_<n>.distcp`; the
    first rank for `.metadata` (DCP's coordinator) and any other name."""
    m = re.match(r"__(\d+)_", name)
    return int(m.group(1)) if m else 0


def _share(names: list[str], process_group) -> list[str]:
    return names[rank(process_group)::_size(process_group)]


def gather(obj, process_group) -> list:
    """Every rank's `obj` (a small dict), in rank order. CPU tensors carry it on gloo; on NCCL
    the current CUDA device must be this rank's (as for DCP's own object collectives)."""
    if _size(process_group) == 1:
        return [obj]
    out: list = [None] * _size(process_group)
    dist.all_gather_object(out, obj, group=process_group)
    return out


def _size(process_group) -> int:
    return dist.get_world_size(process_group) if dist.is_available() and dist.is_initialized() else 1
