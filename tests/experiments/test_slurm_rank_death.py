"""slurm/rank.sh: a rank that dies of a signal names itself and its node, once (the real cluster's
SIGKILL on node2 is in tests/experiments/test_slurm.py)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_rank(note: Path, rank: str, node: str, command: str) -> int:
    env = {**os.environ, "ZERO_REPRO_RANK_DIED": str(note), "RANK": rank, "SLURMD_NODENAME": node}
    return subprocess.run([str(REPO / "slurm" / "rank.sh"), "bash", "-c", command], env=env,
                          timeout=30).returncode


def test_the_first_rank_to_die_of_a_signal_is_named_with_its_node(tmp_path):
    note = tmp_path / "rank_died"
    assert run_rank(note, "3", "node2", "kill -KILL $$") == 128 + 9
    assert run_rank(note, "0", "node1", "kill -SEGV $$") == 128 + 11  # a later death keeps the first
    assert note.read_text() == "rank 3 on node2 died of signal 9 (SIGKILL)\n"


def test_exits_and_the_launchers_term_name_nobody(tmp_path):
    """A rank that raises exits non-zero on its own (rank 0's record says why); TERM is how
    torchrun and srun end the ranks left after a failure, never its cause."""
    note = tmp_path / "rank_died"
    assert run_rank(note, "1", "node2", "exit 1") == 1
    assert run_rank(note, "1", "node2", "kill -TERM $$") == 128 + 15
    assert run_rank(note, "1", "node2", "exit 0") == 0
    assert run_rank(note, "1", "node2", "exit 255") == 255  # exit(-1): a code, not signal 127
    assert run_rank(note, "1", "node2", "exit 200") == 200
    assert not note.exists()
