"""Cancellation fences: a permanent, compact record that a request id is cancelled.

Owns: which request ids are fenced on this rank, and the first origin of each fence.

Rules:
  1. A fence is installed by the first cancellation of an id (local client cancel, peer
     CANCEL_SESSION, timeout) and is never removed for that id while its epoch can still be admitted.
     Any later session for a fenced id is born cancelled.
  2. The first origin wins: a later cancel of the same id does not change it.
  3. Compaction is by epoch only: ``compact_below(w)`` drops every fence of epoch < w, and from then on
     ``admissible(id)`` is False for those ids, so a dropped fence can never be needed again.
     Callers pass the *world-wide* watermark (minimum over all ranks), never a local guess.

Memory: ids are stored per epoch as ``seq + 1`` in an open-addressing table of 32-bit slots plus one
origin byte per slot, kept between 1/3 and 2/3 full: 7.5 to 15 bytes per fenced id. Membership is O(1)
expected (linear probing over a multiplicative hash). ``kvown bench cost --parts fence`` measures both.

Invariants:
  INV-F1: once ``is_fenced(id)`` is True it stays True until ``admissible(id)`` is False.
  INV-F2: ``origin(id)`` never changes after the first ``install``.
"""

from __future__ import annotations

import enum
from array import array

from kvown.core.actions import Outcome
from kvown.core.ids import split_request_id

_MIN_SLOTS = 16
_MAX_LOAD_NUM, _MAX_LOAD_DEN = 2, 3  # grow beyond 2/3 full
_HASH_MUL = 0x9E3779B1  # Knuth's multiplicative constant (golden ratio * 2**32)


class CancelOrigin(enum.IntEnum):
    """Who cancelled first. Stored as one byte per fenced id."""

    CLIENT = 1  # the embedding server cancelled on this rank
    PEER = 2  # a peer's CANCEL_SESSION
    TIMEOUT = 3  # the request deadline passed
    FAILURE = 4  # a transfer failed or went in doubt
    SHUTDOWN = 5


# The fence origin of a session that concluded without completing (both cores install it then).
ORIGIN_OF_OUTCOME = {
    Outcome.CANCELLED: CancelOrigin.CLIENT,
    Outcome.FAILED: CancelOrigin.FAILURE,
    Outcome.TIMED_OUT: CancelOrigin.TIMEOUT,
}

class _SeqTable:
    """Open-addressing set of 32-bit seqs (stored as seq + 1; 0 marks an empty slot) with a byte each."""

    __slots__ = ("keys", "origins", "count", "mask")

    def __init__(self, slots: int = _MIN_SLOTS) -> None:
        self.keys = array("I", bytes(4 * slots))
        self.origins = bytearray(slots)
        self.count = 0
        self.mask = slots - 1

    def _slot(self, key: int) -> int:
        keys, mask = self.keys, self.mask
        i = (key * _HASH_MUL) & mask
        while True:
            k = keys[i]
            if k == key or k == 0:
                return i
            i = (i + 1) & mask

    def get(self, seq: int) -> int:
        """Origin byte, or 0 when absent."""
        i = self._slot(seq + 1)
        return self.origins[i] if self.keys[i] else 0

    def add(self, seq: int, origin: int) -> int:
        """Insert if absent; return the stored origin (the first one)."""
        key = seq + 1
        i = self._slot(key)
        if self.keys[i]:
            return self.origins[i]
        if (self.count + 1) * _MAX_LOAD_DEN > (self.mask + 1) * _MAX_LOAD_NUM:
            self._grow()
            i = self._slot(key)
        self.keys[i] = key
        self.origins[i] = origin
        self.count += 1
        return origin

    def _grow(self) -> None:
        old_keys, old_origins = self.keys, self.origins
        self.__init__((self.mask + 1) * 2)  # type: ignore[misc]
        for i, key in enumerate(old_keys):
            if key:
                j = self._slot(key)
                self.keys[j] = key
                self.origins[j] = old_origins[i]
                self.count += 1

    def nbytes(self) -> int:
        return self.keys.itemsize * len(self.keys) + len(self.origins)


class CancellationFence:
    """The set of cancelled request ids on one rank. Pure data; single-threaded (engine thread)."""

    __slots__ = ("_tables", "_watermark")

    def __init__(self) -> None:
        self._tables: dict[int, _SeqTable] = {}
        self._watermark = 0  # lowest epoch that may still be admitted world-wide

    @property
    def watermark(self) -> int:
        return self._watermark

    def admissible(self, request_id: int) -> bool:
        """False for ids whose epoch is below the world-wide watermark (stale: refuse them)."""
        return split_request_id(request_id)[0] >= self._watermark

    def install(self, request_id: int, origin: CancelOrigin) -> CancelOrigin:
        """Fence ``request_id``; return the origin that stands (the first one). Idempotent.

        Called: on every cancellation, from the engine thread. The id must be admissible.
        """
        epoch, seq = split_request_id(request_id)
        table = self._tables.get(epoch)
        if table is None:
            table = self._tables[epoch] = _SeqTable()
        return CancelOrigin(table.add(seq, int(origin)))

    def is_fenced(self, request_id: int) -> bool:
        epoch, seq = split_request_id(request_id)
        table = self._tables.get(epoch)
        return table is not None and table.get(seq) != 0

    def origin(self, request_id: int) -> CancelOrigin | None:
        epoch, seq = split_request_id(request_id)
        table = self._tables.get(epoch)
        value = table.get(seq) if table is not None else 0
        return CancelOrigin(value) if value else None

    def compact_below(self, watermark_epoch: int) -> int:
        """Drop fences of every epoch < ``watermark_epoch``; return how many ids were dropped.

        The watermark never moves backwards (a lower value is ignored).
        """
        if watermark_epoch <= self._watermark:
            return 0
        self._watermark = watermark_epoch
        dropped = 0
        for epoch in [e for e in self._tables if e < watermark_epoch]:
            dropped += self._tables.pop(epoch).count
        return dropped

    def __len__(self) -> int:
        return sum(t.count for t in self._tables.values())

    def nbytes(self) -> int:
        """Bytes held by the fence tables' storage (slots and origin bytes)."""
        return sum(t.nbytes() for t in self._tables.values())
