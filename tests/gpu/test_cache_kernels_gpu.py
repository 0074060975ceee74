"""On a CUDA device: the pool's storage, and the CPU references giving the same bits on GPU tensors."""

from __future__ import annotations

import pytest
import torch

from kvown.apps import doctor
from kvown.apps.doctor import CheckStatus
from kvown.cache import KVLayout, KVPool
from kvown.kernels import nvfp4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


@pytest.mark.timeout(60)
def test_cuda_pool_blocks_are_device_views() -> None:
    layout = KVLayout.nvfp4(num_layers=2, num_blocks=8, tokens_per_block=16, num_kv_heads=4, head_dim=64)
    pool = KVPool(layout, device="cuda")
    assert pool.tensor.is_cuda and pool.tensor.numel() == layout.pool_nbytes
    view = pool.block_view(5)
    assert view.is_cuda and view.data_ptr() == pool.block_addr(5) == pool.base_addr + 5 * layout.block_nbytes
    nvfp4.fill_pattern(view, "r", 1, 5)
    assert nvfp4.verify_pattern(pool.block_view(5), "r", 1, 5)
    assert int(pool.block_view(4).sum()) == 0 and int(pool.block_view(6).sum()) == 0
    blocks = pool.allocate(3, owner="r")
    pool.hold(blocks)
    pool.retire(blocks, owner="r")
    pool.check(deep=True)


@pytest.mark.timeout(60)
def test_references_give_the_same_bits_on_cuda_and_cpu() -> None:
    cpu = nvfp4.fill_pattern(torch.empty(3 << 20, dtype=torch.uint8), 9, 2, 4)
    gpu = nvfp4.fill_pattern(torch.empty(3 << 20, dtype=torch.uint8, device="cuda"), 9, 2, 4)
    assert torch.equal(gpu.cpu(), cpu)
    assert nvfp4.checksum(gpu) == nvfp4.checksum(cpu)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    q_cpu, q_gpu = nvfp4.quantize(x), nvfp4.quantize(x.cuda())
    assert torch.equal(q_gpu.values.cpu(), q_cpu.values) and torch.equal(q_gpu.scales.cpu(), q_cpu.scales)
    assert torch.equal(nvfp4.dequantize(q_gpu).cpu(), nvfp4.dequantize(q_cpu))


@pytest.mark.timeout(60)
def test_doctor_reports_the_gpu() -> None:
    result = doctor.check_gpu()
    assert result.status is CheckStatus.OK and result.detail
