"""The raw WRITE yardstick of ``kvown bench world`` stays inside the raw buffer, which is sized for the
run's own W1 / W2 sizes. It once always added 1 MiB and 4 MiB: a run of 64 KiB sessions only wrote past
its 256 KiB buffer, NIXL refused the descriptor (NIXL_ERR_NOT_FOUND) and the world aborted."""

from __future__ import annotations

import pytest

from kvown.apps.benchmarks import world
from kvown.apps.benchmarks.common import KIB, MIB


def _sizes(w1_max: int, w2: list[int], block: int = 64 * KIB, window: int = 4) -> tuple[list[int], int]:
    raw_nbytes = max(w1_max * window, max(w2))  # as open_bench sizes it
    return world.yard_sizes(w2, block, raw_nbytes), raw_nbytes


@pytest.mark.timeout(10)
def test_a_small_run_measures_only_what_fits() -> None:
    sizes, raw_nbytes = _sizes(64 * KIB, [64 * KIB])
    assert sizes == [64 * KIB] and raw_nbytes == 256 * KIB


@pytest.mark.timeout(10)
def test_the_default_run_keeps_every_yardstick() -> None:
    sizes, _ = _sizes(16 * MIB, [64 * KIB, MIB, 4 * MIB])
    assert sizes == [64 * KIB, MIB, 4 * MIB]


def _check_fits(w1_max: int, w2: list[int]) -> None:
    sizes, raw_nbytes = _sizes(w1_max, w2)
    assert set(w2) <= set(sizes)
    assert max(sizes) <= raw_nbytes, f"yardstick {max(sizes)} B past the {raw_nbytes} B raw buffer"


CASES = [(64 * KIB, [64 * KIB]), (256 * KIB, [64 * KIB, 192 * KIB]), (MIB, [MIB]), (192 * KIB, [4 * MIB])]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("w1_max,w2", CASES)
def test_no_yardstick_is_past_the_raw_buffer(w1_max: int, w2: list[int]) -> None:
    _check_fits(w1_max, w2)


@pytest.mark.timeout(10)
def test_mutant_yardsticks_regardless_of_the_buffer_is_caught(monkeypatch) -> None:
    """The bug: 64 KiB, 1 MiB and 4 MiB always, whatever the buffer holds."""
    monkeypatch.setattr(world, "yard_sizes", lambda w2, block, nbytes: sorted({*w2, 64 * KIB, MIB, 4 * MIB}))
    with pytest.raises(AssertionError, match="past the 262144 B raw buffer"):
        _check_fits(*CASES[0])
