"""What ProcessGroupNCCL allocates behind list-based collectives, allocated for the fake backend.

torch's fake process group moves no data and allocates nothing, so a simulated rank would not
see the one device buffer NCCL's backend hides behind a list collective (ProcessGroupNCCL.cpp,
`allgather` and `reduce_scatter` with equal sizes):

- an all-gather into a list of outputs gathers into `newLikeFlat(outputs)`, one flat tensor the
  size of the whole output, kept in the Work's outputs until the Work is dropped, then copies
  it out into the list;
- a reduce-scatter of a list of inputs first copies them into `newLikeFlat(inputs)`, kept with
  the Work (stashed for the allocator) until it is waited on;
- either way the input is stashed until the Work is waited on.

`NcclListBuffers` makes `torch.distributed.all_gather` / `reduce_scatter` do the same on the fake
backend (any caller: the engine, megatron, torch itself), so the simulated rank (run/fake.py)
counts the buffer; a synchronous call holds it for the length of the call, as NCCL's Work is
waited on and dropped inside it. Tensor collectives (all_gather_into_tensor,
reduce_scatter_tensor, all_reduce), the only ones zero_impl issues, have no such buffer. Enter it
outside CollectiveCounter, which must stay the function its callers call (it reads their frame).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _HeldWork:
    """A fake Work holding what NCCL's would: `outputs` until dropped, `stash` until waited."""

    def __init__(self, work, outputs: torch.Tensor | None, stash: list[torch.Tensor]) -> None:
        self.work, self.outputs, self.stash = work, outputs, stash

    def wait(self, *args, **kwargs):
        result = self.work.wait(*args, **kwargs)
        self.stash = []
        return result

    def __getattr__(self, name: str):
        return getattr(self.work, name)


class NcclListBuffers:
    """Context manager: on the fake backend, list collectives allocate ProcessGroupNCCL's flat buffers."""

    def __enter__(self) -> "NcclListBuffers":
        self._saved = {"all_gather": dist.all_gather, "reduce_scatter": dist.reduce_scatter}
        saved = self._saved

        def all_gather(tensor_list, tensor, group=None, async_op=False):
            if not _fake(group):
                return saved["all_gather"](tensor_list, tensor, group=group, async_op=async_op)
            flat = torch.empty((len(tensor_list), *tensor_list[0].shape), dtype=tensor.dtype, device=tensor.device)
            work = saved["all_gather"](tensor_list, tensor, group=group, async_op=True)
            return _finish(_HeldWork(work, outputs=flat, stash=[tensor]), async_op)

        def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if not _fake(group):
                return saved["reduce_scatter"](output, input_list, op=op, group=group, async_op=async_op)
            flat = torch.empty((len(input_list), *input_list[0].shape), dtype=output.dtype, device=output.device)
            work = saved["reduce_scatter"](output, input_list, op=op, group=group, async_op=True)
            return _finish(_HeldWork(work, outputs=None, stash=[flat, *input_list]), async_op)

        dist.all_gather, dist.reduce_scatter = all_gather, reduce_scatter
        return self

    def __exit__(self, *exc) -> None:
        dist.all_gather, dist.reduce_scatter = self._saved["all_gather"], self._saved["reduce_scatter"]


def _finish(held: _HeldWork, async_op: bool) -> _HeldWork | None:
    """The Work for an async call; a synchronous one waits and drops it here, as NCCL's does."""
    if async_op:
        return held
    held.wait()
    return None


def _fake(group) -> bool:
    return dist.get_backend(group) == "fake"
