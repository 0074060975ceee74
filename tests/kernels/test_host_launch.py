"""The block kernels' launches run on the host build as a GPU reads them (tests/kernels/hostlaunch.py):
ids and epochs reach the kernel as the values they hold, even when the caller's tensor is a strided
view. The torch reference indexes by strides, so on CPU a strided id tensor gave the right blocks while
the CUDA kernels, which read a flat array, wrote the wrong ones."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from hostlaunch import HostLaunch

from kvown.kernels import blocks, ops

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def on_host(monkeypatch: pytest.MonkeyPatch) -> HostLaunch:
    host = pytest.importorskip("kvown.kernels._kv_host", reason="the host build is made by `make setup`")
    launch = HostLaunch(host)
    monkeypatch.setattr(ops, "_use_cuda", lambda tensor, backend: True)
    monkeypatch.setattr(ops, "_launch", launch)
    monkeypatch.setattr(ops, "_dl", lambda tensor: tensor)
    return launch


def pool(rows: int = 8, nbytes: int = 300, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, nbytes), generator=g, dtype=torch.int32).to(torch.uint8)


@pytest.mark.parametrize("offset", [0, 1])
def test_the_emulated_launches_give_the_references_bytes(on_host: HostLaunch, offset: int) -> None:
    """The emulator is faithful on ordinary arguments (rows at aligned and at odd addresses)."""
    store = pool(nbytes=301)
    rows, expected = store[:, offset:], store.clone()[:, offset:]
    ops.fill_canary(rows, [6, 1], 9, [2, 1 << 40])
    blocks.fill_canary(expected, [6, 1], 9, [2, 1 << 40])
    assert torch.equal(rows, expected)
    rows[1, 77] ^= 4
    assert ops.verify_canary(rows, [1, 6], 9, [1 << 40, 2]).tolist() == [77, -1]
    assert torch.equal(ops.checksums(rows, [3, 0]), blocks.checksums(rows, [3, 0]))
    assert torch.equal(ops.checksums(rows), blocks.checksums(rows))
    target = store[2, offset:]
    ops.fill_pattern(target, "req", 1, 4)
    assert blocks.verify_pattern(target, "req", 1, 4)
    target[200] ^= 1
    assert ops.first_pattern_mismatch(target, "req", 1, 4) == 200
    assert on_host.launched.count("kv_pattern_fill") == 2 and "kv_checksum_finish" in on_host.launched


IDS = torch.tensor([2, 0, 7, 1, 5, 3])[::2]  # holds [2, 7, 5]; its memory reads [2, 0, 7]
EPOCHS = torch.tensor([4, 1, 5, 1, 6, 1])[::2]  # holds [4, 5, 6]; its memory reads [4, 1, 5]


def test_strided_ids_and_epochs_reach_the_kernels_as_the_values_they_hold(on_host: HostLaunch) -> None:
    assert not IDS.is_contiguous() and IDS.tolist() == [2, 7, 5]
    rows, expected = pool(), pool()
    ops.fill_canary(rows, IDS, 3, EPOCHS)
    blocks.fill_canary(expected, [2, 7, 5], 3, [4, 5, 6])
    assert torch.equal(rows, expected)
    assert ops.verify_canary(rows, IDS, 3, EPOCHS).tolist() == [-1, -1, -1]
    assert torch.equal(ops.checksums(rows, IDS), blocks.checksums(rows, [2, 7, 5]))


def _pass_through_ids(block_ids: Sequence[int] | torch.Tensor | None, num_rows: int, device: torch.device,
                      field: str = "block_ids") -> torch.Tensor:
    """The old handling of a tensor: checked, then moved to the device as it was (strides and all)."""
    assert isinstance(block_ids, torch.Tensor)
    assert all(0 <= v < num_rows for v in block_ids.tolist())
    return block_ids.to(device)


def test_mutant_passing_strided_ids_through_stamps_the_wrong_blocks(
    on_host: HostLaunch, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows, expected = pool(), pool()
    blocks.fill_canary(expected, [2, 7, 5], 3, [4, 5, 6])
    monkeypatch.setattr(blocks, "_check_ids", _pass_through_ids)
    ops.fill_canary(rows, IDS, 3, [4, 5, 6])
    assert not torch.equal(rows, expected)
    assert not torch.equal(rows[0], pool()[0])  # block 0 (never named) was overwritten
