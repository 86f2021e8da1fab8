"""A sweep: the grid of one experiment (model x stage x GPU count x TP), run point by point.

    python experiments/sweep.py stage=2                      # CPU default grid, stage 2: < 3 min on 2 cores
    python experiments/sweep.py experiment=fig2 dry_run=true # the paper's Figure 2 points, not run
    python experiments/sweep.py model=tiny_m gpus=[1,2,4] stage=[1,3] force=true
    python experiments/sweep.py -m stage=1,2,3               # Hydra multirun: one sweep per stage

Every point is validated before anything starts (bad input: one line on stderr, exit code 2,
nothing written). Each point runs on local ranks (forked processes, or torchrun), under a
timeout; a failed, hung or out-of-memory point is recorded with its status and the sweep goes
on; points that already have an `ok` record are skipped unless force=true. At the end a
Table-5-style summary is printed and written as summary.csv beside the records.
"""
from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

import zero_impl
from experiments import records
from experiments.cli import preflight_or_exit
from experiments.points import (ConfigError, Point, check_runnable_here, expand, local_devices,
                                predicted_memory_bytes, resolve_precision)
from experiments.schema import register
from experiments.train import (build_record, checkpoint_root, classify_failure, run_as_rank, train_rank,
                               with_checkpoint_dir)
from experiments.launch import spawn
from experiments.models.megatron_gpt import parameter_count

register()
REPO = Path(__file__).resolve().parents[1]


def run_point(point: Point, launcher: str, results_dir: Path) -> dict:
    """Run one point on this machine and return its record (also written to results_dir)."""
    precision = resolve_precision(point.train["precision"])
    path = results_dir / f"{point.point_id}.json"
    started = records.now()
    if launcher == "auto":
        launcher = "spawn" if torch.cuda.is_available() else "fork"
    if launcher == "torchrun":
        return _run_with_torchrun(point, precision, path, started)
    root = checkpoint_root(point, results_dir)
    try:
        results = spawn(train_rank, point.gpus, with_checkpoint_dir(point, results_dir), precision, start_method=launcher,
                        timeout=point.train["timeout_s"])
        record = build_record(point, precision, launcher, "ok", results, None, started)
    except Exception as e:  # a rank failed, died or hung: record it and go on
        status, text = classify_failure(e)
        latest = zero_impl.checkpoint.latest(root) if root.exists() else None
        record = build_record(point, precision, launcher, status, None, text, started,
                              resume={"checkpoint": str(latest) if latest else None})
    records.write_record(path, record)
    return record


def _run_with_torchrun(point: Point, precision: str, path: Path, started: str) -> dict:
    overrides = [f"{axis}={getattr(point, axis)}" for axis in ("stage", "gpus", "tp", "micro_batch")]
    overrides += [f"model={point.model['name']}", f"experiment_name={point.experiment}", f"results_dir={path.parent.parent}"]
    overrides += [f"model.{k}={_override_value(v)}" for k, v in point.model.items()]
    overrides += [f"cluster.{k}={_override_value(v)}" for k, v in point.cluster.items()]
    overrides += [f"train.{k}={_override_value(v)}" for k, v in point.train.items()]
    overrides += [f"zero.{k}={_override_value(v)}" for k, v in point.zero.items()]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={point.gpus}",
               str(REPO / "experiments" / "train.py"), *overrides]
    path.unlink(missing_ok=True)  # whatever record is there afterwards is this run's
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=point.train["timeout_s"])
        failure = None if proc.returncode == 0 else f"torchrun exited with {proc.returncode}:\n{stderr[-4000:]}"
        status = "fail"
    except subprocess.TimeoutExpired:
        proc.terminate()  # torchrun passes TERM on to its workers (they run in sessions of their own)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        failure, status = f"timed out after {point.train['timeout_s']:.0f} s", "timeout"
    record = records.read_record(path)
    if record is None or (failure and record.get("status") == "ok"):  # the ranks could not say why
        record = build_record(point, precision, "torchrun", status, None, failure or "no record written", started)
        records.write_record(path, record)
    return record


def _override_value(value) -> str:
    """A value as Hydra's override grammar reads it back unchanged."""
    if value is None:
        return "null"
    if isinstance(value, str):
        # Inside quotes Hydra unescapes only backslashes that precede a quote (or the end).
        quoted = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
        return "'" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, quoted) + "'"
    return str(value).lower() if isinstance(value, bool) else str(value)


def summary_rows(points: list[Point], results_dir: Path) -> list[dict]:
    rows = []
    for point in points:
        record = records.read_record(results_dir / f"{point.point_id}.json") or {}
        memory = record.get("memory", {})
        comm = record.get("comm", {})
        gb = 1e9
        rows.append({
            "model": point.model["name"], "params_B": round(record.get("params", 0) / 1e9, 4),
            "gpus": point.gpus, "tp": point.tp, "dp": point.dp, "stage": point.stage,
            "batch": point.global_batch, "tflops_per_gpu": record.get("tflops_per_gpu"),
            "mem_pred_GB": memory.get("predicted", {}).get("total", 0) / gb,
            "mem_meas_GB": memory.get("measured_max_over_ranks", {}).get("total", 0) / gb if record.get("status") == "ok" else None,
            "peak_GB": memory.get("measured_max_over_ranks", {}).get("peak_bytes", 0) / gb if record.get("status") == "ok" else None,
            "comm_elements": comm.get("elements_per_step"), "comm_theory": comm.get("theory_elements_per_step"),
            "status": record.get("status", "missing"), "point_id": point.point_id})
    return rows


def print_summary(rows: list[dict]) -> None:
    print("| model | params (B) | GPUs | TP | DP | stage | batch | TFLOPs/GPU | model states/GPU pred | meas "
          "| peak/GPU | comm/step | theory | status |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        tflops = f"{r['tflops_per_gpu']:.4f}" if r["tflops_per_gpu"] is not None else "-"
        meas = _bytes(r["mem_meas_GB"] * 1e9) if r["mem_meas_GB"] is not None else "-"
        peak = _bytes(r["peak_GB"] * 1e9) if r["peak_GB"] else "-"
        comm = f"{r['comm_elements']:,}" if r["comm_elements"] is not None else "-"
        theory = f"{r['comm_theory']:,}" if r["comm_theory"] is not None else "-"
        print(f"| {r['model']} | {r['params_B']:.4f} | {r['gpus']} | {r['tp']} | {r['dp']} | {r['stage']} | {r['batch']} "
              f"| {tflops} | {_bytes(r['mem_pred_GB'] * 1e9)} | {meas} | {peak} | {comm} | {theory} | {r['status']} |")


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def write_summary_csv(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def dry_run(points: list[Point]) -> None:
    """List the points with their shapes, GPU counts and predicted peak memory per GPU (model
    states, activations of the micro-batch, engine buffers: points.predicted_memory_bytes); a
    point fits when the total is within the cluster's device_memory_gb (x 1e9 bytes, as the
    paper's Table 2). Run nothing."""
    print("memory per GPU: the larger of backward's Table 1 model states + activations (Korthikanti et al. 2022, "
          "dropout masks counted, checkpoints replicated over TP unless the point's ZeRO-R Pa partitions them, on "
          "the host with Pa+cpu) + engine buffers, and the optimizer step's model states + its temporaries; 'fits' "
          "against cluster.device_memory_gb")
    print("| point | layers | hidden | heads | params (B) | GPUs | TP | DP | stage | batch | micro-batch | recompute "
          "| model states/GPU | activations/GPU | buffers/GPU | step temporaries/GPU | total/GPU | fits device "
          "| runnable here |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---|")
    for p in points:  # described for the target cluster's GPUs: "auto" means half precision there
        precision = p.train["precision"] if p.train["precision"] != "auto" else "fp16"
        predicted = predicted_memory_bytes(p, precision)
        device_gb = p.cluster["device_memory_gb"]
        fits = "-" if device_gb is None else ("yes" if predicted["total"] <= device_gb * 1e9 else "no")
        here = "yes" if p.gpus <= local_devices(p.cluster)[0] else "no"
        print(f"| {p.point_id} | {p.shape.layers} | {p.shape.hidden} | {p.shape.heads} "
              f"| {parameter_count(p.shape, p.tp) / 1e9:.3f} | {p.gpus} "
              f"| {p.tp} | {p.dp} | {p.stage} | {p.global_batch} | {p.micro_batch} "
              f"| {'yes' if p.train['recompute'] else 'no'} | {_bytes(predicted['model_states'])} "
              f"| {_bytes(predicted['activations'])} | {_bytes(predicted['buffers'])} "
              f"| {_bytes(predicted['step_temporaries'])} | {_bytes(predicted['total'])} "
              f"| {fits} | {here} |")


def run_sweep(cfg: DictConfig) -> int:
    points = expand(cfg)
    print(f"experiment {cfg.experiment.name}: {len(points)} points. {cfg.experiment.description}")
    if cfg.dry_run:
        dry_run(points)
        return 0
    if cfg.simulate and cfg.simulate_largest:  # the largest model of each row's family that fits (experiments/largest.py)
        from experiments.largest import run_sweep_largest
        return run_sweep_largest(points, _absolute(cfg.results_dir) / cfg.experiment.name, rank=cfg.simulate_rank,
                                 workers=cfg.simulate_workers)
    if cfg.simulate:  # one rank of each point's full world, on fake tensors (experiments/simulate.py)
        from experiments.simulate import run_sweep_simulated
        return run_sweep_simulated(points, _absolute(cfg.results_dir) / cfg.experiment.name, rank=cfg.simulate_rank,
                                   workers=cfg.simulate_workers, force=cfg.force)
    check_runnable_here(points)
    results_dir = _absolute(cfg.results_dir) / cfg.experiment.name
    for point in tqdm(points, desc=cfg.experiment.name, unit="point", file=sys.stderr):
        if _done(point, results_dir, cfg.force):
            tqdm.write(f"skip {point.point_id}: ok record exists (force=true re-runs it)", file=sys.stderr)
            continue
        record = run_point(point, cfg.launcher, results_dir)
        tqdm.write(f"{record['status']:7s} {point.point_id}", file=sys.stderr)
    rows = summary_rows(points, results_dir)
    print_summary(rows)
    write_summary_csv(rows, results_dir / "summary.csv")
    print(f"records and summary.csv in {results_dir}")
    return 0


def run_in_slurm_job(cfg: DictConfig, job) -> None:
    """Inside a job of the submitit launcher, one task per GPU: every task is one rank of each
    of the job's points in turn; rank 0 writes the records."""
    results_dir = _absolute(cfg.results_dir) / cfg.experiment.name
    for point in expand(cfg):
        if _done(point, results_dir, cfg.force):
            continue  # every task reads the same file, so every task skips alike
        os.environ.update(RANK=str(job.global_rank), WORLD_SIZE=str(job.num_tasks), LOCAL_RANK=str(job.local_rank),
                          MASTER_ADDR=job.hostnames[0], MASTER_PORT=str(20000 + int(job.raw_job_id) % 20000))
        try:
            run_as_rank(point, results_dir.parent, "slurm (submitit)")
        except Exception as e:  # rank 0 has recorded why; the job goes on to its next point
            print(f"point {point.point_id} failed: {type(e).__name__}: {e}", file=sys.stderr)


def _done(point: Point, results_dir: Path, force: bool) -> bool:
    existing = records.read_record(results_dir / f"{point.point_id}.json")
    return bool(existing) and existing.get("status") == "ok" and not force


def _absolute(path: str) -> Path:
    """Relative paths are relative to where the command was started, wherever the job runs."""
    from hydra.core.hydra_config import HydraConfig
    start = Path(HydraConfig.get().runtime.cwd) if HydraConfig.initialized() else Path.cwd()
    return start / path


def _submitit_job():
    """submitit's job environment when this process is a task of a Slurm job it submitted."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return None
    import submitit
    return submitit.JobEnvironment()


@hydra.main(config_path="../conf", config_name="sweep", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        job = _submitit_job()
        if job is not None:
            run_in_slurm_job(cfg, job)
        else:
            run_sweep(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def _validate(cfg: DictConfig, remote: bool) -> None:
    points = expand(cfg)
    if remote:  # one Slurm job per multirun job, one task per GPU: one GPU count per job
        if cfg.gpus is None or isinstance(cfg.gpus, (list, tuple)) or OmegaConf.is_list(cfg.gpus):
            raise ConfigError("with a Slurm launcher, give gpus one value (tasks per job follow it), e.g. gpus=8")
    elif cfg.simulate and not cfg.dry_run:
        from experiments.simulate import check_simulate_rank
        check_simulate_rank(points, cfg.simulate_rank)
    elif not cfg.dry_run and cfg.launcher != "torchrun":
        check_runnable_here(points)
        if cfg.launcher == "fork" and torch.cuda.is_available():
            raise ConfigError("launcher=fork cannot start GPU ranks (CUDA does not survive fork); use auto, spawn or torchrun")


if __name__ == "__main__":
    preflight_or_exit("sweep", sys.argv[1:], _validate)
    main()
