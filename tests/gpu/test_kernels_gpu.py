"""On a CUDA device: every kernel of kernels/ops.py against the CPU torch reference, bit for bit, on
aligned and unaligned tensors (each kernel's vector and scalar paths), and on the caller's stream.

Skipped, with the reason, where there is no CUDA device or no CuPy. benchmarks/gpu_check.sh runs it.
"""

from __future__ import annotations

import pytest
import torch
from gpukit import MODEL_CYCLES, NEEDS_CUDA_KERNELS

from kvown.cache import KVLayout, KVPool
from kvown.kernels import blocks, cuda_loader, nvfp4, ops
from kvown.kernels.errors import KernelInputError

pytestmark = [*NEEDS_CUDA_KERNELS, pytest.mark.timeout(300)]

PRODUCER_CYCLES = 200_000_000  # ~0.1 s: a producer still running when the kernel is queued behind it

TIES = torch.tensor(
    [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0]
)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def shifted(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in CUDA memory one element past a 16-byte boundary: the kernels' scalar paths."""
    out = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")[1:].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 16 != 0
    return out


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_and_dequantize_take_their_scalar_paths_on_unaligned_tensors(dtype: torch.dtype) -> None:
    """Every load and store of both NVFP4 kernels misaligned (input, values, scales, output)."""
    x = (torch.randn(64, 128, generator=torch.Generator().manual_seed(8)) * 3).to(dtype)
    expected = nvfp4.quantize(x, 0.05)
    values = shifted(torch.zeros(64, 64, dtype=torch.uint8))
    scales = shifted(torch.zeros(64, 8, dtype=torch.uint8))
    ops.quantize(shifted(x), 0.05, out=(values, scales), backend="cuda")
    assert torch.equal(values.cpu(), expected.values) and torch.equal(scales.cpu(), expected.scales)
    out = shifted(torch.zeros(64, 128))
    landed = nvfp4.NVFP4Tensor(shifted(expected.values), shifted(expected.scales), expected.global_scale)
    ops.dequantize(landed, out=out, backend="cuda")
    assert torch.equal(bits(out.cpu()), bits(nvfp4.dequantize(expected)))


@pytest.mark.parametrize(("nbytes", "offset"), [(4096, 0), (4096, 1), (4100, 0), (333, 0)])
def test_canaries_on_the_vector_and_the_byte_paths(nbytes: int, offset: int) -> None:
    """Rows at 16-byte multiples take the uint4 path; odd strides and odd addresses the byte path."""
    store = torch.zeros(16, nbytes + offset, dtype=torch.uint8)
    cpu, gpu = store[:, offset:], store.cuda()[:, offset:]
    retired = [0, 7, 15]
    ops.fill_canary(gpu, retired, 5, [1, 2, 3], backend="cuda")
    blocks.fill_canary(cpu, retired, 5, [1, 2, 3])
    assert torch.equal(gpu.cpu(), cpu)
    gpu[7, nbytes - 1] ^= 1
    assert ops.verify_canary(gpu, retired, 5, [1, 2, 3], backend="cuda").tolist() == [-1, nbytes - 1, -1]
    assert ops.first_pattern_mismatch(gpu[15], "x", 0, 0, backend="cuda") >= 0  # a canary is no pattern


def test_block_ids_on_the_gpu_are_refused_and_strided_host_ids_name_their_blocks() -> None:
    """Ids are checked on the host (a device tensor would need a sync); a strided CPU view is copied
    to a contiguous device array, so the kernel reads the ids it holds."""
    gpu = torch.zeros(8, 256, dtype=torch.uint8, device="cuda")
    with pytest.raises(KernelInputError) as raised:
        ops.fill_canary(gpu, torch.tensor([1, 2], device="cuda"), 0, 1, backend="cuda")
    assert raised.value.fields["field"] == "block_ids"
    ids = torch.tensor([2, 0, 7, 1, 5, 3])[::2]  # [2, 7, 5]; its memory reads [2, 0, 7]
    ops.fill_canary(gpu, ids, 3, 4, backend="cuda")
    cpu = torch.zeros(8, 256, dtype=torch.uint8)
    blocks.fill_canary(cpu, [2, 7, 5], 3, 4)
    assert torch.equal(gpu.cpu(), cpu)
    assert torch.equal(ops.checksums(gpu, ids, backend="cuda").cpu(), blocks.checksums(cpu, [2, 7, 5]))


def _quantize_between_producer_and_consumer() -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The model keeps the default stream busy; on a side stream a delayed producer writes ``y``, the
    kernel quantises it and a consumer copies the result. Returns (snapshot, expected, model busy)."""
    x = torch.randn(4096, 128, device="cuda")
    y = torch.zeros_like(x)
    values = torch.zeros(4096, 64, dtype=torch.uint8, device="cuda")
    scales = torch.zeros(4096, 8, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(MODEL_CYCLES)  # the model's work, queued on the default stream
    with torch.cuda.stream(side):
        torch.cuda._sleep(PRODUCER_CYCLES)  # the producer is still running when the kernel is queued
        y.copy_(x * 3)
        ops.quantize(y, 0.05, out=(values, scales), check_finite=False, backend="cuda")
        snapshot = values.clone()  # the consumer, queued right behind the kernel
    side.synchronize()
    model_busy = not torch.cuda.default_stream().query()
    torch.cuda.synchronize()
    return snapshot.cpu(), nvfp4.quantize((x * 3).cpu(), 0.05).values, model_busy


def test_kernels_run_on_torchs_current_stream() -> None:
    """After the producer, before the consumer, and never behind the default stream's work."""
    snapshot, expected, model_busy = _quantize_between_producer_and_consumer()
    assert model_busy, "the model's sleep ended before the side stream: raise MODEL_CYCLES"
    assert torch.equal(snapshot, expected)


def test_mutant_a_launch_on_the_default_stream_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel launched on the default stream queues behind the model: the consumer copies zeros."""
    cupy = cuda_loader.cupy_module()
    monkeypatch.setattr(cuda_loader, "stream", lambda index: cupy.cuda.ExternalStream(
        torch.cuda.default_stream(index).cuda_stream, index))
    snapshot, expected, _ = _quantize_between_producer_and_consumer()
    assert not torch.equal(snapshot, expected)
