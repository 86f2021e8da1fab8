#!/usr/bin/env bash
# Figure 3: the 60B GPT (75 layers, hidden 8192, 32 heads) with ZeRO-2 (Pos+g) at MP 16 on 64,
# 128, 256 and 400 V100s (4, 8, 16, 25 DGX-2 nodes), micro-batch 16, 48, 48, 64 per replica
# (appendix Table 6): one element of a job array per GPU count.
#
#   sbatch slurm/run_60b_scaling.sh        # 4 elements; each allocates 25 nodes and uses what it needs
#   for i in 0 1 2 3; do n=(4 8 16 25); sbatch --array=$i --nodes=${n[$i]} slurm/run_60b_scaling.sh; done
#                                          # each element allocates exactly its nodes
#SBATCH --job-name=zero-60b-scaling
#SBATCH --array=0-3
#SBATCH --nodes=25
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=16
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
#SBATCH --time=02:00:00
#SBATCH --output=results/slurm/%x-%A_%a.log
# Near the time limit Slurm signals the batch shell; launch.sh checkpoints, requeues, and the
# requeued run resumes from the checkpoint (appending to the same log).
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
##SBATCH --partition=<partition>
##SBATCH --account=<account>
GPUS=(64 128 256 400)
MICRO_BATCH=(16 48 48 64)
i="${SLURM_ARRAY_TASK_ID:?submit as a job array (sbatch --array=...)}"
exec "${ZERO_REPRO_DIR:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}/slurm/launch.sh" experiment_name=run_60b_scaling model=fig3_60b stage=2 \
    "gpus=${GPUS[$i]}" tp=16 "micro_batch=${MICRO_BATCH[$i]}" cluster=dgx2_v100 train.precision=fp16 \
    train.recompute=true "$@"
