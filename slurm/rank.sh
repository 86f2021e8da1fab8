#!/usr/bin/env bash
# One rank of a job, as torchrun starts it (slurm/launch.sh passes this script with --no-python):
# the command given; if it dies of a signal (SIGKILL from an operator or the OOM killer, a
# segfault), a line naming its rank and node in $ZERO_REPRO_RANK_DIED, which launch.sh puts in
# the point's record: a rank killed outright records nothing itself, and its node's torchrun and
# then srun end every other rank, rank 0 included, before rank 0 could record it. Only the first
# death is kept (noclobber), and none by TERM: that is how torchrun and srun end the other ranks.
"$@"
code=$?
# A signal's death is 128 + its number (up to 64); 255 and other codes above 128 that name no
# signal are a rank's own exit codes (exit(-1) is 255), which its record explains.
signal=$(( code - 128 ))
if (( signal > 0 && signal <= 64 )) && kill -l "$signal" >/dev/null 2>&1 && [ "$signal" -ne "$(kill -l TERM)" ] \
        && [ -n "${ZERO_REPRO_RANK_DIED:-}" ]; then
    (set -o noclobber
     echo "rank ${RANK:-?} on ${SLURMD_NODENAME:-$(hostname -s)} died of signal $signal (SIG$(kill -l "$signal"))" \
         > "$ZERO_REPRO_RANK_DIED") 2>/dev/null
fi
exit "$code"
