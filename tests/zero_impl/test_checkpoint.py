"""Checkpoints (zero_impl/checkpoint/): resume equals never stopping, bitwise; DCP reshards
across DP degrees, stages and bucket sizes; bad checkpoints are refused; exports load into the
bare model; the wrapped model's own state_dict() never silently misleads.
"""
from __future__ import annotations

import copy
import errno
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import zero_impl
from zero_impl import checkpoint
from zero_impl.checkpoint.state_dict import Chunked, unpack
from helpers import CLIP, FP64_TOL, adamw, global_batch, make_model, max_abs_diff, param_groups
from experiments.launch import spawn
from experiments.models.tiny_gpt import TinyGPTConfig, TinyGPT, lm_loss

pytestmark = pytest.mark.numerical  # make test-matrix reruns these under every CPU setting

REPO = Path(__file__).resolve().parents[2]
ACCUM = 2
torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # its lazy imports once, before ranks fork


def build(model=None, accum=ACCUM, **config) -> zero_impl.ZeroEngine:
    model = make_model(dtype=torch.float64 if config.get("precision") == "fp64" else torch.float32) \
        if model is None else model
    config = {"clip_grad_norm": CLIP, "reduce_bucket_size": 500, **config}
    return zero_impl.initialize(model, zero_impl.ZeroConfig(grad_accum_steps=accum, **config),
                                optimizer=adamw, param_groups=param_groups(model))


def train(engine, first: int, last: int) -> list[float]:
    """Steps first..last-1 of the global batch sequence (tests/helpers.py), whatever the world."""
    world, rank, accum = dist.get_world_size(), dist.get_rank(), engine.config.grad_accum_steps
    losses = []
    for step in range(first, last):
        batch = global_batch(step, world, accum)
        total = torch.zeros((), dtype=torch.float64)
        for k in range(accum):
            loss = lm_loss(engine(batch[k, rank]), batch[k, rank])
            engine.backward(loss)
            total += loss.detach() / accum
            engine.step()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def read_all(path) -> dict:
    """Every entry of a checkpoint, in one process: tensors whole, objects unpickled."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    sd = {k: torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
          for k, md in metadata.state_dict_metadata.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=path, no_dist=True)
    return {k: unpack(v) for k, v in sd.items()}


def assert_same_checkpoint(a, b) -> None:
    """Bitwise the same model, optimizer states and counters, whatever layout wrote them."""
    a, b = read_all(a), read_all(b)
    states = sorted(k for k in a if k.startswith(("model.", "optim.", "optim_group.")))
    assert states == sorted(k for k in b if k.startswith(("model.", "optim.", "optim_group."))) and states
    for k in states:
        assert torch.equal(a[k], b[k]), k
    for k in ("steps", "skipped_steps", "loss_scale", "clean_steps", "optimizer_state"):
        assert a["engine"][k] == b["engine"][k], k


# -- resume equals never stopping ------------------------------------------------------------------
STAGES = (0, 1, 2, 3)


def _straight_and_first_half(path: str, split: int, config: dict) -> dict:
    out = {}
    for stage in STAGES:
        straight = build(stage=stage, **config)
        losses = train(straight, 0, 10)
        engine = build(stage=stage, **config)
        train(engine, 0, split)
        checkpoint.save(engine, f"{path}/stage{stage}/step_{split}")
        out[stage] = {"losses": losses, "params": straight.full_parameters(), "stats": straight.stats()}
    return out


def _second_half(path: str, split: int, config: dict) -> dict:
    out = {}
    for stage in STAGES:
        engine = build(stage=stage, **config)
        if split:
            train(engine, 0, 3)  # state to be replaced entirely, optimizer states included
        checkpoint.load(engine, checkpoint.latest(f"{path}/stage{stage}"))
        losses = train(engine, split, 10)
        out[stage] = {"losses": losses, "params": engine.full_parameters(), "stats": engine.stats()}
    return out


def assert_resume_is_bitwise(tmp_path, world: int, split: int = 5, **config) -> None:
    first = spawn(_straight_and_first_half, world, str(tmp_path), split, config, timeout=300)[0]
    second = spawn(_second_half, world, str(tmp_path), split, config, timeout=300)[0]  # a new process group
    for stage in STAGES:
        a, b = first[stage], second[stage]
        assert a["losses"][split:] == b["losses"], f"stage {stage}"
        assert max_abs_diff(a["params"], b["params"]) == 0.0, f"stage {stage}"
        for key in ("steps", "micro_steps", "skipped_steps", "loss_scale"):
            assert a["stats"][key] == b["stats"][key], (stage, key)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_resume_equals_never_stopping_fp32(tmp_path, world):
    """10 steps straight = 5 steps, save, a new process group, load, 5 steps: losses and
    parameters bitwise, stages 0-3 (2 accumulated micro-batches, clipping active)."""
    assert_resume_is_bitwise(tmp_path, world)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_resume_mixed_precision_keeps_masters_and_loss_scale(tmp_path, precision):
    """fp32 masters and, for fp16, the dynamic loss scale mid-window (window of 3: the scale
    doubles at steps the restored clean-step count decides)."""
    assert_resume_is_bitwise(tmp_path, 2, precision=precision, loss_scale_window=3)


def test_resume_from_before_the_first_step(tmp_path):
    """A checkpoint with no optimizer states (Adam makes them at its first step) resets a
    trained engine's states, and the run then equals a fresh one."""
    assert_resume_is_bitwise(tmp_path, 2, split=0)


# -- resharding ------------------------------------------------------------------------------------
SAVED = dict(stage=2, world=4, precision="fp64", reduce_bucket_size=500)
TARGETS = [  # (stage, world, engine config): another DP degree, stage and bucket size each
    (1, 2, {"reduce_bucket_size": 300}),
    (3, 3, {}),
    (0, 1, {"reduce_bucket_size": 10 ** 9}),
    (3, 2, {"stage3_param_persistence_threshold": 40}),
    (2, 3, {"reduce_bucket_size": 10 ** 9}),
    (1, 4, {"reduce_bucket_size": 1}),
]


def _save_after(path: str, steps: int, config: dict) -> dict:
    engine = build(**config)
    train(engine, 0, steps)
    checkpoint.save(engine, path)
    return engine.full_parameters()


def _load_and_resave(src: str, dst: str, config: dict) -> dict:
    engine = build(**config)
    checkpoint.load(engine, src)
    checkpoint.save(engine, dst)
    return engine.full_parameters()


@pytest.fixture(scope="module")
def saved_at_dp4(tmp_path_factory):
    path = tmp_path_factory.mktemp("dp4") / "step_5"
    config = {k: v for k, v in SAVED.items() if k != "world"}
    params = spawn(_save_after, SAVED["world"], str(path), 5, config, timeout=120)[0]
    return path, params


@pytest.mark.parametrize("stage,world,config", TARGETS)
def test_reshard_across_dp_degree_stage_and_buckets(saved_at_dp4, tmp_path, stage, world, config):
    """Saved at DP 4 stage 2: loaded at another DP degree, stage and bucket size, the engine
    holds the saved parameters, and saving it again writes the same checkpoint, bitwise
    (fp32 masters, Adam's moments and step, counters)."""
    path, params = saved_at_dp4
    loaded = spawn(_load_and_resave, world, str(path), str(tmp_path / "again"),
                   {"stage": stage, "precision": "fp64", **config}, timeout=120)
    assert all(max_abs_diff(r, params) == 0.0 for r in loaded)
    assert_same_checkpoint(path, tmp_path / "again")


def _resume_at(path: str, config: dict, accum: int) -> dict:
    engine = build(accum=accum, **config)
    checkpoint.load(engine, path)
    losses = train(engine, 5, 10)
    return {"params": engine.full_parameters(), "losses": losses}


def _straight(config: dict) -> dict:
    engine = build(**config)
    losses = train(engine, 0, 10)
    return {"params": engine.full_parameters(), "losses": losses}


def test_training_continues_after_resharding(saved_at_dp4):
    """DP 4 x 2 micro-batches and DP 2 x 4 micro-batches see the same global batches: resumed at
    DP 2, stage 3, the run ends where the DP 4 run does (float64, up to summation order)."""
    path, _ = saved_at_dp4
    resumed = spawn(_resume_at, 2, str(path), {"stage": 3, "precision": "fp64"}, 4, timeout=120)[0]
    straight = spawn(_straight, 4, {"stage": 2, "precision": "fp64"}, timeout=120)[0]
    assert max_abs_diff(resumed["params"], straight["params"]) < FP64_TOL
    assert max(abs(a - b) for a, b in zip(resumed["losses"], straight["losses"][5:])) < FP64_TOL


# -- bad input -------------------------------------------------------------------------------------
def test_another_model_shape_is_refused_naming_the_parameter(tmp_path):
    engine = build(stage=0)  # a world of one: no torch.distributed needed
    checkpoint.save(engine, tmp_path / "step_0")
    torch.manual_seed(0)
    other = build(TinyGPT(TinyGPTConfig(vocab_size=67, seq_len=16, hidden=12, layers=2, heads=2)), stage=0)
    with pytest.raises(ValueError, match=r"parameter 'wte.weight' has shape \(67, 10\) in the checkpoint, \(67, 12\) here"):
        checkpoint.load(other, tmp_path / "step_0")
    deeper = build(TinyGPT(TinyGPTConfig(vocab_size=67, seq_len=16, hidden=10, layers=3, heads=2)), stage=0)
    with pytest.raises(ValueError, match=r"parameter 'blocks.2.ln1.weight' of shape \(10,\) is not in the checkpoint"):
        checkpoint.load(deeper, tmp_path / "step_0")


def _full_disk(*args, **kwargs):
    raise OSError(28, "No space left on device")


def _save_step_2(engine, root: str) -> str:
    """The next save, step_2: the error this rank raised, or "saved"."""
    try:
        checkpoint.save(engine, f"{root}/step_2")
    except OSError as e:
        return str(e)
    return "saved"


def _save_with_a_full_disk(root: str) -> str:
    engine = build(stage=2)
    train(engine, 0, 1)
    checkpoint.save(engine, f"{root}/step_1")
    train(engine, 1, 2)
    if dist.get_rank() == 1:  # rank 1's disk fills up in the middle of the next save
        dcp.FileSystemWriter.write_data = _full_disk
    return _save_step_2(engine, root)


def test_a_save_on_a_full_disk_is_never_the_latest(tmp_path):
    """The failure is one line on every rank, naming the checkpoint, the rank and its error;
    nothing of the failed save is left, and the newest complete checkpoint stays the latest."""
    for error in spawn(_save_with_a_full_disk, 2, str(tmp_path), timeout=120):
        assert re.match(r"checkpoint \S+step_2 was not saved: rank\(s\) \[1\] failed to write it, rank 1: OSError: "
                        r"\[Errno 28\] No space left on device; the newest complete checkpoint beside it is unchanged$",
                        error), error
    assert not (tmp_path / "step_2.tmp").exists() and not (tmp_path / "step_2").exists()
    (tmp_path / "step_9").mkdir()  # a folder without a manifest
    assert checkpoint.latest(tmp_path) == tmp_path / "step_1"
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        checkpoint.load(build(stage=2), tmp_path / "step_9")


def _manifest_on_a_full_disk(root: str) -> str:
    engine = build(stage=2)
    checkpoint.save(engine, f"{root}/step_1")
    if dist.get_rank() == 0:  # the disk fills up as rank 0 writes the manifest, after every shard
        from zero_impl.checkpoint import manifest
        manifest.json = SimpleNamespace(dumps=_full_disk)
    return _save_step_2(engine, root)


def test_a_manifest_on_a_full_disk_fails_the_save_on_every_rank(tmp_path):
    """The manifest, written last by rank 0, fails: every rank raises (none waits for it), the
    folder goes, and the previous checkpoint stays the latest."""
    for error in spawn(_manifest_on_a_full_disk, 2, str(tmp_path), timeout=120):
        assert re.match(r"checkpoint \S+step_2.tmp: its manifest was not written on rank 0: OSError: \[Errno 28\]", error)
    assert not (tmp_path / "step_2.tmp").exists() and checkpoint.latest(tmp_path) == tmp_path / "step_1"


def _on_rank(wanted: int, fault) -> None:
    """Install `fault` (a callable) in this rank only."""
    if dist.get_rank() == wanted:
        fault()


def _dir_fsync(errno_: int):
    """os.fsync that fails with `errno_` on a folder, as FUSE and SMB file systems do (EINVAL)."""
    plain = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno_, os.strerror(errno_))
        plain(fd)
    return lambda: setattr(os, "fsync", fsync)


def _read_fault(error: OSError):
    """manifest.json unreadable, or a file's read-back failing, with `error`."""
    from zero_impl.checkpoint import manifest

    def fail(*_args, **_kwargs):
        raise error
    if isinstance(error, FileNotFoundError):  # the manifest not (yet) visible to this rank
        plain = Path.read_text
        return lambda: setattr(Path, "read_text",
                               lambda self, *a, **k: fail() if self.name == manifest.MANIFEST else plain(self, *a, **k))
    return lambda: setattr(manifest, "_describe", fail)


def _leftover_tmp(root: str):
    """A step_2.tmp that rmtree could not remove (NFS keeps a .nfsXXXX file of a file still open)."""
    def fault():
        Path(root, "step_2.tmp").mkdir()
        Path(root, "step_2.tmp", ".nfs000000001").write_bytes(b"open elsewhere")
        files.shutil = SimpleNamespace(rmtree=lambda *a, **k: None)
    from zero_impl.checkpoint import files
    return fault


def _fault_in_save_or_load(root: str, fault: str) -> str:
    """Save step_1 and step_2, then load step_2, with `fault` on one rank: what each rank raised."""
    engine = build(stage=2)
    faults = {"no manifest on rank 1": (1, "load", _read_fault(FileNotFoundError(2, "No such file or directory"))),
              "stale handle on rank 1": (1, "load", _read_fault(OSError(116, "Stale file handle"))),
              "folder fsync EINVAL": (0, "save", _dir_fsync(errno.EINVAL)),
              "folder fsync EIO": (0, "save", _dir_fsync(errno.EIO)),
              "tmp left by NFS": (0, "save", _leftover_tmp(root))}
    wanted, when, install = faults[fault]
    checkpoint.save(engine, f"{root}/step_1")
    try:
        if when == "save":
            _on_rank(wanted, install)
        checkpoint.save(engine, f"{root}/step_2")
        if when == "load":
            _on_rank(wanted, install)
        checkpoint.load(build(stage=2), f"{root}/step_2")
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


@pytest.mark.parametrize("fault,expected", [
    ("no manifest on rank 1", r"FileNotFoundError: \S+step_2 is not a complete checkpoint \(no manifest.json as rank 1 "
                              r"sees it\): a save that did not finish\?"),
    ("stale handle on rank 1", r"ValueError: checkpoint \S+step_2: file \S+ could not be read: OSError: \[Errno 116\] "
                               r"Stale file handle; the checkpoint is refused"),
    ("folder fsync EINVAL", r"ok"),
    ("folder fsync EIO", r"OSError: checkpoint \S+step_2: rank 0 could not rename step_2.tmp to it \(complete, with its "
                         r"manifest\): OSError: \[Errno 5\] Input/output error"),
    ("tmp left by NFS", r"ok"),
])
def test_a_fault_on_one_rank_raises_the_same_line_on_every_rank(tmp_path, fault, expected):
    """A rank that cannot see the manifest, or read a file back, tells the others before they
    wait for it; so does rank 0 when its rename fails; a folder fsync a file system refuses
    (EINVAL) and a .tmp folder NFS would not let go of do not fail the save."""
    errors = spawn(_fault_in_save_or_load, 2, str(tmp_path), fault, timeout=60)
    assert errors[0] == errors[1] and re.fullmatch(expected, errors[0]), errors


def _save_killed_between_shards(root: str) -> dict:
    engine = build(stage=2)
    train(engine, 0, 1)
    checkpoint.save(engine, f"{root}/step_1")
    saved = engine.full_parameters()
    train(engine, 1, 2)
    if dist.get_rank() == 1:  # rank 0 writes its shard; rank 1 is killed half-way through its own
        def killed(writer, plan, planner):
            with open(Path(writer.path) / "__1_0.distcp", "wb") as f:
                f.write(b"\0" * 100)
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        dcp.FileSystemWriter.write_data = killed
    checkpoint.save(engine, f"{root}/step_2")
    return saved


def _load_latest(root: str) -> dict:
    engine = build(stage=2)
    checkpoint.load(engine, checkpoint.latest(root))
    return engine.full_parameters()


def test_a_save_killed_midway_is_never_the_latest(tmp_path):
    """A rank SIGKILLed between the shards of a save (rank 0's written, rank 1's half): the
    folder stays step_2.tmp without a manifest, the previous checkpoint stays the latest, the
    unfinished save is what a resume passes over, and the latest loads (at another world size)
    to exactly the parameters it was saved with."""
    from experiments.launch import RankFailed
    with pytest.raises(RankFailed):  # rank 1's death, or rank 0's error at losing its peer, whichever is seen first
        spawn(_save_killed_between_shards, 2, str(tmp_path), timeout=120)
    assert (tmp_path / "step_2.tmp" / "__1_0.distcp").stat().st_size == 100 and not (tmp_path / "step_2").exists()
    assert checkpoint.latest(tmp_path) == tmp_path / "step_1"
    assert checkpoint.unfinished(tmp_path) == [tmp_path / "step_2.tmp"]
    [loaded] = spawn(_load_latest, 1, str(tmp_path), timeout=120)
    [saved, _] = spawn(_parameters_at_step_1, 2, str(tmp_path), timeout=120)
    assert max_abs_diff(loaded, saved) == 0.0


def test_a_save_killed_before_its_rename_is_listed_unfinished(tmp_path):
    """Killed between the manifest and the rename: step_2.tmp holds a manifest, yet the save
    never finished; latest() passes over it and unfinished() names it."""
    engine = build(stage=2)
    checkpoint.save(engine, tmp_path / "step_1")
    checkpoint.save(engine, tmp_path / "step_2")
    os.replace(tmp_path / "step_2", tmp_path / "step_2.tmp")
    assert checkpoint.latest(tmp_path) == tmp_path / "step_1"
    assert checkpoint.unfinished(tmp_path) == [tmp_path / "step_2.tmp"]


def test_a_checkpoint_saved_before_manifests_loads_unverified_with_one_warning(tmp_path):
    """A renamed step folder with DCP's .metadata and no manifest finished its save before
    manifests existed: it is the latest, not unfinished, and loads, with one warning that its
    files cannot be verified; a .tmp folder like it is still unfinished."""
    engine = build(stage=2)  # a world of one: no torch.distributed needed
    tokens = global_batch(0, 1, ACCUM)
    for k in range(ACCUM):
        engine.backward(lm_loss(engine(tokens[k, 0]), tokens[k, 0]))
        engine.step()
    checkpoint.save(engine, tmp_path / "step_1")
    (tmp_path / "step_1" / "manifest.json").unlink()
    shutil.copytree(tmp_path / "step_1", tmp_path / "step_2.tmp")
    assert checkpoint.latest(tmp_path) == tmp_path / "step_1"
    assert checkpoint.unfinished(tmp_path) == [tmp_path / "step_2.tmp"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            loaded = build(stage=2)
            checkpoint.load(loaded, tmp_path / "step_1")
    assert [str(w.message) for w in seen] == [f"checkpoint {tmp_path / 'step_1'} has no manifest.json (saved before "
                                              "manifests existed): its files cannot be verified, and are loaded as they are"]
    assert max_abs_diff(loaded.full_parameters(), engine.full_parameters()) == 0.0


def _hashed_at_save(root: str) -> list[str]:
    """The files this rank read back to hash them while saving."""
    from zero_impl.checkpoint import manifest
    describe, hashed = manifest._describe, []
    manifest._describe = lambda file: hashed.append(file.name) or describe(file)
    checkpoint.save(build(stage=2), f"{root}/step_0")
    return sorted(hashed)


def test_each_rank_hashes_only_the_files_it_wrote(tmp_path):
    """Its own files, still in its page cache: no rank reads another's over the network."""
    rank0, rank1 = spawn(_hashed_at_save, 2, str(tmp_path), timeout=60)
    assert rank0 == [".metadata", "__0_0.distcp"] and rank1 == ["__1_0.distcp"]


def test_load_without_verify_reads_no_checksum(tmp_path):
    """verify=False skips the manifest check (a load otherwise reads each file twice)."""
    engine = build(stage=2)
    checkpoint.save(engine, tmp_path / "step_0")
    listed = json.loads((tmp_path / "step_0" / "manifest.json").read_text())
    listed["files"]["__0_0.distcp"]["crc32"] ^= 1  # the check would refuse the intact shard
    (tmp_path / "step_0" / "manifest.json").write_text(json.dumps(listed))
    with pytest.raises(ValueError, match="__0_0.distcp is corrupt"):
        checkpoint.load(build(stage=2), tmp_path / "step_0")
    checkpoint.load(build(stage=2), tmp_path / "step_0", verify=False)


def _parameters_at_step_1(root: str) -> dict:
    engine = build(stage=2)
    train(engine, 0, 1)
    return engine.full_parameters()


def test_a_truncated_or_corrupt_shard_is_refused_by_name(tmp_path):
    """Each file is checked against the save's manifest (size and CRC-32) before anything is
    read: a shard cut short or with one byte changed is refused, the file named."""
    engine = build(stage=2)  # a world of one: no torch.distributed needed
    checkpoint.save(engine, tmp_path / "step_1")
    shard = tmp_path / "step_1" / "__0_0.distcp"
    whole = shard.read_bytes()
    shard.write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ValueError, match=rf"file {shard} is truncated: {len(whole) // 2} bytes, the save wrote {len(whole)}"):
        checkpoint.load(build(stage=2), tmp_path / "step_1")
    changed = bytearray(whole)
    changed[len(whole) // 2] ^= 0x01
    shard.write_bytes(bytes(changed))
    with pytest.raises(ValueError, match=rf"file {shard} is corrupt: CRC-32"):
        checkpoint.load(build(stage=2), tmp_path / "step_1")
    with pytest.raises(ValueError, match=rf"file {shard} is corrupt: CRC-32"):  # the export, in one process
        checkpoint.export(tmp_path / "step_1")
    shard.write_bytes(whole)
    checkpoint.load(build(stage=2), tmp_path / "step_1")


# -- the state dict API and the wrapped model's own ------------------------------------------------
def _dcp_idiom(path: str, split: int, config: dict) -> dict:
    """The stock DCP calls on engine.state_dict(), as torchtitan resumes with FSDP2: a fresh
    engine's state dict (optimizer states included, as placeholders) is filled in place."""
    out = {}
    for stage in STAGES:
        straight = build(stage=stage, **config)
        losses = train(straight, 0, split + 3)
        first = build(stage=stage, **config)
        train(first, 0, split)
        dcp.save(first.state_dict(), checkpoint_id=f"{path}/stage{stage}")
        fresh = build(stage=stage, **config)
        sd = fresh.state_dict()
        placeholders = [v for k, v in sd.items() if k.startswith("optim.")]
        zeros = bool(placeholders) and all(torch.count_nonzero(t) == 0 for v in placeholders for _, t in v.chunks)
        dcp.load(sd, checkpoint_id=f"{path}/stage{stage}")
        fresh.load_state_dict(sd)
        resumed = train(fresh, split, split + 3)
        # A state dict taken and never loaded changes nothing: its placeholders are dropped at the
        # first step. NAdam, whose fresh mu_product is 1, would step differently from a zero one.
        nadam = [_nadam(stage, config) for _ in range(2)]
        nadam[0].state_dict()
        out[stage] = {"losses": (losses[split:], resumed), "zeros": zeros,
                      "same": max_abs_diff(straight.full_parameters(), fresh.full_parameters()) == 0.0,
                      "steps": (straight.steps, fresh.steps),
                      "untouched": train(nadam[0], 0, 2) == train(nadam[1], 0, 2)
                      and max_abs_diff(nadam[0].full_parameters(), nadam[1].full_parameters()) == 0.0}
    return out


def _nadam(stage: int, config: dict) -> zero_impl.ZeroEngine:
    model = make_model()
    return zero_impl.initialize(model, zero_impl.ZeroConfig(stage=stage, grad_accum_steps=ACCUM, reduce_bucket_size=500,
                                                            **config),
                                optimizer=lambda groups: torch.optim.NAdam(groups, lr=1e-2),
                                param_groups=param_groups(model))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stock_dcp_load_into_a_fresh_engine(tmp_path, precision):
    """sd = engine.state_dict(); dcp.load(sd, checkpoint_id=path); engine.load_state_dict(sd) on
    an engine that has not stepped: it carries zero optimizer states of the right shapes, DCP
    fills them in place, and the run continues bitwise as if it had never stopped (stages 0-3,
    world 2, 2 accumulated micro-batches). A state dict taken and not loaded changes nothing."""
    result = spawn(_dcp_idiom, 2, str(tmp_path), 2, {"precision": precision}, timeout=300)[0]
    for stage, r in result.items():
        assert r["losses"][0] == r["losses"][1] and r["same"], stage
        assert r["zeros"] and r["steps"][0] == r["steps"][1] == 5, (stage, r)
        assert r["untouched"], stage


def _step(engine, step: int) -> None:
    """One update from micro-batch `step` of a one-rank world, no accumulation."""
    tokens = global_batch(step, 1, 1)[0, 0]
    engine.backward(lm_loss(engine(tokens), tokens))
    assert engine.step()


def _held_only_by(sd: dict, engine) -> int:
    """Bytes of the storages of `sd`'s optimizer entries that none of the engine's tensors uses."""
    engine_storages = {t.untyped_storage().data_ptr() for ts in engine.state_tensors().values() for t in ts}
    held = {}
    for key, value in sd.items():
        tensors = [t for _, t in value.chunks] if isinstance(value, Chunked) else [value]
        for t in (t for t in tensors if key.startswith("optim") and torch.is_tensor(t)):
            held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(n for ptr, n in held.items() if ptr not in engine_storages)


def test_states_put_in_by_torchs_own_load_state_dict_are_kept():
    """A fresh engine's state_dict() makes placeholder states; torch's optimizer.load_state_dict then
    puts a checkpoint's in their place (as DCP's set_optimizer_state_dict does). The first step keeps
    those: it continues as the engine that saved them, bitwise (step count 3, its moments)."""
    trained, fresh = build(stage=1, accum=1), build(stage=1, accum=1)
    for step in range(2):
        _step(trained, step)
    fresh.module.load_state_dict(trained.module.state_dict())  # fp32: the masters are the model's shard
    sd = fresh.state_dict()
    fresh.optimizer.load_state_dict(copy.deepcopy(trained.optimizer.state_dict()))
    for engine in (trained, fresh):
        _step(engine, 2)
    ours, theirs = fresh.optimizer.state_dict()["state"], trained.optimizer.state_dict()["state"]
    assert ours.keys() == theirs.keys() and len(ours) > 0
    for index, state in theirs.items():
        assert float(ours[index]["step"]) == float(state["step"]) == 3.0, index
        assert all(torch.equal(ours[index][k], state[k]) for k in ("exp_avg", "exp_avg_sq")), index
    assert max_abs_diff(trained.full_parameters(), fresh.full_parameters()) == 0.0
    assert _held_only_by(sd, fresh) == 0  # the placeholders torch's load replaced went at the step


def test_a_held_state_dict_keeps_no_placeholder_past_the_first_step():
    """A state dict taken before the first step is a view of placeholder states; the first step drops
    them (nothing was loaded) and releases their storage, so holding `sd` does not keep Adam's
    moments twice for the whole run (Figure 2's 170B point: 3.4 GB). The first step invalidates it."""
    engine = build(stage=2, accum=1)
    sd = engine.state_dict()
    owned = sum(m.tensor.numel() for m in engine.sharded_optimizer.masters)
    placeholders = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for k, v in sd.items() if k.startswith("optim.") for _, t in v.chunks}
    assert sum(placeholders.values()) == 8 * owned  # exp_avg and exp_avg_sq, fp32
    _step(engine, 0)
    assert _held_only_by(sd, engine) == 0
    assert all(float(s["step"]) == 1.0 for s in engine.optimizer.state.values())  # a fresh optimizer's first


def test_the_wrapped_models_own_state_dict_never_misleads():
    # Stage 3: each rank holds 1/N of every parameter, so both directions refuse.
    engine = build(stage=3)
    for call in (lambda: engine.module.state_dict(), lambda: engine.module.load_state_dict({})):
        with pytest.raises(RuntimeError, match="at ZeRO stage 3 each rank holds 1/N"):
            call()
    engine.close()
    assert engine.module.state_dict()  # the model is its own again
    # Stage 2 in bf16: new weights loaded into the model reach the fp32 masters (a step with
    # lr = 0 used to bring the stale masters back).
    engine = build(stage=2, precision="bf16")
    new = {k: torch.full_like(v, 0.5) for k, v in make_model().state_dict().items()}
    engine.module.load_state_dict(new)
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0
    tokens = global_batch(0, 1, 1)[0, 0]
    engine.backward(lm_loss(engine(tokens), tokens))
    engine.step()
    assert all(torch.all(p == 0.5) for p in engine.full_parameters().values())
    with pytest.raises(RuntimeError, match="assign=True"):
        engine.module.load_state_dict(new, assign=True)
    with pytest.raises(RuntimeError, match="inside a gradient accumulation"):
        _mid_accumulation_state_dict()


def _mid_accumulation_state_dict():
    engine = build(stage=1, accum=2)
    tokens = global_batch(0, 1, 2)[0, 0]
    engine.backward(lm_loss(engine(tokens), tokens))
    engine.step()
    engine.state_dict()


def _train_and_save(path: str) -> dict:
    engine = build(make_model(tie_blocks=True), stage=3)
    train(engine, 0, 2)
    checkpoint.save(engine, path)
    return engine.full_parameters()


def test_export_loads_into_the_bare_model(tmp_path):
    """One fp32 file, keyed like the bare model's state_dict() (a weight tied across two
    blocks under both names), from the command line."""
    params = spawn(_train_and_save, 2, str(tmp_path / "step_2"), timeout=120)[0]
    done = subprocess.run([sys.executable, "-m", "zero_impl", "export", str(tmp_path / "step_2"),
                           str(tmp_path / "model.pt")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and not done.stderr, done.stderr
    model = make_model(tie_blocks=True)
    model.load_state_dict(torch.load(tmp_path / "model.pt"))  # strict: every key, no extra
    assert max_abs_diff(dict(model.named_parameters()), params) == 0.0
    assert "blocks.1.fc.weight" in torch.load(tmp_path / "model.pt")
