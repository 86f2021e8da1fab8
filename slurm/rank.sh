#!/usr/bin/env bash
# One rank of a job, as torchrun starts it (slurm/launch.sh passes this script with --no-python):
# the command given; if it dies of a signal (SIGKILL from an operator or the OOM killer, a
# segfault), a line naming its rank and node in $ZERO_REPRO_RANK_DIED, which launch.sh puts in
# the point's record: a rank killed outright records nothing itself, and its node's torchrun and
# then srun end every other rank, rank 0 included, before rank 0 could record it. Only the first
# death is kept (noclobber), and none by TERM: that is how torchrun and srun end the other ranks.
"$@"
code=$?
signal=$(( code - 128 ))
if (( signal > 0 )) && [ "$signal" -ne "$(kill -l TERM)" ] && [ -n "${ZERO_REPRO_RANK_DIED:-}" ]; then
    (set -o noclobber
     echo "rank ${RANK:-?} on ${SLURMD_NODENAME:-$(hostname -s)} died of signal $signal (SIG$(kill -l "$signal"))" \
         > "$ZERO_REPRO_RANK_DIED") 2>/dev/null
fi
exit "$code"
