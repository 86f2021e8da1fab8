"""slurm/launch.sh without a Slurm: the script runs with stub `srun`, `scontrol` and `python` first
on PATH. The stub srun writes the ranks' step's arguments and environment to `srun_args` and
`srun_env`, and runs launch.sh's node check once per node (NODE_CHECK); the stub scontrol
expands the job's nodes, shows them with `show_node`'s text and records a requeue; the stub
python accepts the overrides' check and runs the real interpreter otherwise (launch.sh writes
job_status.json and asks experiments/slurm_nodes.py with it). tests/experiments/test_slurm.py runs a real cluster."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# The node check's srun: runs launch.sh's check once per node of --nodelist, as that node
# (SLURMD_NODENAME, SLURM_GPUS_ON_NODE from $STUB_GPUS "name=count ..." else the job's, SLURM_LAUNCH_NODE_IPADDR
# 10.9.9.9); a node in $STUB_UNSEEN is given markers that do not exist (it cannot see them; only
# those under a path holding $STUB_UNSEEN_IN where set);
# STUB_CHECK_FAILS=1: srun fails as when the step cannot start, printing nothing on stdout;
# STUB_CHECK_TERM=1: Slurm's TERM reaches launch.sh during the check.
NODE_CHECK = r"""
if [ -n "${STUB_CHECK_TERM:-}" ]; then kill -TERM 0; fi  # launch.sh's process group, as Slurm signals a step
if [ -n "${STUB_CHECK_FAILS:-}" ]; then echo "srun: error: Unable to create step for job 4242: Invalid node name" >&2; exit 1; fi
printf "%s\\n" "$@" > "$STUB_DIR/check_args"
while [[ "$1" == -* ]]; do case "$1" in --nodelist=*) nodes="${1#--nodelist=}" ;; esac; shift; done
printf "%s\n" "$nodes" > "$STUB_DIR/check_nodelist"
for node in ${nodes//,/ }; do
    args=("$@")
    if [[ " ${STUB_UNSEEN:-} " == *" $node "* ]]; then
        for i in "${!args[@]}"; do
            [[ "${args[$i]}" == *"${STUB_UNSEEN_IN:-}"*/.node_check.* ]] && args[$i]="${args[$i]}.missing"
        done
    fi
    gpus="${SLURM_GPUS_ON_NODE:-}"; for pair in ${STUB_GPUS:-}; do [ "${pair%%=*}" = "$node" ] && gpus="${pair#*=}"; done
    SLURMD_NODENAME="$node" SLURM_GPUS_ON_NODE="$gpus" SLURM_LAUNCH_NODE_IPADDR=10.9.9.9 "${args[@]}"
done
"""


def run_launch(tmp_path: Path, *overrides: str, nodes: tuple[str, ...] = ("node1",), show_node: str = "",
               unseen: str = "", gpus: dict[str, int] | None = None, scontrol_fails: str = "",
               launcher: Path = REPO / "slurm" / "launch.sh", **env: str) -> subprocess.CompletedProcess:
    """slurm/launch.sh with `overrides` inside a stub allocation of `nodes` (job 4242; SLURM_*
    variables in `env` are added to it). `unseen`: the nodes that cannot see the markers; `gpus`:
    each node's SLURM_GPUS_ON_NODE; `scontrol_fails`: "hostnames" or "node", the scontrol show
    that exits 1; `launcher`: the launch.sh to run (its folder's parent is the repository)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {"srun": f'if [[ "$*" == *.node_check.* ]]; then {NODE_CHECK}\nexit 0; fi\n'
                     f'printf "%s\\n" "$@" > "{tmp_path}/srun_args"; env > "{tmp_path}/srun_env"\n'
                     # an in-place rewrite (same file, lines shifted), as an editor saving over it
                     'if [ -n "${STUB_EDIT:-}" ]; then { echo "# edited"; cat "$STUB_EDIT"; } > "$STUB_EDIT.new"; '
                     'cat "$STUB_EDIT.new" > "$STUB_EDIT"; fi\n'
                     '[ -z "${STUB_SAVED:-}" ] || touch "$ZERO_REPRO_STOP_FILE.saved"; exit "${STUB_RANKS_EXIT:-0}"',
             "scontrol": f'if [ "$2" = {shlex.quote(scontrol_fails or "-")} ]; then\n'
                         f'  echo "slurm_load_node error: Unable to contact slurm controller (connect failure)" >&2; exit 1\nfi\n'
                         f'case "$1 $2" in\n"show hostnames") printf "%s\\n" {" ".join(nodes)} ;;\n'
                         f'"show node") printf "%s\\n" {shlex.quote(show_node)} ;;\n'
                         f'"requeue "*) echo "$@" >> "{tmp_path}/requeued"; [ -z "${{STUB_REQUEUE_FAILS:-}}" ] || '
                         f'{{ echo "scontrol: error: Requeue of job 4242 not permitted" >&2; exit 1; }} ;;\nesac',
             "python": f'if [ "${{ZERO_REPRO_CHECK_ONLY:-}}" = 1 ]; then exit 0; fi; exec "{sys.executable}" "$@"'}
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": str(len(nodes)), "SLURM_JOB_NODELIST": ",".join(nodes),
             "SLURMD_NODENAME": nodes[0]}
    stub = {"STUB_DIR": str(tmp_path), "STUB_UNSEEN": unseen.replace("\n", " "),
            "STUB_GPUS": " ".join(f"{n}={c}" for n, c in (gpus or {}).items())}
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_", "GPUS_PER_NODE", "ZERO_REPRO_"))}
    return subprocess.run([str(launcher), *overrides],
                          env={**base, **slurm, **stub, **env, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                               "PYTHON": str(bin_dir / "python"), "ZERO_REPRO_DIR": str(launcher.parents[1]),
                               "ZERO_REPRO_SLURM_RESULTS": str(tmp_path / "results")},
                          capture_output=True, text=True, timeout=60, start_new_session=True)


def srun_environment(tmp_path: Path) -> dict[str, str]:
    """The environment launch.sh gave the srun that starts the ranks."""
    lines = (tmp_path / "srun_env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def srun_arguments(tmp_path: Path) -> list[str] | None:
    """The arguments launch.sh passed to the srun that starts the ranks; None if it never did."""
    args = tmp_path / "srun_args"
    return args.read_text().splitlines() if args.exists() else None
