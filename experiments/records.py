"""Result records: one JSON file per benchmark point, written atomically, validated by schema.

results/runs/<experiment>/<point_id>.json holds the status (ok, oom, timeout, fail, invalid),
the full resolved config, the model, parallel layout, per-step times, TFLOPs/GPU, tokens/s/GPU,
memory (predicted and measured, by kind), communication, losses, the error text when not ok,
versions and hardware. A sweep that is re-run skips points whose record says ok.
"""
from __future__ import annotations

import json
import os
import platform
import secrets
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

STATUSES = ("ok", "oom", "timeout", "fail", "invalid")
REPO = Path(__file__).resolve().parents[1]

# field -> allowed types; None allowed where a number is missing for a failed point
SCHEMA: dict[str, tuple] = {
    "status": (str,), "experiment": (str,), "point_id": (str,), "config": (dict,), "model": (dict,),
    "params": (int,), "params_per_gpu": (int,), "world_size": (int,), "tp": (int,), "dp": (int,),
    "stage": (int,), "precision": (str,), "micro_batch": (int,), "global_batch": (int,),
    "recompute_factor": (int,), "flops_per_iteration": (float, int), "step_times_s": (list,),
    "step_time_s": (float, type(None)), "tflops_per_gpu": (float, type(None)),
    "tokens_per_s_per_gpu": (float, type(None)), "memory": (dict,), "comm": (dict,), "losses": (list,),
    "error": (str, type(None)), "versions": (dict,), "hardware": (dict,), "started": (str,), "finished": (str,),
}
OK_NUMBERS = ("step_time_s", "tflops_per_gpu", "tokens_per_s_per_gpu")


def validate_record(record: dict) -> list[str]:
    """Problems with a record (an empty list when it is well formed)."""
    problems = [f"missing field {k!r}" for k in SCHEMA if k not in record]
    problems += [f"{k!r} is {type(record[k]).__name__}, expected {'/'.join(t.__name__ for t in types)}"
                 for k, types in SCHEMA.items() if k in record and not isinstance(record[k], types)]
    if record.get("status") not in STATUSES:
        problems.append(f"status {record.get('status')!r} not in {list(STATUSES)}")
    if record.get("measured_by") == "simulated":  # experiments/run/fake.py: memory and traffic, no time
        if record.get("status") in ("ok", "oom") and not isinstance(record.get("memory", {}).get("peak_bytes"), int):
            problems.append(f"simulated {record['status']} record without memory.peak_bytes")
        if record.get("status") in ("ok", "oom") and record.get("tflops_per_gpu") is not None:
            problems.append("a simulated record has no TFLOPs (nothing is timed)")
        if record.get("status") != "ok" and not record.get("error"):
            problems.append(f"{record.get('status')} record without an error text")
    elif record.get("status") == "ok":
        problems += [f"ok record without {k!r}" for k in OK_NUMBERS if not isinstance(record.get(k), float)]
        for kind in ("predicted", "measured"):
            if not isinstance(record.get("memory", {}).get(kind, {}).get("total"), (int, float)):
                problems.append(f"ok record without memory.{kind}.total")
        if not isinstance(record.get("comm", {}).get("elements_per_step"), int):
            problems.append("ok record without comm.elements_per_step")
    elif not record.get("error"):
        problems.append(f"{record.get('status')} record without an error text")
    return problems


def write_record(path: Path, record: dict) -> None:
    """Write atomically: a reader sees the old record or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # mode 0666 less the umask, as open() would create it (mkstemp's 0600 would hide the record
    # from the rest of a team on a shared cluster file system)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, default=_jsonable)
        os.replace(tmp, path)
    except BaseException:  # nothing half-written left beside the records
        tmp.unlink(missing_ok=True)
        raise


def _jsonable(value: Any):
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def read_record(path: Path) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def load_records(root: Path, experiment: str | None = None) -> list[dict]:
    """Every record under results/runs (or one experiment's folder), sorted by path; the
    simulated records of a folder's simulated/ subfolder (experiments/run/fake.py) too."""
    folders = [root / experiment] if experiment else sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []
    records = []
    for folder in folders:
        for path in sorted(folder.glob("*.json")) + sorted(folder.glob("simulated/*.json")):  # simulate.py's
            record = read_record(path)
            if record is not None:
                records.append(record)
    return records


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def versions() -> dict[str, str]:
    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"
    return {"python": platform.python_version(), "torch": torch.__version__,
            "megatron-core": version("megatron-core"), "hydra-core": version("hydra-core"),
            "deepspeed": version("deepspeed"), "git_commit": _git("rev-parse", "HEAD"),
            "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no"))}


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def hardware() -> dict[str, Any]:
    info: dict[str, Any] = {"host": platform.node(), "platform": platform.platform(), "cpu": _cpu_model(),
                            "cpu_count": os.cpu_count(), "memory_gb": _memory_gb()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_count=torch.cuda.device_count(), gpu_memory_gb=props.total_memory / 1e9,
                    cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())))
    else:
        info.update(gpu=None, gpu_count=0)
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _memory_gb() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return None
