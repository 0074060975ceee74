"""Handles: what the engine writes once per session and API threads read (compiled: kvown.runtime.build).

Owns: ``LazyEvent`` and ``LazyFuture`` (an Event / Future that costs no lock until somebody waits), the
API handles ``SendHandle`` / ``ReceiveHandle`` with their phases, and the ``Ticket`` of a ``Receive``.

Rules:
  1. A handle is written by the driver only (``closing`` excepted: the API notes that the caller asked to
     release or cancel); API threads read it. The engine never blocks on a handle.
  2. Every ``*_ns`` on a handle is the engine clock at the event itself, or the caller's own call for a
     receive's ``cancelled_ns`` / ``released_ns``: a latency between two of them is never negative.
  3. A ``Ticket`` is taken by the driver or withdrawn by its caller, never both.
  4. Plain classes with their own ``__init__`` (a dataclass ``__init__`` stays interpreted under mypyc);
     ``LazyFuture`` is the one non-native class: it subclasses ``concurrent.futures.Future`` so
     ``asyncio.wrap_future`` and ``isinstance`` keep working.

Invariants:
  INV-CMD1  ``Ticket.take`` and ``Ticket.withdraw`` together return True at most once.
  INV-CMD2  A ``LazyEvent`` / ``LazyFuture`` waiter sees a set made before or during its wait (docs/design.md 14).
  INV-CMD3  A ``LazyFuture`` runs each done-callback exactly once, after it is done (docs/design.md 17.1).
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable, Final

from kvown.core.actions import Outcome

_log = logging.getLogger(__name__)
_CREATE: Final = threading.Lock()  # waiters creating a LazyEvent's event (rare; never taken by ``set``)
_CLAIM: Final = threading.Lock()  # LazyFuture callbacks being added or claimed (never taken without callbacks)
_FIRED: Final[tuple[Any, ...]] = ()  # LazyFuture._callbacks once they ran (or were claimed to run)


class LazyEvent:
    """``threading.Event``'s ``set`` / ``is_set`` / ``wait`` for API handles, without its cost.

    A handle has up to three of these and the engine sets each once per session; a ``threading.Event``
    costs a ``Condition`` and a lock to create and a notify to set. Here the engine only writes a flag;
    the ``threading.Event`` behind a wait is created by the first waiter (INV-CMD2 gives the ordering),
    so a handle nobody waits on costs no lock at all.
    """

    __slots__ = ("_flag", "_event")

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
            with _CREATE:
                if self._event is None:
                    self._event = threading.Event()
                event = self._event
        if self._flag:  # set() may have run before our event was visible to it (INV-CMD2)
            return True  # type: ignore[unreachable]
        return event.wait(timeout)

    def __repr__(self) -> str:
        return f"LazyEvent(set={self._flag})"


class LazyFuture(Future[Any]):
    """A ``concurrent.futures.Future`` that builds no ``Condition`` until somebody waits.

    Set once by the engine, read by API threads. A ``Future`` creates a ``Condition`` (and its ``RLock``)
    at birth and takes it on every ``done`` / ``result`` / ``exception`` and notifies on ``set_*``; a
    handle's outcome and a receive's ticket are two per session per side, and nearly nobody waits on them.
    Here the value is a plain attribute written before a ``LazyEvent`` is set (so waiters get its
    INV-CMD2, and a reader that sees it set sees the value), and callbacks are claimed under one shared
    lock so each runs exactly once (INV-CMD3). It behaves as a ``Future`` marked running at birth:
    ``cancel`` is refused (a caller can never make the engine's ``set_*`` raise).
    """

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
        with _CLAIM:
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

    def failed(self) -> bool:
        """Done with an exception (kvown's own cheap read, no wait: ``done() and exception() is not None``)."""
        return self._set.is_set() and self._error is not None  # the flag first: then the error is written

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
        with _CLAIM:
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


def outcome_of(future: LazyFuture) -> Outcome | None:
    """The committed outcome of a handle's future, or None while undecided (or refused). No wait."""
    if not future.done() or future.failed():
        return None
    result: Outcome = future.result()
    return result


class SendHandle:
    """Returned by ``Sender.send``. ``released`` is set when no WRITE can still read the source blocks."""

    __slots__ = ("request_id", "outcome", "released", "opened_ns", "published_ns", "posted_ns", "released_ns",
                 "on_done")

    def __init__(self, request_id: int, on_done: Callable[[Any], None] | None = None) -> None:
        self.request_id = request_id
        self.outcome = LazyFuture()
        self.released = LazyEvent()
        self.opened_ns = 0
        self.published_ns = 0  # the first receiver's publication attached to this session
        self.posted_ns = 0  # the first WRITE was posted
        self.released_ns = 0
        self.on_done = on_done  # called once on the engine thread after ``released``

    @property
    def phase(self) -> SendPhase:
        """Pure read (any thread): the furthest phase the driver has reported."""
        if self.outcome.failed():
            return SendPhase.REFUSED
        if self.released.is_set():
            return SendPhase.RELEASED
        if self.posted_ns:
            return SendPhase.POSTED
        return SendPhase.PUBLISHED if self.published_ns else SendPhase.OPEN

    def result(self) -> Outcome | None:
        """The committed outcome, or None while the session is undecided (or was refused)."""
        return outcome_of(self.outcome)

    def __repr__(self) -> str:
        return f"SendHandle(request_id={self.request_id}, phase={self.phase.value})"


class ReceiveHandle:
    """Returned by ``Receiver.receive``. ``landed``: the KV may be read; ``retired``: blocks are back."""

    __slots__ = ("request_id", "blocks", "aux_slot", "outcome", "landed", "retired", "opened_ns", "landed_ns",
                 "cancelled_ns", "released_ns", "retired_ns", "closing", "on_done", "on_landed")

    def __init__(self, request_id: int, blocks: tuple[int, ...] = (), aux_slot: int = -1, opened_ns: int = 0,
                 on_done: Callable[[Any], None] | None = None,
                 on_landed: Callable[[Any], None] | None = None) -> None:
        self.request_id = request_id
        self.blocks = blocks
        self.aux_slot = aux_slot
        self.outcome = LazyFuture()
        self.landed = LazyEvent()
        self.retired = LazyEvent()
        self.opened_ns = opened_ns
        self.landed_ns = 0
        self.cancelled_ns = 0
        self.released_ns = 0
        self.retired_ns = 0
        self.closing = False  # written by the API only: release or cancel was asked (no local copy after)
        self.on_done = on_done  # called once on the engine thread after ``retired``
        self.on_landed = on_landed  # called once on the engine thread after ``landed``

    @property
    def phase(self) -> ReceivePhase:
        """Pure read (any thread): the furthest phase the driver (or the caller's close) reached."""
        if self.outcome.failed():
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
        return outcome_of(self.outcome)

    def __repr__(self) -> str:
        return (f"ReceiveHandle(request_id={self.request_id}, blocks={len(self.blocks)}, "
                f"phase={self.phase.value})")


class Ticket:
    """Rule 3: a one-shot latch shared by a ``Receive`` command and its caller, plus the caller's future."""

    __slots__ = ("_latch", "future")

    def __init__(self) -> None:
        self._latch = threading.Lock()
        self.future = LazyFuture()

    def take(self) -> bool:
        """The driver takes the command. False: the caller withdrew it. Called: engine thread."""
        return self._latch.acquire(blocking=False)

    def withdraw(self) -> bool:
        """The caller gives up. False: the driver already took it (wait for the handle). Any thread."""
        return self._latch.acquire(blocking=False)
