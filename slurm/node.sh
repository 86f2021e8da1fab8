#!/usr/bin/env bash
# One node's share of a job, as srun starts it once per node (slurm/launch.sh): the command given
# (torchrun), told this node's address as Slurm has it ($ZERO_REPRO_NODE_ADDRS, "name=address ...",
# from experiments/slurm_nodes.py) through PET_LOCAL_ADDR, torchrun's --local-addr. That is the
# address this node publishes to the others (its ranks' MASTER_ADDR when it hosts rank 0);
# without it torchrun publishes the host's FQDN, which need not resolve on the other nodes.
for pair in ${ZERO_REPRO_NODE_ADDRS:-}; do
    if [ "${pair%%=*}" = "${SLURMD_NODENAME:-}" ]; then export PET_LOCAL_ADDR="${pair#*=}"; fi
done
# gloo (the CPU jobs' backend) binds where the host's name resolves, 127.0.1.1 on Ubuntu, which
# no other node reaches: where unset, its interface is the one holding this node's address.
if [ -z "${GLOO_SOCKET_IFNAME:-}" ] && [ -n "${PET_LOCAL_ADDR:-}" ]; then
    ifname="$(ip -o addr show 2>/dev/null | awk -v a="$PET_LOCAL_ADDR" '{split($4, p, "/")} p[1] == a {print $2; exit}')"
    if [ -n "$ifname" ]; then export GLOO_SOCKET_IFNAME="$ifname"; fi
fi
# torchrun's --rdzv-conf. is_host: the rendezvous' store is served by the first node
# ($ZERO_REPRO_RDZV_HEAD) and by no other. Left to torch, each node guesses by resolving its own
# hostname against the endpoint, which fails where the hostname maps to 127.0.1.1 (Ubuntu's
# default), the NodeAddr is another NIC, or the name resolves nowhere; told, a head that cannot
# bind the port fails at once instead of joining as a client of nobody. read_timeout: a store
# operation may wait for nodes still starting (600 s, not 60). join_timeout: 25 nodes importing
# torch from a shared file system may take longer than torch's 600 s to all arrive.
is_host=0
if [ "${SLURMD_NODENAME:-}" = "${ZERO_REPRO_RDZV_HEAD:-}" ]; then is_host=1; fi
export PET_RDZV_CONF="is_host=$is_host,read_timeout=600"
if (( ${SLURM_STEP_NUM_NODES:-1} > 1 )); then PET_RDZV_CONF+=",join_timeout=900"; fi
exec "$@"
