"""The rank's view: an immutable picture of what callers validate against (peers, pool geometry, aux).

Owns: ``RankView`` and ``PeerView`` (frozen), and ``ViewCell``, the one place that holds the current
view and lets callers wait for a newer one.

Rules:
  1. A view is never changed; the engine thread builds a new one whenever what it describes changes
     (a peer was loaded) and swaps it in whole. Other threads read ``ViewCell.view`` (one attribute
     read) and never see a half-updated picture, and never touch the driver's mutable tables.
  2. ``wait_until`` is bounded by its caller's timeout and returns the view it saw last.

Invariants:
  INV-VW1  ``ViewCell.version`` only grows, and a published view is never mutated afterwards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvown.adapters.transport import PeerInfo, Role


@dataclass(frozen=True, slots=True)
class PeerView:
    """One loaded peer rank, as this rank knows it."""

    rank: int
    roles: frozenset[Role]
    agent_name: str
    metadata_nbytes: int

    @classmethod
    def of(cls, info: PeerInfo) -> PeerView:
        return cls(info.rank, frozenset(info.roles), info.agent_name, len(info.agent_metadata))


@dataclass(frozen=True, slots=True)
class RankView:
    """What one rank is: roles, loaded peers, the geometry of its KV memory and of its aux slots."""

    rank: int
    roles: frozenset[Role]
    peers: Mapping[int, PeerView]
    num_blocks: int
    num_kv_heads: int
    block_nbytes: int
    aux_slots: int
    aux_slot_nbytes: int
    lent: bool  # the KV memory is the server's own (bring your own): receive(blocks=...)
    version: int = 0

    def writers(self) -> tuple[int, ...]:
        """Loaded peers with the sender role, ascending."""
        return tuple(sorted(r for r, p in self.peers.items() if Role.SENDER in p.roles))

    def readers(self) -> tuple[int, ...]:
        """Loaded peers with the receiver role, ascending."""
        return tuple(sorted(r for r, p in self.peers.items() if Role.RECEIVER in p.roles))


def frozen_peers(peers: Mapping[int, PeerInfo]) -> Mapping[int, PeerView]:
    return MappingProxyType({r: PeerView.of(p) for r, p in sorted(peers.items())})


class ViewCell:
    """Holds the current ``RankView``. ``publish`` from the engine thread (or before it starts)."""

    def __init__(self, view: RankView) -> None:
        self._cond = threading.Condition(threading.Lock())
        self.view = view

    @property
    def version(self) -> int:
        return self.view.version

    def publish(self, make: Callable[[int], RankView]) -> RankView:
        """Swap in ``make(next_version)`` and wake waiters (rule 1)."""
        with self._cond:
            view = make(self.view.version + 1)
            self.view = view
            self._cond.notify_all()
        return view

    def wait_until(self, predicate: Callable[[RankView], bool], timeout_s: float) -> tuple[bool, RankView]:
        """Wait (bounded) until ``predicate(view)`` holds; returns (held, the last view seen)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate(self.view):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False, self.view
                self._cond.wait(left)
            return True, self.view


__all__ = ["PeerView", "RankView", "ViewCell", "frozen_peers"]
