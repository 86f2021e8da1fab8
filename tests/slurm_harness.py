"""A real two-node Slurm cluster on this machine, for the tests of slurm/ and the submitit launcher.

The tests run only when asked (`ZERO_REPRO_INSTALL_SLURM=1`, which `make test INSTALL_SLURM=1`
and `.ci/run` set), as root, installing Debian's `slurm-wlm` and `munge` when missing; otherwise
they skip and say why (they start daemons of their own, which a machine with a Slurm must not
get). A slurm.conf in a temporary folder describes two nodes, `node1` and `node2`, each a
`slurmd` of its own on this host (`slurmd -N nodeN`, its own port and spool folder), reached at
127.0.0.1: their names resolve nowhere, as on many clusters, and they share this machine's file
system, as cluster nodes share one, except `node_local`, a folder node2 sees as its own empty
tmpfs (a results folder there is one the other nodes cannot see). `munged`, `slurmctld` and the
`slurmd`s are started, and the cluster is ready when `sinfo` shows both nodes idle. `stop()`
ends the daemons.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")


INSTALL_VARIABLE = "ZERO_REPRO_INSTALL_SLURM"


def ensure_installed() -> str | None:
    """Why the real-Slurm tests cannot run here, or None once Slurm and munge are installed.

    They run only when asked (ZERO_REPRO_INSTALL_SLURM=1): they start their own munged,
    slurmctld and slurmd as root on Slurm's standard ports and end stray slurmstepd processes,
    which a machine with a Slurm of its own (a login or compute node) must never get."""
    if os.environ.get(INSTALL_VARIABLE) != "1":
        return (f"the real-Slurm tests start their own Slurm daemons as root; `make test INSTALL_SLURM=1` "
                f"(or {INSTALL_VARIABLE}=1) runs them, installing Debian's {' and '.join(PACKAGES)} if missing")
    if os.geteuid() != 0:
        return "the real-Slurm tests start Slurm's daemons, which needs root"
    if all(shutil.which(tool) for tool in ("sbatch", "slurmctld", "slurmd", "munged")):
        return None
    if not shutil.which("apt-get"):
        return "Slurm is not installed, and installing it needs apt-get"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
                    ["apt-get", "update", "-q"],
                    ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode == 0 and command[1] == "install":
            return None
    return f"apt-get install {' '.join(PACKAGES)} failed: {done.stderr.strip()[-500:]}"


class LocalSlurm:
    """Two nodes (node1, node2: this host, all its CPUs each), one partition, munge authentication."""

    NODES = ("node1", "node2")
    FIRST_SLURMD_PORT = 6818

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="zero-slurm-"))
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.dir / "slurm.conf"
        self.node_local: Path | None = self.dir / "node_local"  # node2 mounts a tmpfs of its own here
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.procs: list[subprocess.Popen] = []
        self.first_job_id = 1000 + int(time.time()) % 50000  # never a job id a stale step still holds
        # cred_expire (job step credentials' lifetime, default 120 s) is also how long a requeued
        # job waits before it starts again: 15 s keeps the requeue test short

    def write_conf(self) -> None:
        for sub in ("state", "log", "node_local"):
            (self.dir / sub).mkdir(exist_ok=True)
        cpus = os.cpu_count() or 1
        memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        # Each node declares every CPU of the host (two one-CPU tasks fit on a 2-core machine), and
        # the nodes share them: Slurm counts each node's CPUs alone.
        nodes = "".join(f"NodeName={name} NodeAddr=127.0.0.1 Port={self.FIRST_SLURMD_PORT + i} CPUs={cpus} "
                        f"RealMemory={max(memory_mb - 1024, 1024)} State=UNKNOWN\n"
                        for i, name in enumerate(self.NODES))
        self.conf.write_text(f"""\
ClusterName=zero-repro-test
SlurmctldHost={self.host}
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
StateSaveLocation={self.dir}/state
SlurmdSpoolDir={self.dir}/spool%n
SlurmctldPidFile={self.dir}/slurmctld.pid
SlurmdPidFile={self.dir}/slurmd-%n.pid
SlurmctldLogFile={self.dir}/log/slurmctld.log
SlurmdLogFile={self.dir}/log/slurmd-%n.log
FirstJobId={self.first_job_id}
AuthInfo=cred_expire=15
SlurmctldPort=6817
{nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def start(self, timeout: float = 60) -> None:
        self.write_conf()
        _kill_stale_steps()
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
            subprocess.run(["munged", "--force"], check=True, capture_output=True, timeout=30)
        self._daemon(["slurmctld", "-D", "-f", str(self.conf)])
        for name in self.NODES[:-1]:
            self._daemon(["slurmd", "-D", "-N", name, "-f", str(self.conf)])
        # The last node in a mount namespace of its own, where node_local is a fresh tmpfs: a
        # folder on a disk only that node sees, as /tmp is on most clusters. Where this machine
        # allows no mount namespace, node_local is None (and the test that needs it skips).
        if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0:
            self._daemon(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          f'mount -t tmpfs zero-node-local "$0" && exec slurmd -D -N {self.NODES[-1]} -f "$1"',
                          str(self.node_local), str(self.conf)])
        else:
            self.node_local = None
            self._daemon(["slurmd", "-D", "-N", self.NODES[-1], "-f", str(self.conf)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = dict(line.split() for line in self.run("sinfo", "-h", "-N", "-o", "%N %T").stdout.splitlines())
            if sorted(states) == sorted(self.NODES) and set(states.values()) == {"idle"}:
                return
            for name, state in states.items():
                if state in ("down", "drained", "down*"):
                    self.run("scontrol", "update", f"nodename={name}", "state=resume")
            time.sleep(0.5)
        raise RuntimeError(f"Slurm nodes not idle after {timeout:.0f} s ({states}); logs in {self.dir / 'log'}")

    def _daemon(self, command: list[str]) -> None:
        self.procs.append(subprocess.Popen(command, env=self.env, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL))

    def run(self, *command: str, timeout: float = 600, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """`command` against this cluster, with `env` added to its environment."""
        return subprocess.run(list(command), env={**self.env, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout, cwd=cwd)

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        _kill_stale_steps()
        shutil.rmtree(self.dir, ignore_errors=True)


def _kill_stale_steps() -> None:
    """Job-step daemons outlive slurmd; left over from an earlier cluster they confuse a new one."""
    subprocess.run(["pkill", "-f", "^slurmstepd"], capture_output=True)
