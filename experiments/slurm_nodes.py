"""Where a Slurm job's nodes can be reached: each node's address as Slurm itself has it (its
NodeAddr), since node names often resolve nowhere but in Slurm (names that exist only in
slurm.conf, or in a DNS the compute nodes do not use). slurm/launch.sh rendezvouses at the first
node's address and gives each node's torchrun its own; a submitit job's TCPStore is served at
the first node's address (experiments/sweeps/slurm_job.py).

    python -m experiments.slurm_nodes node[1-2]   # one "name address" line per node, in job order
"""
from __future__ import annotations

import re
import subprocess
import sys

_FIELD = r"(?:^|\s){}=(\S*)"


def node_addresses(names: list[str], show_node: str) -> dict[str, str]:
    """{name: address} for `names`, read from `scontrol show node` output (one-line `-o` records or
    the multi-line ones). A node Slurm gives no address (no NodeAddr, an empty or "(null)" one,
    or a node missing from the output) keeps its name: Slurm then reaches it by name too."""
    addresses = {}
    for record in re.split(r"(?=(?:^|\s)NodeName=)", show_node):
        name = re.search(_FIELD.format("NodeName"), record)
        addr = re.search(_FIELD.format("NodeAddr"), record)
        if name and addr and addr.group(1) not in ("", "(null)"):
            addresses[name.group(1)] = addr.group(1)
    return {name: addresses.get(name, name) for name in names}


def query_addresses(names: list[str]) -> dict[str, str]:
    """{name: address} for these node names, asking scontrol. Where scontrol cannot say (not
    installed, the controller unreachable, names it does not know), names stay names."""
    return node_addresses(names, _scontrol("show", "node", "-o", ",".join(names)))


def job_node_addresses(hostlist: str) -> dict[str, str]:
    """{name: address} for a Slurm hostlist (SLURM_JOB_NODELIST), in its order."""
    return query_addresses(_scontrol("show", "hostnames", hostlist).split() or [hostlist])


def _scontrol(*args: str) -> str:
    try:
        done = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m experiments.slurm_nodes <Slurm hostlist, e.g. $SLURM_JOB_NODELIST>", file=sys.stderr)
        return 2
    for name, address in job_node_addresses(argv[0]).items():
        print(name, address)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
