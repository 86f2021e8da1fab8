#!/usr/bin/env bash
# The paper's Section 10.4 / Figure 4 headline: a 13B GPT (62 layers, hidden 4096, 32 heads,
# seq 1024) trained with ZeRO-2 (Pos+g) and no model parallelism on 128 V100 32 GB: 8 DGX-2
# nodes x 16 GPUs, micro-batch 2 per GPU (appendix Table 10), fp16, one activation checkpoint
# per layer. Submit from the repository root:
#
#   sbatch slurm/run_13b.sh
#   sbatch --nodes=1 --gpus-per-node=0 --cpus-per-task=1 slurm/run_13b.sh cluster=local model=tiny_s gpus=2   # a tiny CPU version
#
# Extra arguments are Hydra overrides of experiments/train.py (they win over the ones below).
# Adapt the partition/account lines (and --cpus-per-task) to your cluster; options given to sbatch
# override these #SBATCH lines (the tiny CPU version asks for one CPU, so it runs on any node).
#SBATCH --job-name=zero-13b
#SBATCH --nodes=8
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
exec "${ZERO_REPRO_DIR:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}/slurm/launch.sh" experiment_name=run_13b model=fig4_13b stage=2 gpus=128 tp=1 \
    micro_batch=2 cluster=dgx2_v100 train.precision=fp16 train.recompute=true "$@"
