"""Commands: what the embedding API asks of a rank's driver, and the handles it answers through.

Owns: the typed commands (frozen dataclasses, matched by the driver), the API handles (``SendHandle``,
``ReceiveHandle``) and the ``Ticket`` that lets a ``receive`` caller withdraw a command in time.

Rules:
  1. API threads build commands and hand them to ``Driver.submit``; only the engine thread (the
     driver) reads them. A command is validated by the API before it is built (``kvown.api``); the
     driver still refuses what it cannot do, without allocating anything.
  2. A handle is written by the driver only (``closing`` excepted: the API notes that the caller asked
     to release or cancel); API threads read it (``threading.Event``, ``Future``).
  3. A ``Receive`` is taken by the driver or withdrawn by its caller, never both: whoever acquires
     the ticket first wins. So a caller that gave up waiting never leaves blocks allocated and
     published with no handle.
  4. Every ``*_ns`` on a handle is the engine clock at the event itself (the driver stamps it when the
     event happens, not the step's start), or the caller's own call for ``cancelled_ns`` /
     ``released_ns`` of a receive: so a latency between two of them is never negative.
  5. ``LiveRequests`` remembers how the last ``remember`` finished sessions per rank and role ended, as
     plain ints (no object per session for the GC), so a late release or cancel is a no-op reporting it.

Invariants:
  INV-CMD1  ``Ticket.take`` and ``Ticket.withdraw`` together return True at most once.
  INV-CMD2  A ``LazyEvent`` / ``LazyFuture`` waiter sees a set made before or during its wait (docs/design.md 14).
  INV-CMD3  A ``LazyFuture`` runs each done-callback exactly once, after it is done (docs/design.md 17.1).
"""

from __future__ import annotations

import collections
import concurrent.futures
import enum
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from kvown.adapters.transport import Role
from kvown.core.actions import Outcome
from kvown.core.errors import KvownError


class LazyEvent:
    """``threading.Event``'s ``set`` / ``is_set`` / ``wait`` for API handles, without its cost.

    A handle has three of these and the engine sets each once per session; a ``threading.Event`` costs a
    ``Condition`` and a lock to create and a notify to set (~3 us on the reference VM, x3 per handle,
    x2 sides). Here the engine only writes a flag; the ``threading.Event`` behind a wait is created by
    the first waiter (INV-CMD2 gives the ordering), so a handle nobody waits on costs no lock at all.
    """

    __slots__ = ("_flag", "_event")
    _create = threading.Lock()  # waiters creating the event (rare; never taken by ``set``)

    def __init__(self) -> None:
        self._flag = False
        self._event: threading.Event | None = None

    def set(self) -> None:
        self._flag = True
        event = self._event  # read after the flag is written (INV-CMD2)
        if event is not None:
            event.set()

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        if self._flag:
            return True
        event = self._event
        if event is None:
            with LazyEvent._create:
                if self._event is None:
                    self._event = threading.Event()
                event = self._event
        if self._flag:  # set() may have run before our event was visible to it (INV-CMD2)
            return True  # type: ignore[unreachable]
        return event.wait(timeout)

    def __repr__(self) -> str:
        return f"LazyEvent(set={self._flag})"


_log = logging.getLogger(__name__)
_FIRED: tuple[Any, ...] = ()  # LazyFuture._callbacks once they ran (or were claimed to run)


class LazyFuture(Future[Any]):
    """A ``concurrent.futures.Future`` that builds no ``Condition`` until somebody waits.

    Set once by the engine, read by API threads. A ``Future`` creates a ``Condition`` (and its ``RLock``)
    at birth and takes it on every ``done`` / ``result`` / ``exception`` and notifies on ``set_*``; a
    handle's outcome and a receive's ticket are two per session per side, and nearly nobody waits on them.
    Here the value is a plain attribute written before a ``LazyEvent`` is set (so waiters get its
    INV-CMD2, and a reader that sees it set sees the value), and callbacks are claimed under one shared
    lock so each runs exactly once (INV-CMD3). It is a ``Future`` subclass so
    ``asyncio.wrap_future`` and ``isinstance`` checks keep working. It behaves as a ``Future`` marked
    running at birth: ``cancel`` is refused (a caller can never make the engine's ``set_*`` raise).
    """

    _claim = threading.Lock()  # callbacks being added or claimed (rare; never taken without callbacks)

    def __init__(self) -> None:  # no super().__init__(): that is the Condition this class avoids
        self._set = LazyEvent()
        self._value: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Future[Any]], object]] | tuple[Any, ...] | None = None

    # -- the engine's side
    def set_result(self, result: Any) -> None:
        self._settle(result, None)

    def set_exception(self, exception: BaseException | None) -> None:
        self._settle(None, exception)

    def _settle(self, value: Any, error: BaseException | None) -> None:
        if self._set.is_set():
            raise concurrent.futures.InvalidStateError(f"{self!r} is already done")
        self._value, self._error = value, error
        self._set.set()  # after the value: a reader that sees it set sees the value
        if self._callbacks is not None:  # read after the set (INV-CMD3)
            self._fire()

    def _fire(self) -> None:
        with LazyFuture._claim:
            callbacks, self._callbacks = self._callbacks, _FIRED
        for fn in callbacks or ():
            self._run(fn)

    def _run(self, fn: Callable[[Future[Any]], object]) -> None:
        try:
            fn(self)
        except Exception:  # noqa: BLE001 - as Future does: a caller's callback never breaks the engine
            _log.exception("a done-callback of %r raised", self)

    # -- the readers' side
    def done(self) -> bool:
        return self._set.is_set()

    def cancel(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def running(self) -> bool:
        return not self._set.is_set()

    def set_running_or_notify_cancel(self) -> bool:
        return True

    def _wait(self, timeout: float | None) -> None:
        if not self._set.wait(timeout):
            raise TimeoutError(f"{self!r} not done within {timeout} s")

    def result(self, timeout: float | None = None) -> Any:
        self._wait(timeout)
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        return self._error

    def add_done_callback(self, fn: Callable[[Future[Any]], object]) -> None:
        with LazyFuture._claim:
            pending = not self._set.is_set() and self._callbacks is not _FIRED
            if pending:
                self._callbacks = [*(self._callbacks or ()), fn]
        if not pending:
            self._run(fn)
        elif self._set.is_set():  # the engine may have settled before our list was visible to it (INV-CMD3)
            self._fire()

    def __repr__(self) -> str:
        state = "pending" if not self._set.is_set() else "error" if self._error is not None else "finished"
        return f"LazyFuture({state})"


class AdmissionError(KvownError):
    """A session was refused (fail-stop latched, receiver quarantined, stale epoch). Nothing was created."""


class SendPhase(enum.Enum):
    """Where a send session is (``SendHandle.phase``); each phase implies the ones before it."""

    OPEN = "open"  # waiting for a receiver to publish its destination
    PUBLISHED = "published"  # a receiver published; no WRITE posted yet (waiting for the ready token)
    POSTED = "posted"  # a WRITE was posted: the source blocks are being read
    RELEASED = "released"  # no WRITE can read the source blocks any more (quiesced): reuse them
    REFUSED = "refused"  # never opened (admission refused); nothing was posted


class ReceivePhase(enum.Enum):
    """Where a receive session is (``ReceiveHandle.phase``)."""

    PUBLISHED = "published"  # the destination was published to every writer; waiting for evidence
    LANDED = "landed"  # delivered: the KV may be read (until release)
    CONCLUDED = "concluded"  # ended without delivery (cancelled, failed, timed out): held until proof
    CLOSING = "closing"  # the caller released or cancelled it: retirement waits for proof
    RETIRED = "retired"  # the blocks are back in the pool (or with the server), with proof
    REFUSED = "refused"  # never opened (admission refused or pool exhausted); nothing was published


def _outcome_of(future: Future[Outcome]) -> Outcome | None:
    if not future.done() or future.exception() is not None:
        return None
    return future.result()


@dataclass(eq=False)
class SendHandle:
    """Returned by ``Sender.send``. ``released`` is set when no WRITE can still read the source blocks."""

    request_id: int
    outcome: Future[Outcome] = field(default_factory=LazyFuture)
    released: LazyEvent = field(default_factory=LazyEvent)
    opened_ns: int = 0
    published_ns: int = 0  # the first receiver's publication attached to this session
    posted_ns: int = 0  # the first WRITE was posted
    released_ns: int = 0
    on_done: Callable[[Any], None] | None = None  # called once on the engine thread after ``released``

    @property
    def phase(self) -> SendPhase:
        """Pure read (any thread): the furthest phase the driver has reported."""
        if self.outcome.done() and self.outcome.exception() is not None:
            return SendPhase.REFUSED
        if self.released.is_set():
            return SendPhase.RELEASED
        if self.posted_ns:
            return SendPhase.POSTED
        return SendPhase.PUBLISHED if self.published_ns else SendPhase.OPEN

    def result(self) -> Outcome | None:
        """The committed outcome, or None while the session is undecided (or was refused)."""
        return _outcome_of(self.outcome)


@dataclass(eq=False)
class ReceiveHandle:
    """Returned by ``Receiver.receive``. ``landed``: the KV may be read; ``retired``: blocks are back."""

    request_id: int
    blocks: tuple[int, ...] = ()
    aux_slot: int = -1
    outcome: Future[Outcome] = field(default_factory=LazyFuture)
    landed: LazyEvent = field(default_factory=LazyEvent)
    retired: LazyEvent = field(default_factory=LazyEvent)
    opened_ns: int = 0
    landed_ns: int = 0
    cancelled_ns: int = 0
    released_ns: int = 0
    retired_ns: int = 0
    closing: bool = False  # written by the API only: release or cancel was asked (no local copy after)
    on_done: Callable[[Any], None] | None = None  # called once on the engine thread after ``retired``

    @property
    def phase(self) -> ReceivePhase:
        """Pure read (any thread): the furthest phase the driver (or the caller's close) reached."""
        if self.outcome.done() and self.outcome.exception() is not None:
            return ReceivePhase.REFUSED
        if self.retired.is_set():
            return ReceivePhase.RETIRED
        if self.closing:
            return ReceivePhase.CLOSING
        if self.landed.is_set():
            return ReceivePhase.LANDED
        return ReceivePhase.CONCLUDED if self.outcome.done() else ReceivePhase.PUBLISHED

    def result(self) -> Outcome | None:
        """The committed outcome, or None while the session is undecided (or was refused)."""
        return _outcome_of(self.outcome)


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


class Ticket:
    """Rule 3: a one-shot latch shared by a ``Receive`` command and its caller, plus the caller's future."""

    def __init__(self) -> None:
        self._latch = threading.Lock()
        self.future: Future[Any] = LazyFuture()

    def take(self) -> bool:
        """The driver takes the command. False: the caller withdrew it. Called: engine thread."""
        return self._latch.acquire(blocking=False)

    withdraw = take  # the caller gives up; False: the driver already took it (wait for the handle)


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
            return not entry.future.done() or (entry.future.exception() is None and _alive_handle(entry.future.result()))
        return _alive_handle(entry)

    def claim(self, role: Role, request_id: int, entry: Any) -> None:
        """Register ``entry`` for ``request_id``; ``LocalProtocolError`` if a live one exists (nothing changes)."""
        from kvown.core.errors import LocalProtocolError

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
    if isinstance(entry, Ticket) and future.done() and future.exception() is None:
        future = future.result().outcome
    if future.done() and future.exception() is not None:
        return CloseResult(request_id, CloseStatus.REFUSED)
    return CloseResult(request_id, CloseStatus.ALREADY_RETIRED, _outcome_of(future))


def _alive_handle(handle: Any) -> bool:
    if handle.outcome.done() and handle.outcome.exception() is not None:
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
