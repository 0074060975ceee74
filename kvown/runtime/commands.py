"""Commands: what the embedding API asks of a rank's driver, and what it answers with.

Owns: the typed commands (frozen dataclasses, matched by the driver), the close and status answers, and
``LiveRequests``. The handles, their phases and the ``Ticket`` live in ``kvown.runtime.handles`` (compiled
with the hot path) and are re-exported here.

Rules:
  1. API threads build commands and hand them to ``Driver.submit``; only the engine thread (the
     driver) reads them. A command is validated by the API before it is built (``kvown.api``); the
     driver still refuses what it cannot do, without allocating anything.
  2. A ``Receive`` is taken by the driver or withdrawn by its caller, never both: whoever acquires
     the ticket first wins (INV-CMD1). So a caller that gave up waiting never leaves blocks allocated and
     published with no handle.
  3. ``LiveRequests`` remembers how the last ``remember`` finished sessions per rank and role ended, as
     plain ints (no object per session for the GC), so a late release or cancel is a no-op reporting it.
"""

from __future__ import annotations

import collections
import enum
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from kvown.adapters.transport import Role
from kvown.core.actions import Outcome
from kvown.core.errors import KvownError, LocalProtocolError
from kvown.runtime.handles import (LazyEvent, LazyFuture, ReceiveHandle, ReceivePhase, SendHandle, SendPhase,
                                   Ticket, outcome_of)


class AdmissionError(KvownError):
    """A session was refused (fail-stop latched, receiver quarantined, stale epoch). Nothing was created."""


class CloseStatus(enum.Enum):
    """What a ``release`` / ``cancel`` call did (``CloseResult.status``). None of these is an error."""

    QUEUED = "queued"  # asked now: the session retires once every published writer is proven quiescent
    ALREADY_CLOSING = "already_closing"  # released, cancelled or concluded before: it retires by itself
    ALREADY_RETIRED = "already_retired"  # it retired already (e.g. a cancel won the race with the landing)
    REFUSED = "refused"  # the session never opened (admission refused): there is nothing to close


@dataclass(frozen=True, slots=True)
class CloseResult:
    """The answer of ``release`` / ``cancel``: what happened, and the session's outcome where known."""

    request_id: int
    status: CloseStatus
    outcome: Outcome | None = None


@dataclass(frozen=True, slots=True)
class SendStatus:
    """``Sender.status``: where a send is, and its outcome where committed."""

    request_id: int
    phase: SendPhase
    outcome: Outcome | None = None


@dataclass(frozen=True, slots=True)
class ReceiveStatus:
    """``Receiver.status``: where a receive is, and its outcome where committed."""

    request_id: int
    phase: ReceivePhase
    outcome: Outcome | None = None


class LiveRequests:
    """The request ids of this rank with a handle, per role: the API's duplicate-id check, and the
    memory of how finished sessions ended (rule 5).

    A handle is live until it finished (a send's ``released``, a receive's ``retired``, or an
    exception on its outcome). Called: by API threads, under this object's own lock; the driver
    never touches it (liveness is read from the handles, which the driver completes).
    """

    def __init__(self, remember: int = 65536) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[Role, int], Any] = {}
        # per role: request id -> _pack(its CloseResult), oldest first (popitem(last=False) is O(1); deleting
        # the first key of a plain dict is not: it measured 27 us per eviction once 65,536 were kept)
        self._closed = {role: collections.OrderedDict[int, int]() for role in Role}
        self._remember = remember
        self._prune_at = _PRUNE_MIN

    @staticmethod
    def _alive(entry: Any) -> bool:
        if isinstance(entry, Ticket):  # a receive not yet answered by the driver
            return not entry.future.done() or (not entry.future.failed() and _alive_handle(entry.future.result()))
        return _alive_handle(entry)

    def claim(self, role: Role, request_id: int, entry: Any) -> None:
        """Register ``entry`` for ``request_id``; ``LocalProtocolError`` if a live one exists (nothing changes)."""
        key = (role, request_id)
        with self._lock:
            current = self._entries.get(key)
            if current is not None and self._alive(current):
                raise LocalProtocolError(f"request id already has a live {role.value} session on this rank",
                                         field="request_id", request_id=request_id)
            self._entries[key] = entry
            self._closed[role].pop(request_id, None)
            if len(self._entries) >= self._prune_at:  # amortised: finished entries become records
                self._prune()

    def _prune(self) -> None:
        live = {}
        for key, entry in self._entries.items():
            if self._alive(entry):
                live[key] = entry
            else:
                closed = self._closed[key[0]]
                closed[key[1]] = _pack(_final(key[1], entry))
                if len(closed) > self._remember:
                    closed.popitem(last=False)
        self._entries = live
        self._prune_at = max(_PRUNE_MIN, 2 * len(self._entries))

    def replace(self, role: Role, request_id: int, entry: Any) -> None:
        with self._lock:
            self._entries[(role, request_id)] = entry

    def live(self, role: Role, request_id: int) -> Any:
        """The live entry (handle or ticket) for ``request_id``, or None."""
        with self._lock:
            entry = self._entries.get((role, request_id))
            return entry if entry is not None and self._alive(entry) else None

    def lookup(self, role: Role, request_id: int) -> tuple[Any, CloseResult | None]:
        """``(live entry, None)``, ``(None, how it ended)`` for a remembered finished session, or
        ``(None, None)`` for an id this rank never saw (or forgot, rule 5)."""
        key = (role, request_id)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                return (entry, None) if self._alive(entry) else (None, _final(request_id, entry))
            code = self._closed[role].get(request_id)
            return None, None if code is None else _unpack(request_id, code)


_PRUNE_MIN = 64  # claims between prunes at least (amortised O(1): the bound doubles with the live entries)
_STATUSES = tuple(CloseStatus)
_OUTCOMES: tuple[Outcome | None, ...] = (None, *Outcome)


def _pack(result: CloseResult) -> int:
    return _STATUSES.index(result.status) * len(_OUTCOMES) + _OUTCOMES.index(result.outcome)


def _unpack(request_id: int, code: int) -> CloseResult:
    status, outcome = divmod(code, len(_OUTCOMES))
    return CloseResult(request_id, _STATUSES[status], _OUTCOMES[outcome])


def _final(request_id: int, entry: Any) -> CloseResult:
    """How a finished entry ended (its handle retired / released, or it was refused)."""
    future = entry.future if isinstance(entry, Ticket) else entry.outcome
    if isinstance(entry, Ticket) and future.done() and not future.failed():
        future = future.result().outcome
    if future.failed():
        return CloseResult(request_id, CloseStatus.REFUSED)
    return CloseResult(request_id, CloseStatus.ALREADY_RETIRED, outcome_of(future))


def _alive_handle(handle: Any) -> bool:
    if handle.outcome.failed():
        return False
    done = handle.released if isinstance(handle, SendHandle) else handle.retired
    return not done.is_set()


class Command:
    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Send(Command):
    request_id: int
    src_blocks: tuple[int, ...]
    tokens: tuple[Any, ...]  # one ReadyToken per piece
    num_receivers: int
    aux: bytes | None
    handle: SendHandle
    dst_suffix: bool = False  # sender rule 4a: a receiver may publish a suffix of the source blocks


@dataclass(frozen=True, slots=True)
class Receive(Command):
    request_id: int
    num_blocks: int
    writers: tuple[int, ...]
    num_slices: int
    aux: bool
    ticket: Ticket
    blocks: tuple[int, ...] = ()  # bring-your-own memory: the blocks the server lends (else allocate)
    on_done: Callable[[Any], None] | None = None
    on_landed: Callable[[Any], None] | None = None


@dataclass(frozen=True, slots=True)
class Cancel(Command):
    role: Role
    request_id: int
    issued_ns: int  # the engine clock when the caller asked: cancel -> retired counts from here
    ready: Any = None  # receive side: the consumer's ready token (as for ``Release``)
    notify: tuple[int, ...] = ()  # receive side: writers to tell though nothing was published to them


@dataclass(frozen=True, slots=True)
class Release(Command):
    request_id: int
    issued_ns: int  # as for ``Cancel``: release -> retired counts from the caller's call
    ready: Any = None  # the consumer's ready token: nothing retires before it reports done


@dataclass(frozen=True, slots=True)
class LocalCopy(Command):
    request_id: int
    token: Any  # a ReadyToken recorded after the copy


@dataclass(frozen=True, slots=True)
class SetWatermark(Command):
    epoch: int


@dataclass(frozen=True, slots=True)
class Call(Command):
    """Run ``fn(driver)`` on the engine thread (tests, diagnostics, fault injection)."""

    fn: Callable[[Any], Any]
    future: Future[Any]


__all__ = ["AdmissionError", "Call", "Cancel", "CloseResult", "CloseStatus", "Command", "LazyEvent", "LazyFuture", "LiveRequests",
           "LocalCopy", "ReceiveHandle", "ReceivePhase", "Receive", "Release", "Send", "SendHandle", "SendPhase",
           "ReceiveStatus", "SendStatus", "SetWatermark", "Ticket"]
