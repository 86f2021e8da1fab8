"""Many points: a local grid (local.py), a Slurm job's points (slurm_job.py), simulated points (simulated.py),
the largest model that fits (largest.py), and their summaries (summary.py)."""
