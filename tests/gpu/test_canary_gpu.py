"""On a CUDA device: retirement canaries run on kvown's own stream and never wait for the model's.

The model's work is a ``torch.cuda._sleep`` on the default stream. Canary fill and check must finish
while it still runs: a fill or verify queued on the default stream, or a check that synchronises the
device, would wait for it (the mutant below). Also: the fill synchronises nothing at all (torch's sync
debug mode), and a late write into the separate scale pool is caught on the GPU as on CPU.
Skipped, with the reason, where there is no CUDA device or no CuPy. benchmarks/gpu_check.sh runs it.
"""

from __future__ import annotations

import pytest
import torch
from gpukit import MODEL_CYCLES, NEEDS_CUDA_KERNELS

from kvown.cache import KVLayout, KVPool
from kvown.cache.canary import PLANE_SCALES, PLANE_VALUES, Canaries, CanaryBroken

pytestmark = [*NEEDS_CUDA_KERNELS, pytest.mark.timeout(120)]


def gpu_pool() -> tuple[KVPool, Canaries]:
    layout = KVLayout.nvfp4(num_layers=4, num_blocks=64, tokens_per_block=16, num_kv_heads=8, head_dim=128,
                            scale_layout="separate")
    pool = KVPool(layout, device="cuda")
    canaries = Canaries.of_pool(pool)
    canaries.fill((0, 1))  # warm: the module is compiled and loaded, the pinned buffers exist
    assert canaries.check((0, 1)) == []
    torch.cuda.synchronize()
    return pool, canaries


def retire_and_reuse_behind_the_model(canaries: Canaries) -> tuple[list[CanaryBroken], bool]:
    blocks = (3, 9, 10, 40)
    torch.cuda._sleep(MODEL_CYCLES)  # the model's work on the default stream
    canaries.fill(blocks)
    broken = canaries.check(blocks)
    model_busy = not torch.cuda.default_stream().query()
    torch.cuda.synchronize()
    return broken, model_busy


def test_canary_fill_and_check_never_wait_for_the_default_stream() -> None:
    _, canaries = gpu_pool()
    broken, model_busy = retire_and_reuse_behind_the_model(canaries)
    assert broken == []
    assert model_busy, "the canary work waited for the model's stream (or MODEL_CYCLES is too short)"


def test_mutant_canaries_on_the_default_stream_wait_for_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    _, canaries = gpu_pool()
    monkeypatch.setattr(canaries, "_stream", torch.cuda.default_stream())
    broken, model_busy = retire_and_reuse_behind_the_model(canaries)
    assert broken == [] and not model_busy


def test_the_fill_synchronises_nothing() -> None:
    _, canaries = gpu_pool()
    torch.cuda.set_sync_debug_mode("error")
    try:
        canaries.fill((5, 6, 7))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert canaries.check((5, 6, 7)) == []


def test_late_writes_into_either_plane_are_caught_on_the_gpu() -> None:
    pool, canaries = gpu_pool()
    canaries.fill((12, 13))
    assert pool.scales is not None
    pool.block_view(12)[4097] ^= 0x02
    pool.scales.block_view(13)[31] ^= 0x80
    torch.cuda.synchronize()
    assert canaries.check((12, 13)) == [CanaryBroken(12, 1, 4097, PLANE_VALUES),
                                        CanaryBroken(13, 1, 31, PLANE_SCALES)]
