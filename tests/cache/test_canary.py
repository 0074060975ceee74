"""Retirement canaries on CPU pools: every plane guarded (the separate NVFP4 scale pool too), and block
ids and epochs checked on the host from Python ints, with no tensor reduction that would sync a GPU."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from kvown.cache import KVLayout, KVPool
from kvown.cache.canary import PLANE_SCALES, PLANE_VALUES, Canaries, CanaryBroken
from kvown.kernels import blocks, ops
from kvown.kernels.errors import KernelInputError

pytestmark = pytest.mark.timeout(30)


def separate_pool() -> KVPool:
    layout = KVLayout.nvfp4(num_layers=2, num_blocks=8, tokens_per_block=4, num_kv_heads=2, head_dim=32,
                            scale_layout="separate")
    return KVPool(layout)


def test_a_late_write_into_the_scale_pool_is_caught() -> None:
    pool = separate_pool()
    canaries = Canaries.of_pool(pool)
    assert canaries.planes == 2
    canaries.fill((2, 3))
    assert canaries.check((2, 3)) == []  # INV-CN1
    assert pool.scales is not None
    pool.scales.block_view(3)[7] ^= 0x01  # a writer that was not quiescent lands its scales late
    assert canaries.check((2, 3, 4)) == [CanaryBroken(3, 1, 7, PLANE_SCALES)]


def test_mutant_guarding_only_the_value_pool_misses_it() -> None:
    """What the driver built before: canaries over pool.tensor alone. The late scale write goes unseen."""
    pool = separate_pool()
    values_only = Canaries(pool.tensor, pool.layout.block_nbytes, pool.num_blocks)
    values_only.fill((3,))
    assert pool.scales is not None
    pool.scales.block_view(3)[7] ^= 0x01
    assert values_only.check((3,)) == []


def test_a_block_broken_in_both_planes_is_reported_once_values_first() -> None:
    pool = separate_pool()
    canaries = Canaries.of_pool(pool)
    canaries.fill((1, 5))
    canaries.fill((5,))  # epoch 2
    assert pool.scales is not None
    pool.scales.block_view(5)[0] ^= 0xFF
    pool.block_view(5)[100] ^= 0xFF
    pool.scales.block_view(1)[3] ^= 0xFF
    assert canaries.check((1, 5)) == [CanaryBroken(1, 1, 3, PLANE_SCALES),
                                      CanaryBroken(5, 2, 100, PLANE_VALUES)]


def test_planes_carry_different_canaries() -> None:
    """Rule 3: a scale block holding the value pool's canary of the same block and epoch is caught."""
    pool = separate_pool()
    canaries = Canaries.of_pool(pool)
    canaries.fill((4,))
    assert pool.scales is not None
    n = pool.scales.layout.block_nbytes
    pool.scales.block_view(4).copy_(pool.block_view(4)[:n])
    assert [b.plane for b in canaries.check((4,))] == [PLANE_SCALES]


# ---- host-side checks of ids and epochs (kvown.kernels.blocks rule 4) ----------------------------


@pytest.fixture
def no_tensor_reductions(monkeypatch: pytest.MonkeyPatch) -> None:
    """min / max / amin / amax / item on any tensor raise: on a GPU each would wait for all queued work."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a tensor reduction in an id or epoch check: on a GPU it synchronises")

    for name in ("min", "max", "amin", "amax", "aminmax", "item"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)


def test_canaries_check_ids_and_epochs_without_reading_a_tensor(no_tensor_reductions: None) -> None:
    pool = separate_pool()
    canaries = Canaries.of_pool(pool)
    canaries.fill((0, 6, 7))
    pool.block_view(6)[9] ^= 0x10
    assert canaries.check((0, 6, 7)) == [CanaryBroken(6, 1, 9, PLANE_VALUES)]
    rows = pool.tensor.view(8, -1)
    ops.fill_canary(rows, torch.tensor([1, 2]), 4, torch.tensor([3, 9]))
    assert ops.verify_canary(rows, [1, 2], 4, [3, 9]).tolist() == [-1, -1]
    assert ops.checksums(rows, [7, 1]).tolist() == blocks.checksums(rows)[[7, 1]].tolist()


@pytest.mark.parametrize(
    ("ids", "epoch", "field"),
    [
        ([0, 8], 1, "block_ids"),
        ([-1], 1, "block_ids"),
        ([True], 1, "block_ids"),
        ([1.0], 1, "block_ids"),
        (torch.tensor([1, 2], dtype=torch.int32), 1, "block_ids"),
        (torch.tensor([[1, 2]]), 1, "block_ids"),
        (torch.tensor([1, 2], device="meta"), 1, "block_ids"),  # a device tensor: its check would sync
        ([1, 2], -1, "epoch"),
        ([1, 2], 1 << 63, "epoch"),
        ([1, 2], [1], "epoch"),
        ([1, 2], [1, -2], "epoch"),
        ([1, 2], torch.tensor([1, 2], device="meta"), "epoch"),
        ([1, 2], torch.tensor([1.0, 2.0]), "epoch"),
    ],
)
def test_bad_ids_and_epochs_are_refused_on_the_host_and_change_nothing(
    no_tensor_reductions: None, ids: Sequence[int] | torch.Tensor, epoch: object, field: str
) -> None:
    rows = torch.zeros(8, 64, dtype=torch.uint8)
    for call in (ops.fill_canary, ops.verify_canary, blocks.fill_canary):
        with pytest.raises(KernelInputError) as raised:
            call(rows, ids, 3, epoch)  # type: ignore[operator]
        assert raised.value.fields["field"] == field
    if field == "block_ids":
        with pytest.raises(KernelInputError) as raised:
            ops.checksums(rows, ids)
        assert raised.value.fields["field"] == field
    assert int(rows.sum(dtype=torch.int64)) == 0


def _old_check_ids(block_ids: Sequence[int] | torch.Tensor | None, num_rows: int, device: torch.device,
                   field: str = "block_ids") -> torch.Tensor:
    """The check this replaced: a range check by tensor reductions, after the ids became a tensor."""
    assert block_ids is not None
    ids = torch.tensor(list(block_ids), dtype=torch.int64, device=device)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_rows):
        raise KernelInputError("block id out of range", field=field, num_blocks=num_rows)
    return ids


def test_mutant_range_check_by_tensor_reduction_is_caught(
    no_tensor_reductions: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blocks, "_check_ids", _old_check_ids)
    canaries = Canaries.of_pool(separate_pool())
    with pytest.raises(AssertionError, match="synchronises"):
        canaries.fill((1,))
