#!/usr/bin/env bash
# One node's share of a job, as srun starts it once per node (slurm/launch.sh): the command given
# (torchrun), told this node's address as Slurm has it ($ZERO_REPRO_NODE_ADDRS, "name=address ...",
# from experiments/slurm_nodes.py) through PET_LOCAL_ADDR, torchrun's --local-addr. That is the
# address this node publishes to the others (its ranks' MASTER_ADDR when it hosts rank 0);
# without it torchrun publishes the host's FQDN, which need not resolve on the other nodes.
for pair in ${ZERO_REPRO_NODE_ADDRS:-}; do
    if [ "${pair%%=*}" = "${SLURMD_NODENAME:-}" ]; then export PET_LOCAL_ADDR="${pair#*=}"; fi
done
exec "$@"
