"""The proxy counter (experiments/proxy_counts.py) and its pricing (bench_proxies.price), by hand."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from experiments.analysis.hardware import profile
from experiments.bench_proxies import price
from experiments.proxy_counts import OpCounter


def test_counts_kernels_syncs_gemms_and_bytes():
    a, b = torch.ones(1000), torch.ones(1000)
    m = torch.ones(8, 8)
    counter = OpCounter()
    with counter:
        counter.phase = "forward"
        c = a + b                 # a kernel: reads 2 x 4000 bytes, writes 4000
        c[:10].view(2, 5)         # views: no kernel
        torch.empty(5)            # an allocation: no kernel
        m @ m                     # a GEMM: a kernel, no non-GEMM bytes
        counter.phase = "step"
        c.sum().item()            # sum: a kernel (4000 read, 4 written); item: a host sync
    forward, step = counter.phases()["forward"], counter.phases()["step"]
    assert (forward["kernels"], forward["gemms"], forward["host_syncs"]) == (2, 1, 0)
    assert forward["non_gemm_bytes"] == 3 * 4000
    assert (step["kernels"], step["host_syncs"], step["non_gemm_bytes"]) == (1, 1, 4004)


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def test_counts_collectives_by_the_suites_convention(fake_world):
    flat = torch.zeros(400)
    counter = OpCounter()
    with counter:
        counter.phase = "backward"
        dist.reduce_scatter_single(flat[:100], flat)   # its input: 400 elements
        dist.all_gather_single(flat, flat[:100])       # its output: 400
        dist.all_reduce(flat[:10])                     # twice its size: 20
    c = counter.phases()["backward"]
    assert (c["collectives"], c["collective_elements"], c["kernels"]) == (3, 820, 0)
    assert c["collective_calls"] == [["all_gather", 1600, 1], ["all_reduce", 40, 1], ["reduce_scatter", 1600, 1]]


def test_price_uses_the_profiles_constants():
    counts = {"step": {"kernels": 9, "host_syncs": 1, "non_gemm_bytes": 10 ** 9,
                       "collective_calls": [["all_reduce", 4, 2]]}}
    hw = profile("dgx2_v100")
    priced = price(counts, "dgx2_v100", 2)["step"]
    assert priced["launch_s"] == pytest.approx(10 * hw.kernel_floor_s)  # a sync costs a kernel's floor
    assert priced["bytes_s"] == pytest.approx(1e9 / hw.stream_bytes_per_s)
    assert priced["collectives_s"] == pytest.approx(2 * hw.collectives.time_s("all_reduce", 4, 2, 2))
