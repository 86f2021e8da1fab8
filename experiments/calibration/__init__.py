"""Micro-benchmarks behind `make calibrate`: this machine's GEMM curve, streaming bandwidth,
per-op overhead (compute.py) and gloo's loopback collectives (collectives.py), measured at the
thread count the sweep's ranks use. experiments/calibrate.py writes them to a generated profile
that experiments/analysis/calibrated.py loads as a Hardware."""
