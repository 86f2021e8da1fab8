"""Checkpoints through torch.distributed.checkpoint (DCP): each rank writes its own shards, in
parallel, and any DP degree, stage or bucket size reads them back (the TP degree is fixed).

    zero_impl.checkpoint.save(engine, "ckpt/step_100")   # every rank; atomic (tmp dir, then rename)
    zero_impl.checkpoint.load(engine, "ckpt/step_100")   # every rank; any DP degree, stage, buckets
    latest, unfinished = zero_impl.checkpoint.resume_point("ckpt")  # every rank: rank 0's listing
    python -m zero_impl export ckpt/step_100 model.pt    # one fp32 file for the bare model

As torch.distributed.checkpoint separates its state dicts from its saver and loader:
state_dict.py maps a live engine to its DCP state dict and back (engine.state_dict() and
load_state_dict()); files.py puts that state dict on disk and reads it back.
"""
from .files import export, latest, load, resume_point, save, unfinished
from .manifest import verify

__all__ = ["save", "load", "latest", "unfinished", "resume_point", "verify", "export"]
