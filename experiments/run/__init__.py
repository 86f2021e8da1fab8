"""One point: built once (build.py), run for real (real.py) or simulated on fake tensors (fake.py), and
recorded by one builder (record.py); its ranks agree on its outcome before any goes on (outcome.py)."""
