"""Where a Slurm job's nodes can be reached: each node's address as Slurm itself has it (its
NodeAddr), since node names often resolve nowhere but in Slurm (names that exist only in
slurm.conf, or in a DNS the compute nodes do not use). slurm/launch.sh rendezvouses at the first
node's address and gives each node's torchrun its own; a submitit job's TCPStore is served at
the first node's address (experiments/sweeps/slurm_job.py).

    python -m experiments.slurm_nodes node1 node2   # "name address how" a node, in order
"""
from __future__ import annotations

import os
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
    """{name: address} for these node names, asking scontrol (slurm_job.py's store)."""
    return {name: address for name, (address, _) in located(names).items()}


def located(names: list[str], head_fallback: str = "") -> dict[str, tuple[str, str]]:
    """{name: (address, how)} for these node names, how being "nodeaddr" (Slurm's NodeAddr),
    "launch" (`head_fallback`, the first node's address as srun's tasks saw it: only where
    `scontrol show node` failed) or "name" (Slurm has no address, or scontrol could not say:
    why goes to stderr, for the job's log)."""
    try:
        done = subprocess.run(["scontrol", "show", "node", "-o", ",".join(names)], capture_output=True, text=True,
                              timeout=60)
        failed = done.returncode != 0 and f"exit code {done.returncode}: {' '.join(done.stderr.split())[-300:]}"
    except (OSError, subprocess.TimeoutExpired) as e:
        done, failed = None, str(e)
    if failed:
        fallback = f"{names[0]} at {head_fallback}, the others" if head_fallback else "the nodes"
        print(f"warning: scontrol show node failed ({failed}); {fallback} by name", file=sys.stderr)
        return {name: (head_fallback, "launch") if head_fallback and i == 0 else (name, "name")
                for i, name in enumerate(names)}
    return {name: (address, "name" if address == name else "nodeaddr")
            for name, address in node_addresses(names, done.stdout).items()}


def rendezvous_port(job_id: int) -> int:
    """A job's rendezvous port, as slurm/launch.sh picks it: ZERO_REPRO_RDZV_PORT, else 10000 +
    job id % 20000, below Linux's ephemeral range (32768-60999, the OS's pick for clients' ports)
    and distinct for 20000 consecutive jobs."""
    return int(os.environ.get("ZERO_REPRO_RDZV_PORT") or 10000 + job_id % 20000)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m experiments.slurm_nodes <node name>...", file=sys.stderr)
        return 2
    for name, (address, how) in located(argv, os.environ.get("SLURM_LAUNCH_NODE_IPADDR", "")).items():
        print(name, address, how)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
