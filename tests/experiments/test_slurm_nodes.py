"""The address a job's nodes are reached at, as a function of what Slurm reports
(experiments/slurm_nodes.py), and slurm/launch.sh's use of it: the rendezvous at the first node's
NodeAddr, each node's torchrun told its own (slurm/node.sh)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from experiments.slurm_nodes import node_addresses, rendezvous_port
from slurm_stubs import REPO, run_launch, srun_arguments, srun_environment

# `scontrol show node -o node1,node2` on the test tier's cluster (Slurm 22.05), shortened
ONE_LINE = (
    "NodeName=node1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 Gres=(null) NodeAddr=10.1.0.7 "
    "NodeHostName=node1 Version=22.05.8 OS=Linux 6.1.0 #1 SMP PREEMPT_DYNAMIC  RealMemory=23081 State=IDLE\n"
    "NodeName=node2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 Gres=(null) NodeAddr=10.1.0.8 "
    "NodeHostName=node2 Port=6819 Version=22.05.8 OS=Linux 6.1.0 #1 SMP PREEMPT_DYNAMIC  RealMemory=23081\n")
# `scontrol show node gpu-a` (the default multi-line form), a node configured with no NodeAddr
MULTI_LINE = """NodeName=gpu-a Arch=x86_64 CoresPerSocket=16
   CPUAlloc=0 CPUEfctv=64 CPUTot=64 CPULoad=0.01
   NodeAddr=gpu-a NodeHostName=gpu-a Version=22.05.8
   OS=Linux 5.15.0 #1 SMP

NodeName=gpu-b Arch=x86_64 CoresPerSocket=16
   NodeAddr=fd00::b NodeHostName=gpu-b Version=22.05.8
"""


def test_each_node_is_reached_at_its_nodeaddr():
    assert node_addresses(["node1", "node2"], ONE_LINE) == {"node1": "10.1.0.7", "node2": "10.1.0.8"}
    assert node_addresses(["gpu-b", "gpu-a"], MULTI_LINE) == {"gpu-b": "fd00::b", "gpu-a": "gpu-a"}


def test_a_node_slurm_gives_no_address_keeps_its_name():
    assert node_addresses(["node1", "node3"], ONE_LINE) == {"node1": "10.1.0.7", "node3": "node3"}
    assert node_addresses(["node1"], "") == {"node1": "node1"}  # scontrol could not say
    assert node_addresses(["n1"], "NodeName=n1 NodeAddr=(null) NodeHostName=n1") == {"n1": "n1"}
    assert node_addresses(["n1"], "NodeName=n1 NodeHostName=n1 NodeAddr=") == {"n1": "n1"}
    # a field that only ends in NodeAddr is not it
    assert node_addresses(["n1"], "NodeName=n1 MyNodeAddr=10.0.0.1") == {"n1": "n1"}


def test_launch_rendezvouses_at_the_first_nodes_address_and_says_so(tmp_path):
    done = run_launch(tmp_path, "gpus=2", nodes=("node1", "node2"), show_node=ONE_LINE)
    assert done.returncode == 0, done.stderr
    port = 10000 + 4242
    assert f"2 node(s) x 1 ranks, rendezvous 10.1.0.7:{port} (node1's NodeAddr)" in done.stdout
    assert f"--rdzv-endpoint=10.1.0.7:{port}" in srun_arguments(tmp_path)
    assert srun_environment(tmp_path)["ZERO_REPRO_RDZV_HEAD"] == "node1"  # slurm/node.sh's is_host


def test_launch_falls_back_to_the_name_only_where_slurm_has_no_address(tmp_path):
    done = run_launch(tmp_path, "gpus=2", nodes=("gpu-a", "gpu-b"), show_node=MULTI_LINE)
    assert done.returncode == 0, done.stderr
    assert "rendezvous gpu-a:14242 (gpu-a's name: Slurm gives it no NodeAddr)" in done.stdout
    (tmp_path / "v6").mkdir()
    done = run_launch(tmp_path / "v6", "gpus=1", nodes=("gpu-b",), show_node=MULTI_LINE)
    assert "--rdzv-endpoint=[fd00::b]:14242" in srun_arguments(tmp_path / "v6")


def test_each_nodes_torchrun_is_told_its_own_address(tmp_path):
    """slurm/node.sh: torchrun's --local-addr (PET_LOCAL_ADDR) is this node's NodeAddr, the
    address its ranks' peers connect to when it holds rank 0 (torch's default: the host's FQDN)."""
    addrs = "node1=10.1.0.7 node2=10.1.0.8"
    for node, expected in (("node1", "10.1.0.7"), ("node2", "10.1.0.8"), ("node3", "")):
        env = {**os.environ, "ZERO_REPRO_NODE_ADDRS": addrs, "SLURMD_NODENAME": node}
        env.pop("PET_LOCAL_ADDR", None)
        done = subprocess.run([str(REPO / "slurm" / "node.sh"), "bash", "-c", 'echo "${PET_LOCAL_ADDR:-}"'],
                              env=env, capture_output=True, text=True, timeout=30)
        assert done.stdout.strip() == expected, node


def node_sh_env(node: str, **env: str) -> dict[str, str]:
    """What slurm/node.sh exports to torchrun on `node` of a job whose first node is node1."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "SLURM", "ZERO_REPRO_", "GLOO_"))}
    done = subprocess.run([str(REPO / "slurm" / "node.sh"), "env"], capture_output=True, text=True, timeout=30,
                          env={**base, "ZERO_REPRO_RDZV_HEAD": "node1", "SLURMD_NODENAME": node, **env})
    assert done.returncode == 0, done.stderr
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def test_only_the_first_node_hosts_the_rendezvous_store():
    """is_host is told, not guessed: torch's guess resolves the host's name against the endpoint,
    wrong where the name maps to 127.0.1.1, the NodeAddr is another NIC, or nothing resolves."""
    assert node_sh_env("node1")["PET_RDZV_CONF"] == "is_host=1,read_timeout=600"
    assert node_sh_env("node2")["PET_RDZV_CONF"] == "is_host=0,read_timeout=600"
    assert node_sh_env("node2", SLURM_STEP_NUM_NODES="2")["PET_RDZV_CONF"] == \
        "is_host=0,read_timeout=600,join_timeout=900"


def test_torchrun_reads_the_rendezvous_conf_from_pet_rdzv_conf(monkeypatch):
    """torch's own parser takes --rdzv-conf from PET_RDZV_CONF, and its c10d backend the keys."""
    from torch.distributed.run import get_args_parser
    monkeypatch.setenv("PET_RDZV_CONF", "is_host=0,read_timeout=600,join_timeout=900")
    args = get_args_parser().parse_args(["train.py"])
    assert args.rdzv_conf == "is_host=0,read_timeout=600,join_timeout=900"


def test_a_hostlist_scontrol_cannot_expand_is_refused_in_one_line(tmp_path):
    """Before, the hostlist itself became the first node's name: endpoint 'node[1-2]:PORT', and
    torchrun's ValueError on every node."""
    done = run_launch(tmp_path, "gpus=2", nodes=("node1", "node2"), scontrol_fails="hostnames")
    assert done.returncode == 2 and srun_arguments(tmp_path) is None
    assert done.stderr == ("error: scontrol show hostnames node1,node2 failed: slurm_load_node error: Unable to "
                           "contact slurm controller (connect failure)\n")
    status = json.loads((tmp_path / "results" / "4242" / "job_status.json").read_text())
    assert status["status"] == "invalid" and status["message"].startswith("scontrol show hostnames")


def test_without_scontrol_show_node_the_head_is_where_srun_saw_the_batch_node(tmp_path):
    """scontrol show node failing is logged with scontrol's words, and the first node (the batch
    node) is reached at SLURM_LAUNCH_NODE_IPADDR as the check's tasks had it, the others by name."""
    done = run_launch(tmp_path, "gpus=2", nodes=("node1", "node2"), scontrol_fails="node")
    assert done.returncode == 0, done.stderr
    assert "warning: scontrol show node failed (exit code 1: slurm_load_node error: Unable to contact slurm " \
           "controller (connect failure)); node1 at 10.9.9.9, the others by name" in done.stderr
    assert "rendezvous 10.9.9.9:14242 (node1's address as srun saw it: scontrol show node failed)" in done.stdout
    assert srun_environment(tmp_path)["ZERO_REPRO_NODE_ADDRS"].split() == ["node1=10.9.9.9", "node2=node2"]


def test_the_rendezvous_address_and_port_can_be_given(tmp_path):
    done = run_launch(tmp_path, "gpus=2", nodes=("node1", "node2"), show_node=ONE_LINE,
                      ZERO_REPRO_RDZV_ADDR="10.2.0.7", ZERO_REPRO_RDZV_PORT="29400")
    assert done.returncode == 0, done.stderr
    assert "rendezvous 10.2.0.7:29400 (ZERO_REPRO_RDZV_ADDR, on node1)" in done.stdout
    assert "--rdzv-endpoint=10.2.0.7:29400" in srun_arguments(tmp_path)
    (tmp_path / "bad").mkdir()
    done = run_launch(tmp_path / "bad", "gpus=2", ZERO_REPRO_RDZV_PORT="70000")
    assert done.returncode == 2 and done.stderr == "error: ZERO_REPRO_RDZV_PORT=70000 is not a port (1-65535)\n"


def test_the_port_is_below_the_ephemeral_range_for_every_job_id(monkeypatch):
    """10000 + id % 20000: never in Linux's 32768-60999, where a client's port may already hold it
    (20000 + id % 20000 was there for 36% of the ids), as slurm_job.py's store has it too."""
    monkeypatch.delenv("ZERO_REPRO_RDZV_PORT", raising=False)
    assert {rendezvous_port(job) for job in range(100000)} == set(range(10000, 30000))
    monkeypatch.setenv("ZERO_REPRO_RDZV_PORT", "29400")
    assert rendezvous_port(4242) == 29400


def test_a_job_using_fewer_nodes_than_it_holds_names_them_to_both_sruns(tmp_path):
    """run_60b_scaling.sh's elements hold 25 nodes and use the first ones: the check and the ranks
    must run on the nodes the rendezvous was set up for, not on those srun --nodes=N picks."""
    done = run_launch(tmp_path, "gpus=2", nodes=("node1", "node2", "node3"), GPUS_PER_NODE="1", show_node=ONE_LINE)
    assert done.returncode == 0, done.stderr
    assert "--nodelist=node1,node2" in (tmp_path / "check_args").read_text().split()
    assert "--nodelist=node1,node2" in srun_arguments(tmp_path)
    assert json.loads((tmp_path / "results" / "4242" / "job_status.json").read_text())["nodes"] == ["node1", "node2"]


def test_gloo_binds_the_interface_holding_the_nodes_address(tmp_path):
    """Unset, gloo binds where the hostname resolves (127.0.1.1 on Ubuntu): a CPU job across real
    nodes would publish an address no other node reaches. A GLOO_SOCKET_IFNAME given is kept."""
    (tmp_path / "ip").write_text("#!/bin/sh\necho '1: lo    inet 127.0.0.1/8 scope host lo'\n"
                                 "echo '2: eth1    inet 10.1.0.8/24 brd 10.1.0.255 scope global eth1'\n")
    (tmp_path / "ip").chmod(0o755)
    env = {"ZERO_REPRO_NODE_ADDRS": "node1=10.1.0.7 node2=10.1.0.8", "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    assert node_sh_env("node2", **env)["GLOO_SOCKET_IFNAME"] == "eth1"
    assert node_sh_env("node2", **env, GLOO_SOCKET_IFNAME="ib0")["GLOO_SOCKET_IFNAME"] == "ib0"
    assert "GLOO_SOCKET_IFNAME" not in node_sh_env("node3", **env)  # no address known: gloo's own choice
