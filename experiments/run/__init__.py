"""One point: built once (build.py), run for real (real.py) or simulated on fake tensors (fake.py), and
recorded by one builder (record.py)."""
