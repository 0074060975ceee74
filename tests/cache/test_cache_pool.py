"""KVPool: storage, addresses, the FREE/OWNED/HELD life cycle and its accounting."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvown.cache import BlockState, KVLayout, KVPool, PoolExhausted, PoolStatistics
from kvown.core.errors import ConfigError, InvariantViolation, LocalProtocolError


def make_pool(num_blocks: int = 8) -> KVPool:
    layout = KVLayout.standard(num_layers=2, num_blocks=num_blocks, tokens_per_block=4, num_kv_heads=2, head_dim=8)
    return KVPool(layout)


@pytest.mark.timeout(10)
def test_storage_is_one_byte_tensor_and_blocks_are_contiguous_slices() -> None:
    pool = make_pool()
    size = pool.layout.block_nbytes
    assert pool.tensor.dtype.itemsize == 1 and pool.tensor.numel() == 8 * size
    assert pool.block_addr(3) == pool.base_addr + 3 * size
    view = pool.block_view(3)
    view.fill_(7)
    assert int(pool.tensor[3 * size : 4 * size].sum()) == 7 * size
    assert int(pool.tensor.sum()) == 7 * size  # the view aliased the pool; nothing else changed
    assert view.data_ptr() == pool.block_addr(3)
    with pytest.raises(LocalProtocolError):
        pool.block_view(8)
    with pytest.raises(LocalProtocolError):
        pool.block_addr(-1)


@pytest.mark.timeout(10)
def test_life_cycle_free_owned_held_free() -> None:
    pool = make_pool()
    blocks = pool.allocate(3, owner="req-1")
    assert blocks == (0, 1, 2)  # a fresh pool hands out one contiguous run
    assert pool.statistics() == PoolStatistics(total=8, free=5, owned=3, held=0)
    pool.hold(blocks[:2])
    assert [pool.state(b) for b in blocks] == [BlockState.HELD, BlockState.HELD, BlockState.OWNED]
    assert pool.statistics() == PoolStatistics(total=8, free=5, owned=1, held=2)
    assert pool.owned_by("req-1") == blocks
    pool.retire(blocks, owner="req-1")
    assert pool.statistics() == PoolStatistics(total=8, free=8, owned=0, held=0)
    assert pool.owned_by("req-1") == ()
    assert pool.allocate(3, owner="req-2") == (0, 1, 2)  # retired blocks come back in order
    pool.check(deep=True)


@pytest.mark.timeout(10)
def test_exhaustion_raises_and_changes_nothing() -> None:
    pool = make_pool()
    pool.allocate(6, owner="a")
    before = pool.statistics()
    with pytest.raises(PoolExhausted) as raised:
        pool.allocate(3, owner="b")
    assert raised.value.fields["requested"] == 3 and raised.value.fields["free"] == 2
    assert pool.statistics() == before and pool.owned_by("b") == ()
    pool.check(deep=True)


@pytest.mark.timeout(10)
def test_illegal_changes_raise_and_change_nothing() -> None:
    pool = make_pool()
    mine = pool.allocate(2, owner="a")
    theirs = pool.allocate(2, owner="b")
    pool.hold(theirs[:1])
    before = (pool.statistics(), [pool.state(b) for b in range(8)])
    attempts = [
        lambda: pool.hold([mine[0], 99]),  # out of range after a good id: the good one must not move
        lambda: pool.hold([mine[0], mine[0]]),  # duplicate
        lambda: pool.hold([theirs[0]]),  # already HELD
        lambda: pool.hold([7]),  # FREE
        lambda: pool.retire([mine[0], theirs[1]], owner="a"),  # another owner's block
        lambda: pool.retire([7], owner="a"),  # FREE: retire is not a second way to free
        lambda: pool.retire([mine[0]], owner=None),
        lambda: pool.allocate(-1, owner="c"),
        lambda: pool.allocate(1, owner=None),
    ]
    for attempt in attempts:
        with pytest.raises(LocalProtocolError) as raised:
            attempt()
        assert raised.value.fields["field"] in {"blocks", "owner", "num_blocks"}
        assert (pool.statistics(), [pool.state(b) for b in range(8)]) == before
    pool.check(deep=True)


@pytest.mark.timeout(10)
def test_allocate_zero_leaves_no_owner_entry() -> None:
    pool = make_pool()
    assert pool.allocate(0, owner="a") == ()
    assert pool.owned_by("a") == ()
    pool.check(deep=True)


@pytest.mark.timeout(10)
def test_check_catches_broken_bookkeeping() -> None:
    pool = make_pool()
    pool.allocate(2, owner="a")
    pool._num_owned += 1  # simulate a bug in a future change
    with pytest.raises(InvariantViolation, match="INV-POOL-1"):
        pool.check()
    pool._num_owned -= 1
    pool._state[5] = BlockState.HELD  # state table disagrees with the free list
    with pytest.raises(InvariantViolation, match="INV-POOL-2"):
        pool.check(deep=True)


@pytest.mark.timeout(10)
def test_device_must_exist() -> None:
    layout = make_pool().layout
    with pytest.raises(ConfigError) as raised:
        KVPool(layout, device="meta")
    assert raised.value.fields["field"] == "device"


@pytest.mark.timeout(30)
def test_allocate_and_retire_cost_does_not_grow_with_pool_size() -> None:
    # Rule 3, as a count not a timing: a mutation touches only its blocks. The O(1) check runs after
    # each mutation; a full scan would show up as state-list reads proportional to num_blocks.
    pool = make_pool(num_blocks=200_000)

    class CountingList(list):  # type: ignore[type-arg]
        reads = 0

        def __iter__(self):  # type: ignore[no-untyped-def]
            CountingList.reads += len(self)
            return super().__iter__()

    pool._state = CountingList(pool._state)
    for request in range(50):
        blocks = pool.allocate(4, owner=request)
        pool.hold(blocks[:2])
        pool.retire(blocks, owner=request)
    assert CountingList.reads == 0
    assert pool.statistics().free == 200_000


class PoolModel(RuleBasedStateMachine):
    """Random allocate/hold/retire sequences against a plain model; deep check after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(num_blocks=12)
        self.model: dict[int, tuple[str, BlockState]] = {}

    @rule(owner=st.sampled_from("abc"), count=st.integers(0, 6))
    def allocate(self, owner: str, count: int) -> None:
        free = 12 - len(self.model)
        if count > free:
            with pytest.raises(PoolExhausted):
                self.pool.allocate(count, owner)
            return
        for block in self.pool.allocate(count, owner):
            assert block not in self.model
            self.model[block] = (owner, BlockState.OWNED)

    @precondition(lambda self: any(s is BlockState.OWNED for _, s in self.model.values()))
    @rule(data=st.data())
    def hold(self, data: st.DataObject) -> None:
        owned = sorted(b for b, (_, s) in self.model.items() if s is BlockState.OWNED)
        chosen = data.draw(st.lists(st.sampled_from(owned), min_size=1, unique=True))
        self.pool.hold(chosen)
        for block in chosen:
            self.model[block] = (self.model[block][0], BlockState.HELD)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def retire(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted({o for o, _ in self.model.values()})))
        mine = sorted(b for b, (o, _) in self.model.items() if o == owner)
        chosen = data.draw(st.lists(st.sampled_from(mine), min_size=1, unique=True))
        self.pool.retire(chosen, owner)
        for block in chosen:
            del self.model[block]

    @invariant()
    def agrees_with_model(self) -> None:
        self.pool.check(deep=True)
        stats = self.pool.statistics()
        assert stats.owned == sum(s is BlockState.OWNED for _, s in self.model.values())
        assert stats.held == sum(s is BlockState.HELD for _, s in self.model.values())
        assert stats.free == 12 - len(self.model)
        for owner in "abc":
            assert set(self.pool.owned_by(owner)) == {b for b, (o, _) in self.model.items() if o == owner}


TestPoolModel = PoolModel.TestCase
TestPoolModel.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestPoolModel = pytest.mark.timeout(60)(TestPoolModel)


@pytest.mark.timeout(30)
def test_best_fit_keeps_a_session_in_one_run() -> None:
    """Rule 5: a free run long enough is used whole-session, the smallest such run first."""
    pool = make_pool(num_blocks=64)
    a, b, c, d = (pool.allocate(8, owner=o) for o in "abcd")
    assert (a, b, c, d) == tuple(tuple(range(i, i + 8)) for i in (0, 8, 16, 24))
    pool.retire(b, owner="b")
    pool.retire(d, owner="d")  # merges with the tail: free runs [8, 16) and [24, 64)
    assert pool.free_runs() == 2
    assert pool.allocate(8, owner="e") == tuple(range(8, 16))  # best fit, not the big run
    assert pool.allocate(20, owner="f") == tuple(range(24, 44))
    pool.retire(pool.owned_by("a"), owner="a")
    pool.retire(pool.owned_by("e"), owner="e")  # [0, 16) merged again
    assert pool.free_runs() == 2 and pool.allocate(16, owner="g") == tuple(range(16))
    pool.check(deep=True)


@pytest.mark.timeout(30)
def test_without_a_long_enough_run_the_fewest_pieces_are_taken() -> None:
    pool = make_pool(num_blocks=10)
    blocks = pool.allocate(10, owner="x")
    pool.retire([b for b in blocks if b in (0, 1, 4, 5, 6, 9)], owner="x")  # runs of 2, 3, 1
    got = pool.allocate(5, owner="y")
    assert sorted(got) == [0, 1, 4, 5, 6]  # the run of 3, then the run of 2: two pieces, not three
    assert pool.free_blocks() == (9,) and pool.free_runs() == 1
    pool.check(deep=True)


@pytest.mark.timeout(60)
def test_churn_keeps_sessions_contiguous_where_lifo_fragments() -> None:
    """A window of sessions retired out of order (the W1 pattern): every session stays one run."""
    import random

    rng = random.Random(7)
    pool = make_pool(num_blocks=512)  # at most half in use, as W1 sizes its pool
    live: list[tuple[int, tuple[int, ...]]] = []
    runs = []
    for i in range(400):
        if len(live) == 4:
            owner, blocks = live.pop(rng.randrange(4))
            pool.retire(blocks, owner=owner)
        blocks = pool.allocate(rng.choice((16, 32, 64)), owner=i)
        runs.append(1 + sum(1 for x, y in zip(blocks, blocks[1:]) if y != x + 1))
        live.append((i, blocks))
    assert max(runs) == 1
    pool.check(deep=True)
