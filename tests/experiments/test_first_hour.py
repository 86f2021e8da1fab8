"""What a new user meets first: printed commands that run as printed, outputs that never
overwrite each other, records others can read, errors as one line, a test suite that leaves the
machine alone."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import commands, records
from experiments.points import ConfigError
from experiments.run.record import simulated_path
from experiments.sweeps.summary import folder_summary_rows, point_summary_line, summary_rows

FIXTURES = Path(__file__).parent / "fixtures" / "records" / "cpu_default"


def test_printed_python_is_the_running_interpreter(monkeypatch, tmp_path):
    """`python` only when PATH finds this interpreter; else its path, relative under the cwd."""
    bin_dir = Path(sys.executable).parent
    monkeypatch.setenv("PATH", str(bin_dir))
    assert commands.python_command() == "python"
    assert commands.torchrun_command(4) == "torchrun --nproc-per-node=4"
    monkeypatch.setenv("PATH", str(tmp_path))  # an un-activated shell: no python of ours on PATH
    monkeypatch.chdir(bin_dir.parent.parent)
    assert commands.python_command() == os.path.relpath(bin_dir / "python")  # .venv/bin/python
    monkeypatch.chdir(tmp_path)
    assert commands.python_command() == str(bin_dir / "python")


def test_printed_hints_run_as_printed_in_a_shell_without_the_venv(monkeypatch, tmp_path, capsys):
    """report.py's missing experiment, the scorecard's and the claims' missing rows, zero_impl's
    usage: each names this interpreter as the printed commands do, not a bare `python`."""
    from omegaconf import OmegaConf

    from experiments import report
    from experiments.reports import predictions, scorecard
    from zero_impl.__main__ import main
    monkeypatch.setenv("PATH", str(tmp_path))  # an un-activated shell: no python of ours on PATH
    monkeypatch.chdir(commands.REPO)
    python = commands.python_command()
    assert python != "python"
    with pytest.raises(ConfigError) as e:
        report._validate(OmegaConf.create({"results_dir": str(tmp_path), "experiment": {"name": "fig2"}}), False)
    assert str(e.value).endswith(f"(run: {python} experiments/sweep.py experiment=fig2)")
    assert scorecard.not_simulated("fig4", searched=True) == (
        f"not in this set: {python} experiments/sweep.py experiment=fig4 simulate=true simulate_largest=true, "
        f"then {python} experiments/report.py")
    assert predictions._fig7_simulated([])[2] == f"simulate it: {python} experiments/sweep.py experiment=fig7 simulate=true"
    assert main([]) == 2
    assert capsys.readouterr().err == f"usage: {sys.executable} -m zero_impl export CHECKPOINT_DIR OUT.pt\n"
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # an activated .venv
    assert main(["export"]) == 2
    assert capsys.readouterr().err == "usage: python -m zero_impl export CHECKPOINT_DIR OUT.pt\n"


def test_train_command_uses_the_launcher_the_point_needs(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    monkeypatch.chdir(commands.REPO)
    assert commands.train_command("gpus=1", 1, 8) == "python experiments/train.py gpus=1"
    assert commands.train_command("gpus=8", 8, 8) == "torchrun --nproc-per-node=8 experiments/train.py gpus=8"
    # several nodes: slurm/launch.sh starts a torchrun per node of the allocation (srun alone sets no RANK)
    assert commands.train_command("gpus=16", 16, 8).startswith("slurm/launch.sh gpus=16   # inside a Slurm allocation of 2")
    monkeypatch.chdir(tmp_path)  # elsewhere, the scripts by their absolute paths
    assert commands.train_command("gpus=1", 1, 8) == f"python {commands.REPO / 'experiments' / 'train.py'} gpus=1"


def test_a_plain_python_run_of_several_ranks_says_how_to_start_them(compose, monkeypatch):
    from experiments.points import expand
    from experiments.train import check_launcher_world
    monkeypatch.chdir(commands.REPO)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    [one], [two] = expand(compose("model=tiny_s", "gpus=[1]", "stage=2")), expand(compose("model=tiny_s", "gpus=[2]", "stage=2"))
    check_launcher_world(one, ["gpus=1"])
    with pytest.raises(ConfigError) as e:
        check_launcher_world(two, ["model=tiny_s", "gpus=2"])
    assert "--nproc-per-node=2 experiments/train.py model=tiny_s gpus=2" in str(e.value)
    assert "experiments/sweep.py model=tiny_s gpus=2" in str(e.value)  # this machine runs 2 CPU ranks
    assert "simulate=true" in str(e.value) and "\n" not in str(e.value)
    [big] = expand(compose("model=tiny_s", "gpus=[16]", "stage=2", "cluster=dgx_h100", "dry_run=true"))
    with pytest.raises(ConfigError) as e:
        check_launcher_world(big, ["model=tiny_s", "gpus=16", "cluster=dgx_h100"])
    assert "slurm/launch.sh model=tiny_s gpus=16" in str(e.value) and "sweep.py" not in str(e.value)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="launcher started 4 ranks"):
        check_launcher_world(two, ["gpus=2"])


def test_summary_csv_covers_every_record_in_its_folder(compose, tmp_path):
    """A second sweep's summary keeps the first sweep's points (summary.csv is the folder's)."""
    for path in FIXTURES.glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    from experiments.points import expand
    sweep = expand(compose("model=tiny_s", "gpus=[1]", "stage=[0,1]"))
    printed = summary_rows(sweep, tmp_path)
    every = folder_summary_rows(sweep, tmp_path)
    assert len(printed) == 2
    assert {r["point_id"] for r in printed} <= {r["point_id"] for r in every}
    assert len(every) == len({r["point_id"] for r in every}) >= len(list(FIXTURES.glob("*.json")))
    fixture = records.read_record(next(FIXTURES.glob("tiny_m-s3-*.json")))
    [row] = [r for r in every if r["point_id"] == fixture["point_id"]]
    assert (row["model"], row["stage"], row["gpus"], row["status"]) == ("tiny_m", 3, 2, fixture["status"])


def test_a_trained_point_is_one_line_with_its_record(tmp_path):
    path = next(FIXTURES.glob("tiny_s-s1-g2-*.json"))
    line = point_summary_line(path)
    record = records.read_record(path)
    assert line.startswith(f"{record['status']}: tiny_s stage 1 on 2 ranks (TP 1)") and str(path) in line
    assert "\n" not in line and f"{record['comm']['elements_per_step']:,}" in line


def test_another_rank_never_replaces_rank_zeros_simulated_record(compose):
    from experiments.points import expand
    [point] = expand(compose("model=tiny_s", "gpus=[4]", "stage=2"))
    assert simulated_path(Path("r"), point) == Path("r/simulated") / f"{point.point_id}.json"
    assert simulated_path(Path("r"), point, 5) == Path("r/simulated") / f"{point.point_id}.rank5.json"


def test_records_are_readable_by_the_rest_of_the_team(tmp_path):
    old = os.umask(0o022)
    try:
        records.write_record(tmp_path / "r.json", {"status": "ok"})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == 0o644
    assert list(tmp_path.iterdir()) == [tmp_path / "r.json"]  # no temporary file left behind


def plan_config(*overrides: str):
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from experiments.points import CONF_DIR
    from experiments.schema import register
    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="plan", overrides=list(overrides))


def test_every_different_plan_has_its_own_folder():
    from experiments.sweeps.plan import plan_name
    cases = [[], ["tps=[1]", "recompute=[true]"], ["deepspeed_config=conf/deepspeed/zero2_fp16.json"],
             ["model.layers=40", "model.hidden=5120", "model.heads=40"], ["train.precision=bf16"],
             ["global_batch=256"]]
    names = [plan_name(cfg, cfg.cluster.name, "gpt_7b") for cfg in (plan_config(*c) for c in cases)]
    assert names[0] == "gpt_7b-dgx2_v100-g8"  # the unrestricted plan keeps its documented name
    assert len(set(names)) == len(names)
    assert names[1] == "gpt_7b-dgx2_v100-g8-tps1-recomputetrue"
    assert "-ds_zero2_fp16_" in names[2] and "l40-h5120-a40" in names[3]


@pytest.mark.parametrize("installed", [False, True])
def test_the_slurm_tests_touch_nothing_unless_asked(monkeypatch, installed):
    """Unasked they skip, whether Slurm is missing or a Slurm of the machine's own is there (its
    daemons must not meet the harness's); asked, as root, they install what is missing."""
    import slurm_harness
    monkeypatch.setattr(slurm_harness.shutil, "which",
                        lambda tool: f"/usr/bin/{tool}" if installed or tool == "apt-get" else None)
    ran = []
    monkeypatch.setattr(slurm_harness.subprocess, "run",
                        lambda *a, **k: ran.append(a) or subprocess.CompletedProcess(a, 1, "", "no network"))
    monkeypatch.setattr(slurm_harness.os, "geteuid", lambda: 0)
    monkeypatch.delenv(slurm_harness.INSTALL_VARIABLE, raising=False)
    assert "INSTALL_SLURM=1" in slurm_harness.ensure_installed() and ran == []
    monkeypatch.setenv(slurm_harness.INSTALL_VARIABLE, "1")
    monkeypatch.setattr(slurm_harness.os, "geteuid", lambda: 1000)
    assert "root" in slurm_harness.ensure_installed() and ran == []
    monkeypatch.setattr(slurm_harness.os, "geteuid", lambda: 0)
    assert (slurm_harness.ensure_installed() is None) == installed
    assert bool(ran) != installed and (installed or ran[0][0][0] == "apt-get")


def preflight_error(config_name: str, *argv: str) -> str:
    from experiments.cli import preflight
    with pytest.raises(ConfigError) as e:
        preflight(config_name, list(argv), lambda cfg, remote: None)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_misspelled_key_names_the_nearest_one():
    assert preflight_error("sweep", "stag=2") == \
        "Could not override 'stag'; Key 'stag' not in 'SweepConfig'; did you mean 'stage'?"
    assert preflight_error("sweep", "zero.reduce_bucket_siz=5").endswith("did you mean 'zero.reduce_bucket_size'?")
    assert "did you mean" not in preflight_error("sweep", "qqqqqq=1")


def test_a_wrongly_typed_value_reads_without_omegaconfs_templates():
    text = preflight_error("sweep", "train.steps=abc")
    assert "'abc' of type 'str' could not be converted to Integer" in text and "$VALUE" not in text


@pytest.mark.parametrize("config_name,key", [("sweep", "results_dir"), ("plan", "results_dir"),
                                             ("train", "results_dir"), ("report", "out_dir")])
def test_an_output_folder_that_is_a_file_is_refused_before_any_work(tmp_path, config_name, key):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert preflight_error(config_name, f"{key}={a_file}") == f"{key}={a_file} is a file: give a folder"
    assert "which is a file" in preflight_error(config_name, f"{key}={a_file}/sub")


def test_export_of_a_bad_path_is_one_line_and_exit_2(tmp_path, capsys):
    from zero_impl.__main__ import main
    assert main(["export", str(tmp_path / "nope"), str(tmp_path / "out.pt")]) == 2
    assert capsys.readouterr().err == f"error: CHECKPOINT_DIR {tmp_path / 'nope'} is not a folder\n"
    assert main(["export", str(tmp_path), str(tmp_path / "out.pt")]) == 2
    assert "no .metadata" in capsys.readouterr().err


def test_ctrl_c_is_one_line_exit_130_and_the_running_point_is_recorded(compose, tmp_path, monkeypatch, capsys):
    from experiments.cli import exit_on_interrupt
    from experiments.points import expand
    from experiments.sweeps import local

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(local, "spawn", interrupted)
    [point] = expand(compose("model=tiny_s", "gpus=[2]", "stage=2"))
    with pytest.raises(KeyboardInterrupt):
        local.run_point(point, "fork", tmp_path)
    record = records.read_record(tmp_path / f"{point.point_id}.json")
    assert record["status"] == "fail" and "interrupted" in record["error"]  # a re-run runs it again
    with pytest.raises(SystemExit) as e:
        exit_on_interrupt("how to go on")(interrupted)()
    assert e.value.code == 130 and capsys.readouterr().err == "\ninterrupted: how to go on\n"


def test_make_notebook_executes_the_figures_notebook_into_an_ignored_folder():
    """`make notebook` runs notebooks/figures.ipynb with nbclient (Jupyter's nbconvert is not
    installed) from notebooks/, and writes the executed copy where git ignores it."""
    recipe = subprocess.run(["make", "-n", "notebook", "STAMP="], cwd=commands.REPO, capture_output=True, text=True,
                            check=True).stdout
    assert "nbclient.NotebookClient(" in recipe and "nbformat.read('notebooks/figures.ipynb'" in recipe
    assert "'path': 'notebooks'" in recipe
    written = "results/reports/figures.ipynb"
    assert f"nbformat.write(nb, '{written}')" in recipe
    assert subprocess.run(["git", "check-ignore", "-q", written], cwd=commands.REPO).returncode == 0
    assert "make notebook" in (commands.REPO / "docs" / "experiments.md").read_text()


def test_a_simulated_experiments_report_points_the_prediction_check_at_the_cpu_records(tmp_path):
    """After `make run`, `report.py experiment=fig2` (simulated records, no step times) says where
    the prediction check runs, not "run `make run` first"."""
    shutil.copytree(commands.REPO / "results" / "reference" / "runs" / "fig2", tmp_path / "fig2")
    done = subprocess.run([sys.executable, "experiments/report.py", "experiment=fig2", f"results_dir={tmp_path}",
                           f"out_dir={tmp_path / 'out'}"], cwd=commands.REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("prediction_check")]
    assert "records are simulated" in line and line.endswith("experiments/report.py experiment=cpu_default")
    assert "make run" not in done.stdout and "make calibrate" not in done.stdout
