"""checksum, fill_pattern and verify_pattern: deterministic, position-sensitive, fast."""

from __future__ import annotations

import time

import pytest
import torch

from kvown.cache import KVLayout, KVPool
from kvown.core.errors import LocalProtocolError
from kvown.kernels import nvfp4


@pytest.mark.timeout(10)
def test_checksum_is_deterministic_and_sees_changes_and_moves() -> None:
    data = torch.arange(4096, dtype=torch.int32).view(torch.uint8).clone()
    base = nvfp4.checksum(data)
    assert base == nvfp4.checksum(data.clone())
    flipped = data.clone()
    flipped[1234] ^= 1
    assert nvfp4.checksum(flipped) != base
    swapped = data.clone()
    swapped[[8, 9]] = swapped[[9, 8]]
    assert swapped[8] != data[8] and nvfp4.checksum(swapped) != base
    assert nvfp4.checksum(torch.zeros(8, dtype=torch.uint8)) != nvfp4.checksum(torch.zeros(9, dtype=torch.uint8))
    # Any dtype: the fingerprint is of the bytes.
    floats = torch.arange(1024, dtype=torch.float32)
    assert nvfp4.checksum(floats) == nvfp4.checksum(floats.view(torch.uint8))


@pytest.mark.timeout(10)
def test_checksum_chains_chunks_so_swapped_chunks_differ() -> None:
    chunk = nvfp4._CHUNK_BYTES
    data = torch.zeros(2 * chunk, dtype=torch.uint8)
    data[:chunk] = 1
    swapped = torch.cat((data[chunk:], data[:chunk]))
    assert nvfp4.checksum(data) != nvfp4.checksum(swapped)


@pytest.mark.timeout(10)
def test_pattern_is_deterministic_and_specific_to_request_writer_block() -> None:
    a = nvfp4.fill_pattern(torch.empty(5000, dtype=torch.uint8), "req-7", 1, 3)
    assert torch.equal(a, nvfp4.fill_pattern(torch.empty(5000, dtype=torch.uint8), "req-7", 1, 3))
    assert nvfp4.verify_pattern(a, "req-7", 1, 3)
    for other in (("req-8", 1, 3), ("req-7", 2, 3), ("req-7", 1, 4), (7, 1, 3)):
        b = nvfp4.fill_pattern(torch.empty(5000, dtype=torch.uint8), *other)
        assert float((a == b).float().mean()) < 0.05, other  # most bytes differ
        assert not nvfp4.verify_pattern(a, *other)
    assert len(torch.unique(a)) > 200  # not a constant or short cycle
    shifted = torch.roll(a, 1)
    assert not nvfp4.verify_pattern(shifted, "req-7", 1, 3)
    damaged = a.clone()
    damaged[4999] ^= 0x80
    assert not nvfp4.verify_pattern(damaged, "req-7", 1, 3)


@pytest.mark.timeout(10)
def test_pattern_fills_a_pool_block_in_place_and_only_it() -> None:
    layout = KVLayout.standard(num_layers=2, num_blocks=4, tokens_per_block=8, num_kv_heads=2, head_dim=16)
    pool = KVPool(layout)
    nvfp4.fill_pattern(pool.block_view(2), 11, 0, 2)
    assert nvfp4.verify_pattern(pool.block_view(2), 11, 0, 2)
    assert int(pool.block_view(1).sum()) == 0 and int(pool.block_view(3).sum()) == 0
    with pytest.raises(LocalProtocolError):
        nvfp4.fill_pattern(torch.zeros(8, dtype=torch.float32), 1, 0, 0)
    with pytest.raises(LocalProtocolError):
        nvfp4.fill_pattern(torch.zeros(8, 8, dtype=torch.uint8)[:, ::2], 1, 0, 0)


@pytest.mark.timeout(30)
def test_fill_verify_and_checksum_are_vectorised() -> None:
    block = torch.empty(16 << 20, dtype=torch.uint8)
    started = time.perf_counter()
    nvfp4.fill_pattern(block, 1, 0, 0)
    assert nvfp4.verify_pattern(block, 1, 0, 0)
    nvfp4.checksum(block)
    elapsed_s = time.perf_counter() - started
    # A per-byte Python loop would take minutes on 48 MiB of work; vectorised takes well under a second.
    assert elapsed_s < 10.0, elapsed_s
