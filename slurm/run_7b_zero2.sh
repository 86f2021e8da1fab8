#!/usr/bin/env bash
# The common "ZeRO-2 on a 7B model" run: the 6.7B GPT-3 shape (32 layers, hidden 4096, 32 heads,
# seq 1024) with ZeRO-2 (Pos+g), no model parallelism, on one 8-GPU node (DGX H100), bf16,
# micro-batch 4 per GPU, activation recomputation.
#
#   sbatch slurm/run_7b_zero2.sh
#   sbatch --gpus-per-node=0 slurm/run_7b_zero2.sh cluster=local model=tiny_s gpus=2
#SBATCH --job-name=zero-7b
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
#SBATCH --time=01:00:00
#SBATCH --output=results/slurm/%x-%j.log
# Near the time limit Slurm signals the batch shell; launch.sh checkpoints, requeues, and the
# requeued run resumes from the checkpoint (appending to the same log).
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
##SBATCH --partition=<partition>
##SBATCH --account=<account>
exec "${ZERO_REPRO_DIR:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}/slurm/launch.sh" experiment_name=run_7b_zero2 model=gpt_7b stage=2 gpus=8 tp=1 \
    micro_batch=4 cluster=dgx_h100 train.precision=bf16 train.recompute=true "$@"
