"""On a CUDA device: every kernel of kernels/ops.py against the CPU torch reference, bit for bit.

Skipped, with the reason, where there is no CUDA device or no CuPy. benchmarks/gpu_check.sh runs it.
"""

from __future__ import annotations

import pytest
import torch

from kvown.kernels import blocks, nvfp4, ops
from kvown.kernels.errors import KernelInputError
from kvown.cache import KVLayout, KVPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
    pytest.mark.skipif(not ops.cupy_available(), reason="CuPy is not installed (pip install 'kvown[gpu]')"),
    pytest.mark.timeout(300),
]

TIES = torch.tensor(
    [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0]
)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def cases() -> list[tuple[str, torch.Tensor, dict[str, object]]]:
    g = torch.Generator().manual_seed(31)
    normal = torch.randn(1000, 128, generator=g)
    latent = torch.randn(64, 576, generator=g)
    latent[:, 512:] *= 30
    wide = torch.randn(256, 64, generator=g) * torch.exp2(
        torch.randint(-30, 30, (256, 1), generator=g).float()
    )
    odd_scales = TIES * torch.tensor([[1.125], [1.25], [1.375], [1.625], [1.75], [1.875], [3.5], [0.1875]])
    return [
        ("float32", normal, {}),
        ("bfloat16", normal.to(torch.bfloat16), {"global_scale": 0.003}),
        ("float16", (normal * 100).to(torch.float16), {}),
        ("saturating", normal * 100, {"global_scale": 1e-6}),
        ("subnormal scales", normal, {"global_scale": 40.0}),
        ("ties", odd_scales, {"global_scale": 1.0}),
        ("zeros", torch.zeros(8, 32), {}),
        ("wide range", wide, {"global_scale": 3.7e-3}),
        ("MLA latent", latent, {"rope_dim": 64}),
        ("3-D", torch.randn(7, 5, 48, generator=g), {}),
    ]


@pytest.mark.parametrize(("name", "x", "kwargs"), cases(), ids=[c[0] for c in cases()])
def test_quantize_and_dequantize_match_the_reference(name: str, x: torch.Tensor, kwargs: dict) -> None:  # type: ignore[type-arg]
    expected = nvfp4.quantize(x, **kwargs)
    q = ops.quantize(x.cuda(), **kwargs, backend="cuda")
    assert q.values.is_cuda and q.global_scale == expected.global_scale
    assert torch.equal(q.scales.cpu(), expected.scales), name
    assert torch.equal(q.values.cpu(), expected.values), name
    assert torch.equal(bits(ops.dequantize(q, backend="cuda").cpu()), bits(nvfp4.dequantize(expected))), name


def test_dequantize_of_arbitrary_bytes_matches_the_reference() -> None:
    g = torch.Generator().manual_seed(5)
    values = torch.randint(0, 256, (333, 288), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(0, 256, (333, 36), generator=g, dtype=torch.int32).to(torch.uint8)
    scales[(scales & 0x7F) == 0x7F] = 1  # NaN codes: NaN bits differ between devices
    q = nvfp4.NVFP4Tensor(values, scales, nvfp4.as_float32(0.37), 64, nvfp4.as_float32(1e-20))
    on_gpu = nvfp4.NVFP4Tensor(values.cuda(), scales.cuda(), q.global_scale, 64, q.rope_global_scale)
    assert torch.equal(bits(ops.dequantize(on_gpu, backend="cuda").cpu()), bits(nvfp4.dequantize(q)))


@pytest.mark.parametrize("scale_layout", ["inline", "separate"])
def test_quantize_straight_into_vram_pool_planes(scale_layout: str) -> None:
    layout = KVLayout.nvfp4(
        num_layers=3,
        num_blocks=8,
        tokens_per_block=16,
        num_kv_heads=4,
        head_dim=128,
        scale_layout=scale_layout,
    )
    pool = KVPool(layout, device="cuda")
    scale_pool = KVPool(layout.scale_pool(), device="cuda") if scale_layout == "separate" else pool
    keys = torch.randn(4, 3, 16, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out = (pool.plane_view("k_values")[5], scale_pool.plane_view("k_scales")[5])
    ops.quantize(keys.cuda(), 0.01, out=out, backend="cuda")
    expected = nvfp4.quantize(keys, 0.01)
    assert torch.equal(out[0].cpu(), expected.values) and torch.equal(out[1].cpu(), expected.scales)
    assert all(int(pool.block_view(b).sum()) == 0 for b in range(8) if b != 5)
    landed = nvfp4.NVFP4Tensor(pool.plane_view("k_values")[5], scale_pool.plane_view("k_scales")[5], 0.01)
    assert torch.equal(bits(ops.dequantize(landed, backend="cuda").cpu()), bits(nvfp4.dequantize(expected)))


@pytest.mark.parametrize("nbytes", [0, 1, 7, 16, 1000, 4096, (2 << 20) + 4])
def test_checksums_match_the_reference_on_aligned_and_unaligned_blocks(nbytes: int) -> None:
    g = torch.Generator().manual_seed(nbytes)
    pool = torch.randint(0, 256, (9, nbytes), generator=g, dtype=torch.int32).to(torch.uint8)
    gpu = pool.cuda()
    assert torch.equal(ops.checksums(gpu, backend="cuda").cpu(), blocks.checksums(pool))
    assert torch.equal(ops.checksums(gpu, [7, 0, 3], backend="cuda").cpu(), blocks.checksums(pool, [7, 0, 3]))
    if nbytes > 1:  # rows that start at odd addresses: the byte path
        assert torch.equal(ops.checksums(gpu[:, 1:], backend="cuda").cpu(), blocks.checksums(pool[:, 1:]))


def test_one_launch_checksums_more_blocks_than_a_grid_row() -> None:
    pool = torch.randint(0, 256, (70_000, 64), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    pool = pool.to(torch.uint8)
    assert torch.equal(ops.checksums(pool.cuda(), backend="cuda").cpu(), blocks.checksums(pool))


@pytest.mark.parametrize("nbytes", [1, 5, 16, 4099, (1 << 20) + 3])
def test_patterns_match_the_reference_and_locate_a_bad_byte(nbytes: int) -> None:
    gpu = ops.fill_pattern(
        torch.empty(nbytes, dtype=torch.uint8, device="cuda"), "req-9", 2, 7, backend="cuda"
    )
    cpu = blocks.fill_pattern(torch.empty(nbytes, dtype=torch.uint8), "req-9", 2, 7)
    assert torch.equal(gpu.cpu(), cpu)
    assert ops.verify_pattern(gpu, "req-9", 2, 7, backend="cuda")
    assert not ops.verify_pattern(gpu, "req-9", 2, 8, backend="cuda")
    gpu[nbytes - 1] ^= 0x40
    assert ops.first_pattern_mismatch(gpu, "req-9", 2, 7, backend="cuda") == nbytes - 1
    unaligned = torch.empty(nbytes + 1, dtype=torch.uint8, device="cuda")[1:]
    ops.fill_pattern(unaligned, "req-9", 2, 7, backend="cuda")
    assert torch.equal(unaligned.cpu(), cpu)


def test_canaries_match_the_reference_and_catch_a_late_write() -> None:
    pool = torch.zeros(64, 4100, dtype=torch.uint8)
    gpu = pool.cuda()
    retired = [3, 9, 10, 63]
    ops.fill_canary(gpu, retired, 17, [1, 2, 3, 1 << 40], backend="cuda")
    blocks.fill_canary(pool, retired, 17, [1, 2, 3, 1 << 40])
    assert torch.equal(gpu.cpu(), pool)
    assert ops.verify_canary(gpu, retired, 17, [1, 2, 3, 1 << 40], backend="cuda").tolist() == [-1] * 4
    gpu[10, 2049] += 1
    gpu[63, 4099] ^= 0x80
    gpu[63, 5000 - 4100 + 7] ^= 1  # an earlier bad byte in the same block wins
    assert ops.verify_canary(gpu, retired, 17, [1, 2, 3, 1 << 40], backend="cuda").tolist() == [
        -1,
        -1,
        2049,
        907,
    ]
    assert ops.verify_canary(gpu, [3], 17, 2, backend="cuda").tolist() != [-1]


def test_non_finite_input_is_reported_after_the_kernel() -> None:
    x = torch.ones(4, 32, device="cuda")
    x[2, 17] = float("inf")
    with pytest.raises(KernelInputError) as raised:
        ops.quantize(x, 1.0, backend="cuda")
    assert raised.value.fields["field"] == "x"
    ops.quantize(x, 1.0, check_finite=False, backend="cuda")  # the caller's choice: no sync, no check


def test_kernels_run_on_torchs_current_stream() -> None:
    side = torch.cuda.Stream()
    x = torch.randn(4096, 128, device="cuda")
    with torch.cuda.stream(side):
        y = x * 3  # queued on the side stream
        q = ops.quantize(y, 0.05, check_finite=False, backend="cuda")  # must see y complete
    side.synchronize()
    assert torch.equal(q.values.cpu(), nvfp4.quantize(y.cpu(), 0.05).values)
