"""``range`` block ids: the API's fast path for a contiguous run checks both ends like any sequence."""

from __future__ import annotations

import pytest

from kvown.core.errors import LocalProtocolError
from kvown.core.ids import make_request_id
from kvown.testing.sim import SimConfig, SimWorld


def _sender_and_blocks() -> tuple[object, int, object]:
    world = SimWorld(0, SimConfig(num_requests=1))
    tx = world.senders[0]
    return world.ranks[tx].api, tx, world.ranks[tx].driver


@pytest.mark.timeout(20)
@pytest.mark.parametrize("blocks",
                         [range(-1, 2), range(0, 10**6), range(3, 3), range(5, 1, -1), range(0, 8, 2)])
def test_bad_or_unusual_ranges_are_checked_like_any_sequence(blocks: range) -> None:
    api, _, driver = _sender_and_blocks()
    n = driver.pool.num_blocks
    queued = len(driver.inbox)
    expect_ok = len(blocks) > 0 and all(0 <= b < n for b in blocks)
    if expect_ok:
        api.send(make_request_id(9, 1), blocks)
        assert len(driver.inbox) == queued + 1
    else:
        with pytest.raises(LocalProtocolError) as e:
            api.send(make_request_id(9, 1), blocks)
        assert e.value.fields.get("field") == "src_blocks" and len(driver.inbox) == queued


@pytest.mark.timeout(20)
def test_a_run_past_the_last_block_is_refused() -> None:
    """The fast path's upper bound: a version that checks only the start accepts this run."""
    api, _, driver = _sender_and_blocks()
    n = driver.pool.num_blocks
    with pytest.raises(LocalProtocolError) as e:
        api.send(make_request_id(9, 2), range(n - 1, n + 1))
    assert e.value.fields.get("field") == "src_blocks"
    queued = len(driver.inbox)
    api.send(make_request_id(9, 3), range(n - 2, n))  # the last two blocks: in bounds
    assert len(driver.inbox) == queued + 1
