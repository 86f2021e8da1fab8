#!/usr/bin/env bash
# Any one point, as experiments/plan.py prints it: the overrides say what runs, sbatch's options
# say where. Submit from the repository root:
#
#   sbatch --nodes=1 --gpus-per-node=8 slurm/run_point.sh model=gpt_7b stage=2 gpus=8 tp=1 micro_batch=4 cluster=dgx_h100
#
# The arguments are Hydra overrides of experiments/train.py (gpus= must equal nodes x GPUs per
# node). Adapt the partition/account lines (and --cpus-per-task) to your cluster; options given to
# sbatch override these #SBATCH lines.
#SBATCH --job-name=zero-point
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
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
exec "${ZERO_REPRO_DIR:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}/slurm/launch.sh" experiment_name=run_point "$@"
