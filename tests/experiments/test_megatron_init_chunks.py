"""init_parameter draws a weight in chunks of rows on the parameter's device: on the CPU bit for
bit megatron's CPU initialization (one draw of the full weight, each TP rank keeping its slice),
holding one chunk at a time, not the full weight."""
from __future__ import annotations

import pytest
import torch
from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from experiments.models import megatron_gpt
from experiments.models.megatron_gpt import transformer_config, init_parameter, param_role, parameter_seed
from experiments.models.gpt_shape import GPTShape

pytestmark = pytest.mark.numerical

CONFIG = transformer_config(GPTShape(layers=2, hidden=24, heads=4, seq_len=35), 1, False, torch.float32)
SEED = 11
# (name, full TP=1 shape, partition stride): column-parallel (rows split), row-parallel (columns
# split), the vocabulary-parallel embedding, a serial one with a short tail (35 x 5: chunks of 16
# rows, the last 3 rows, 15 values, join the chunk before), and megatron's strided split
WEIGHTS = [("decoder.layers.0.self_attention.linear_qkv.weight", (72, 24), 1),
           ("decoder.layers.1.mlp.linear_fc2.weight", (24, 96), 1),
           ("embedding.word_embeddings.weight", (256, 24), 1),
           ("embedding.position_embeddings.weight", (35, 5), 1),
           ("decoder.layers.0.mlp.linear_fc1.weight", (96, 24), 2)]


def megatron_cpu_init(name: str, full: tuple[int, int], stride: int, rank: int, tp: int, dtype: torch.dtype):
    """The reference: megatron's CPU initialization, the full weight drawn at once from the
    parameter's seed (what init_parameter did before it drew in chunks)."""
    role = param_role(name)
    init_method = getattr(CONFIG, role.init)
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(parameter_seed(SEED, name))
        if role.partition_dim is None:
            master = torch.empty(full)
            init_method(master)
            return master.to(dtype)
        local = list(full)
        local[role.partition_dim] //= tp
        param = torch.empty(local, dtype=dtype)
        _initialize_affine_weight_cpu(param, full[0], full[1], local[role.partition_dim], role.partition_dim,
                                      init_method, stride=stride, params_dtype=dtype, rank=rank, world_size=tp,
                                      skip_set_tensor_parallel_attributes=True)
        return param


def chunked_init(name: str, full: tuple[int, int], stride: int, rank: int, tp: int, dtype: torch.dtype):
    role = param_role(name)
    local = list(full)
    if role.partition_dim is not None:
        local[role.partition_dim] //= tp
    param = torch.empty(local, dtype=dtype)
    param.partition_stride = stride
    init_parameter(param, name, CONFIG, SEED, rank, tp if role.partition_dim is not None else 1)
    return param


@pytest.mark.parametrize("chunk", [50, megatron_gpt.DRAW_CHUNK_ELEMENTS])  # 1-2 rows per chunk; one chunk
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_chunked_draw_is_megatrons_cpu_initialization(monkeypatch, chunk, dtype, tp):
    monkeypatch.setattr(megatron_gpt, "DRAW_CHUNK_ELEMENTS", chunk)
    for name, full, stride in WEIGHTS:
        if stride > 1 and tp == 4:
            continue  # 96 rows / (4 x 2): megatron's pieces of 12 rows also work, but fc1's stride is 1 in a GPT
        ranks = range(tp) if param_role(name).partition_dim is not None else [0]
        for rank in ranks:
            expected = megatron_cpu_init(name, full, stride, rank, tp, dtype)
            assert torch.equal(chunked_init(name, full, stride, rank, tp, dtype), expected), (name, rank)


class NewStorages(TorchDispatchMode):
    """The largest storage an op creates, other than `param`'s."""

    def __init__(self, param: torch.Tensor) -> None:
        super().__init__()
        self.param, self.largest = param.untyped_storage().data_ptr(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() != self.param:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("name", ["embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc2.weight"])
def test_init_holds_one_chunk_not_the_full_weight(monkeypatch, name):
    monkeypatch.setattr(megatron_gpt, "DRAW_CHUNK_ELEMENTS", 4096)
    dim = param_role(name).partition_dim
    param = torch.empty((1024, 64) if dim == 0 else (64, 1024), dtype=torch.bfloat16)  # TP 4 of 4096 x 64 (64 x 4096)
    with NewStorages(param) as seen:
        init_parameter(param, name, CONFIG, SEED, 0, 4)
    # megatron's CPU initialization holds the full fp32 weight (1 MB) and its bf16 rounding;
    # the chunked draw a chunk of fp32 rows (4096 values, 16 KB)
    assert seen.largest == 4096 * 4
