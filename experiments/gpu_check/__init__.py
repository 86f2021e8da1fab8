"""`make gpu-check` (`python -m experiments.gpu_check`): the CUDA path end to end on one GPU."""
