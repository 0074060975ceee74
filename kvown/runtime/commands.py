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

Invariants:
  INV-CMD1  ``Ticket.take`` and ``Ticket.withdraw`` together return True at most once.
  INV-CMD2  A ``LazyEvent`` waiter returns True if and only if ``set`` was called before or during
            its wait (the flag is written before the setter looks for a waiter's event, and the waiter
            publishes its event before it looks at the flag again).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from kvown.adapters.transport import Role
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
            return True
        return event.wait(timeout)

    def __repr__(self) -> str:
        return f"LazyEvent(set={self._flag})"


class AdmissionError(KvownError):
    """A session was refused (fail-stop latched, receiver quarantined, stale epoch). Nothing was created."""


@dataclass(eq=False)
class SendHandle:
    """Returned by ``Sender.send``. ``released`` is set when no WRITE can still read the source blocks."""

    request_id: int
    outcome: Future = field(default_factory=Future)
    released: LazyEvent = field(default_factory=LazyEvent)
    opened_ns: int = 0
    released_ns: int = 0
    on_done: Callable[[Any], None] | None = None  # called once on the engine thread after ``released``


@dataclass(eq=False)
class ReceiveHandle:
    """Returned by ``Receiver.receive``. ``landed``: the KV may be read; ``retired``: blocks are back."""

    request_id: int
    blocks: tuple[int, ...] = ()
    aux_slot: int = -1
    outcome: Future = field(default_factory=Future)
    landed: LazyEvent = field(default_factory=LazyEvent)
    retired: LazyEvent = field(default_factory=LazyEvent)
    opened_ns: int = 0
    landed_ns: int = 0
    cancelled_ns: int = 0
    released_ns: int = 0
    retired_ns: int = 0
    closing: bool = False  # written by the API only: release or cancel was asked (no local copy after)
    on_done: Callable[[Any], None] | None = None  # called once on the engine thread after ``retired``


class Ticket:
    """Rule 3: a one-shot latch shared by a ``Receive`` command and its caller, plus the caller's future."""

    def __init__(self) -> None:
        self._latch = threading.Lock()
        self.future: Future = Future()

    def take(self) -> bool:
        """The driver takes the command. False: the caller withdrew it. Called: engine thread."""
        return self._latch.acquire(blocking=False)

    withdraw = take  # the caller gives up; False: the driver already took it (wait for the handle)


class LiveRequests:
    """The request ids of this rank with a live handle, per role: the API's duplicate-id check.

    A handle is live until it finished (a send's ``released``, a receive's ``retired``, or an
    exception on its outcome). Called: by API threads, under this object's own lock; the driver
    never touches it (liveness is read from the handles, which the driver completes).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[Role, int], Any] = {}
        self._prune_at = 1024

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
            if len(self._entries) >= self._prune_at:  # amortised: drop finished entries
                self._entries = {k: v for k, v in self._entries.items() if self._alive(v)}
                self._prune_at = max(1024, 2 * len(self._entries))

    def replace(self, role: Role, request_id: int, entry: Any) -> None:
        with self._lock:
            self._entries[(role, request_id)] = entry

    def live(self, role: Role, request_id: int) -> Any:
        """The live entry (handle or ticket) for ``request_id``, or None."""
        with self._lock:
            entry = self._entries.get((role, request_id))
            return entry if entry is not None and self._alive(entry) else None


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


@dataclass(frozen=True, slots=True)
class Release(Command):
    request_id: int
    issued_ns: int  # as for ``Cancel``: release -> retired counts from the caller's call


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
    future: Future


__all__ = ["AdmissionError", "Call", "Cancel", "Command", "LazyEvent", "LiveRequests", "LocalCopy", "ReceiveHandle",
           "Receive", "Release", "Send", "SendHandle", "SetWatermark", "Ticket"]
