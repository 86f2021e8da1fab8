#!/usr/bin/env bash
# Figure 2's ZeRO-100B point: a 100B GPT (125 layers, hidden 8192, 64 heads, seq 1024) with
# ZeRO-2 (Pos+g) and Megatron MP 16 (one DGX-2 node per model replica) on 400 V100s: 25 nodes x
# 16 GPUs, DP 25, micro-batch 32 per replica (appendix Table 5); the paper reports over 38
# TFLOPs/GPU. ZeRO-100B is Pos+g with ZeRO-R: this runs Table 3's C4 (CB + MD + Pa: each activation
# checkpoint partitioned over the MP group and kept in a contiguous arena); add
# zero.cpu_checkpointing=true for C5.
#
#   sbatch slurm/run_100b.sh
#   sbatch --nodes=1 --gpus-per-node=0 slurm/run_100b.sh cluster=local model=tiny_s gpus=2 tp=2 micro_batch=2
#SBATCH --job-name=zero-100b
#SBATCH --nodes=25
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=16
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
#SBATCH --time=02:00:00
#SBATCH --output=results/slurm/%x-%j.log
# Near the time limit Slurm signals the batch shell; launch.sh checkpoints, requeues, and the
# requeued run resumes from the checkpoint (appending to the same log).
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
##SBATCH --partition=<partition>
##SBATCH --account=<account>
exec "${ZERO_REPRO_DIR:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}/slurm/launch.sh" experiment_name=run_100b model=fig2_100b stage=2 gpus=400 tp=16 \
    micro_batch=32 cluster=dgx2_v100 train.precision=fp16 train.recompute=true \
    zero.partition_activations=true zero.contiguous_memory_optimization=true "$@"
