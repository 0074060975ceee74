"""Bring-your-own KV memory: the server's blocks, lent to kvown one request at a time.

Owns: the ownership state (FREE / OWNED / HELD) of every block of memory the embedding server
allocated itself - vLLM-style per-layer paged tensors, TensorRT-LLM-style data and scale pools, or
anything else that ``BlockSpace`` can describe - and the hand-back of lent blocks.

The server's allocator stays the only allocator: it lends a request's blocks
(``Receiver.receive(..., blocks=...)``), and kvown hands them back once, at retirement, through
``on_returned(request_id, blocks)``. FREE --lend--> OWNED --hold--> HELD; ``retire`` from either.

Rules:
  1. Blocks go back to the server only through ``retire``, and ``retire`` always calls
     ``on_returned`` once for the blocks it frees. Lending a block kvown still holds is refused: that
     would be two owners for one block (the "two allocators that disagree" bug).
  2. Every mutator validates all its arguments before it changes anything.
  3. Single writer: the engine thread. ``on_returned`` runs on the engine thread, so it must be quick
     and thread-safe (hand the ids to the server's allocator, or to a queue the server drains).

Invariants:
  INV-LENT-1  total == free + owned + held.
  INV-LENT-2  ``on_returned`` is called exactly once per lent set, with exactly the blocks lent.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Iterable

from kvown.cache.pool import PoolStatistics
from kvown.cache.space import BlockSpace
from kvown.core.errors import ConfigError, InvariantViolation, LocalProtocolError


class LentState(enum.Enum):
    FREE = "FREE"  # the server's: kvown holds nothing here
    OWNED = "OWNED"  # lent to kvown for one request; writers may be writing
    HELD = "HELD"  # the request ended without proof; waiting for it (or for fail-stop)


class LentBlocks:
    """The ownership ledger over a server's own memory, described by ``space``."""

    def __init__(self, space: BlockSpace, on_returned: Callable[[Hashable, tuple[int, ...]], None]) -> None:
        if not callable(on_returned):
            raise ConfigError("on_returned must be callable", field="on_returned")
        self._space = space
        self._on_returned = on_returned
        self._state = [LentState.FREE] * space.num_blocks
        self._owner: list[Hashable | None] = [None] * space.num_blocks
        self._by_owner: dict[Hashable, tuple[int, ...]] = {}
        self._owned = self._held = 0

    @property
    def num_blocks(self) -> int:
        return self._space.num_blocks

    def space(self) -> BlockSpace:
        return self._space

    def heads(self) -> int:
        """Heads a fan-in may split (every region's heads must divide by the slice count)."""
        import math

        return math.gcd(*(r.heads for r in self._space.regions))

    def allocate(self, num_blocks: int, owner: Hashable) -> tuple[int, ...]:
        raise LocalProtocolError("this rank's KV memory belongs to the server: lend blocks with receive(blocks=...)",
                                 field="num_blocks", owner=owner)

    def lend(self, blocks: Iterable[int], owner: Hashable) -> tuple[int, ...]:
        """FREE -> OWNED for ``owner``. After error: ``LocalProtocolError``; nothing changed (rule 2)."""
        blocks = tuple(blocks)
        if owner is None or owner in self._by_owner:
            raise LocalProtocolError("owner already holds lent blocks", field="owner", owner=owner)
        if not blocks or len(set(blocks)) != len(blocks):
            raise LocalProtocolError("lend a non-empty list of distinct blocks", field="blocks")
        for b in blocks:
            if type(b) is not int or not 0 <= b < self.num_blocks:
                raise LocalProtocolError("block id out of range", field="blocks", block=b, num_blocks=self.num_blocks)
            if self._state[b] is not LentState.FREE:
                raise LocalProtocolError("block is still held by kvown (two owners for one block)", field="blocks",
                                         block=b, state=self._state[b].name, owner=self._owner[b])
        for b in blocks:
            self._state[b], self._owner[b] = LentState.OWNED, owner
        self._by_owner[owner] = blocks
        self._owned += len(blocks)
        self.check()
        return blocks

    def hold(self, blocks: Iterable[int]) -> None:
        blocks = tuple(blocks)
        if any(self._state[b] is not LentState.OWNED for b in blocks):
            raise LocalProtocolError("only OWNED blocks can be held", field="blocks")
        for b in blocks:
            self._state[b] = LentState.HELD
        self._owned -= len(blocks)
        self._held += len(blocks)
        self.check()

    def retire(self, blocks: Iterable[int], owner: Hashable) -> None:
        """OWNED or HELD -> FREE, and the blocks go back to the server (rule 1)."""
        blocks = tuple(blocks)
        if self._by_owner.get(owner) != blocks:
            raise LocalProtocolError("retire exactly the blocks lent for this owner", field="blocks", owner=owner)
        for b in blocks:
            if self._state[b] is LentState.HELD:
                self._held -= 1
            else:
                self._owned -= 1
            self._state[b], self._owner[b] = LentState.FREE, None
        del self._by_owner[owner]
        self.check()
        self._on_returned(owner, blocks)

    def statistics(self) -> PoolStatistics:
        total = self.num_blocks
        return PoolStatistics(total=total, free=total - self._owned - self._held, owned=self._owned, held=self._held)

    def check(self) -> None:
        stats = self.statistics()
        if stats.free < 0 or stats.total != stats.free + stats.owned + stats.held:
            raise InvariantViolation("INV-LENT-1: total != free + owned + held", statistics=stats)
