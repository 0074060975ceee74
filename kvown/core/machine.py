"""What the sender and receiver cores share: configuration, the fatal latch, deadlines, watermarks.

Owns: one rank's fatal latch, its cancellation fence, its deadline heap and the watermarks peers
advertised.

Rules:
  1. ``handle(event, now_ns)`` is the only entry point that mutates; ``now_ns`` must never go
     backwards. It first applies time (timeouts, then fatal deadlines), then the event.
  2. The fatal latch is sticky: once a ``FailStop`` was returned, admission stays closed, nothing
     retires and no evidence changes anything.
  3. Only ``handle`` mutates. Everything else a second thread may call (``check_fatal``,
     ``next_deadline_ns``, ``nearest_fail_stop_ns``, ``sessions_by_state``) is pure: it reads and
     changes nothing, so a watchdog holding the engine's lock can never disturb the engine's state
     (stale deadline-heap entries are dropped by ``handle``, never by a reader).
  4. An illegal (state, input) pair raises and leaves the state unchanged: handlers validate first,
     then mutate. Time is applied before the event, so when the event then raises, the actions that
     time produced are not lost: the next ``handle`` call returns them first.
  5. Defence in depth: a message addressed to another rank is refused here too (``dst_rank``), not
     only by the stream layer, and admission honours this rank's own watermark as well as the
     world's.

Invariants:
  INV-C1: after a FailStop, ``handle`` returns no action other than ``AdmissionRefused``.
  INV-C2: ``now_ns`` is non-decreasing across calls.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Generic, Iterable, TypeVar

from kvown.core.actions import Action, AdmissionRefused, FailStop
from kvown.core.errors import ConfigError, LocalProtocolError, PeerProtocolError
from kvown.core.events import Event, MessageReceived, Tick, WatermarkSet
from kvown.core.fence import CancellationFence
from kvown.core.ids import split_request_id
from kvown.core.messages import MAX_RANK, Watermark

T = TypeVar("T")


def python_class(cls: type[T]) -> type[T]:
    """Keep ``cls`` a Python class in the compiled build (mypyc makes a class with an unknown decorator
    non-native). For a class whose constructor validates untrusted values: a native class type-checks
    its fields before ``__post_init__`` runs, so a bad value would raise TypeError, not ConfigError."""
    return cls


@python_class
@dataclass(frozen=True, slots=True)
class CoreConfig:
    """Static configuration of one rank's core. Validated on construction (``ConfigError``)."""

    rank: int
    timeout_ns: int  # request deadline after first exposure
    grace_ns: int  # how long a drain may take before unproven claims are fatal
    peers: tuple[int, ...] = ()  # ranks whose watermarks bound fence compaction

    def __post_init__(self) -> None:
        if type(self.rank) is not int or not (0 <= self.rank <= MAX_RANK):
            raise ConfigError("rank out of range", field="rank", value=self.rank)
        for name in ("timeout_ns", "grace_ns"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ConfigError("must be a positive integer of nanoseconds", field=name, value=value)
        if self.rank in self.peers or len(set(self.peers)) != len(self.peers):
            raise ConfigError("peers must be distinct and exclude this rank", field="peers", value=self.peers)


S = TypeVar("S")  # the session type


class RankCore(Generic[S]):
    """Base of ``SenderCore`` and ``ReceiverCore``."""

    def __init__(self, config: CoreConfig) -> None:
        self.config = config
        self.fence = CancellationFence()
        self.sessions: dict[int, S] = {}  # live sessions only: retired ones are dropped
        self.fatal: FailStop | None = None
        self.counters: dict[str, int] = {}
        self._now_ns = -1
        self._carried: list[Action] = []  # time-driven actions of a call whose event then raised
        self._deadlines: list[tuple[int, int]] = []  # (deadline_ns, request_id) heap; stale entries are fine
        self._queued: set[tuple[int, int]] = set()  # what the heap holds, so a deadline is pushed once
        self._local_watermark = 0
        self._peer_watermarks: dict[int, int] = {}

    # ---- entry points -------------------------------------------------------------------------

    def handle(self, event: Event, now_ns: int) -> list[Action]:
        """Apply time, then ``event``. Called: from the engine thread only."""
        if now_ns < self._now_ns:
            raise LocalProtocolError("clock went backwards", field="now_ns", now_ns=now_ns, last_ns=self._now_ns)
        self._now_ns = now_ns
        actions, self._carried = self._carried, []
        if self.fatal is None:
            self._advance(now_ns, actions)
        if self.fatal is not None:  # latched now (actions holds the FailStop) or earlier
            return actions + self._refuse_after_fatal(event)
        try:
            self._apply(event, now_ns, actions)
        except Exception:
            # The event is rejected, but the time it carried was applied: keep those actions for the
            # next call (next_deadline_ns() says "now") instead of losing them with the exception.
            self._carried = actions
            raise
        finally:
            self._prune()
        return actions

    def _apply(self, event: Event, now_ns: int, actions: list[Action]) -> None:
        t = type(event)  # final classes (events rule 4): one identity test each
        if t is Tick:
            return  # only time passed, and _advance applied it (events rule 3)
        if t is WatermarkSet:
            self._on_local_watermark(event.epoch, actions)  # type: ignore[attr-defined]
            return
        if t is MessageReceived:
            envelope = event.envelope  # type: ignore[attr-defined]
            if envelope.dst_rank != self.config.rank:
                raise PeerProtocolError("message addressed to another rank", field="dst_rank",
                                        got=envelope.dst_rank, rank=self.config.rank)
            m = envelope.message
            if type(m) is Watermark:
                if m.rank == envelope.src_rank and m.rank in self.config.peers:
                    self._peer_watermarks[m.rank] = max(m.epoch, self._peer_watermarks.get(m.rank, 0))
                    self._compact()
                else:
                    self._count("foreign_watermarks")
                return
        self._dispatch(event, now_ns, actions)

    def next_deadline_ns(self) -> int | None:
        """Pure: when the driver must call ``handle(Tick(), now)`` next, or None if no clock runs.

        The head of the heap may be stale (its session retired): then the driver ticks a little early
        and ``handle`` drops the entry. Called: by the engine thread and, under the lock, the watchdog.
        """
        if self.fatal is not None:
            return None
        if self._carried:
            return self._now_ns  # actions of an earlier call are waiting: call handle(Tick()) now
        return self._deadlines[0][0] if self._deadlines else None

    def check_fatal(self, now_ns: int) -> FailStop | None:
        """Pure: the FailStop that ``handle`` would return at ``now_ns``, without mutating anything.

        Called: by the retirement watchdog thread every <= 10 ms, under the engine's core lock.
        """
        if self.fatal is not None:
            return self.fatal
        if not self._carried and (not self._deadlines or self._deadlines[0][0] > now_ns):
            # O(1): the heap holds every session's current deadlines (fatal ones included, after
            # every input), so its earliest entry bounds every fatal deadline from below. The
            # watchdog asks every <= 10 ms under the engine's lock: a scan of 10,000 sessions there
            # would hold that lock for tens of ms. The scan below runs only when a deadline is due.
            return None
        for request_id, session in self.sessions.items():
            deadline = self._fatal_deadline_ns(session)
            if deadline is not None and now_ns >= deadline:
                return self._fatal_action(request_id, session)
        return None

    def nearest_fail_stop_ns(self) -> int | None:
        """Pure: the earliest fail-stop deadline over sessions with open claims (for statistics)."""
        deadlines = (self._fatal_deadline_ns(session) for session in self.sessions.values())
        return min((d for d in deadlines if d is not None), default=None)

    def sessions_by_state(self) -> dict[str, int]:
        """Pure: live sessions counted by state name (for statistics)."""
        counts: dict[str, int] = {}
        for session in self.sessions.values():
            name = self._state_name(session)
            counts[name] = counts.get(name, 0) + 1
        return counts

    # ---- for subclasses -----------------------------------------------------------------------

    def _state_name(self, session: S) -> str:
        raise NotImplementedError

    def _dispatch(self, event: Event, now_ns: int, actions: list[Action]) -> None:
        raise NotImplementedError

    def _evaluate(self, request_id: int, session: S, now_ns: int, actions: list[Action]) -> None:
        """Apply timeouts that are due for one session (called from ``_advance``)."""
        raise NotImplementedError

    def _fatal_deadline_ns(self, session: S) -> int | None:
        """The fail-stop instant of a session with open claims, or None if it has none."""
        raise NotImplementedError

    def _fatal_action(self, request_id: int, session: S) -> FailStop:
        """Pure: describe why ``session`` is fatal (its open claims)."""
        raise NotImplementedError

    def _mark_fatal(self, session: S) -> None:
        """Move the session that tripped the deadline to its FATAL state."""
        raise NotImplementedError

    def _refuse_after_fatal(self, event: Event) -> list[Action]:
        request_id = getattr(event, "request_id", None)
        if self._is_admission(event) and request_id is not None:
            return [AdmissionRefused(request_id, "fatal: this rank is fail-stopping")]
        self._count("events_after_fatal")
        return []

    def _is_admission(self, event: Event) -> bool:
        return False

    # ---- shared machinery ---------------------------------------------------------------------

    def _advance(self, now_ns: int, actions: list[Action]) -> None:
        """Pop due deadlines; for each live session apply its timeout, then check its fatal deadline."""
        while self._deadlines and self._deadlines[0][0] <= now_ns and self.fatal is None:
            entry = heapq.heappop(self._deadlines)
            self._queued.discard(entry)
            request_id = entry[1]
            session = self.sessions.get(request_id)
            if session is None:
                continue
            self._evaluate(request_id, session, now_ns, actions)
            if request_id not in self.sessions:
                continue
            deadline = self._fatal_deadline_ns(session)
            if deadline is not None and now_ns >= deadline:
                self.fatal = self._fatal_action(request_id, session)
                self._mark_fatal(session)
                actions.append(self.fatal)
                return
            self._schedule(request_id, session)

    def _prune(self) -> None:
        """Drop heap heads whose session is gone, so ``next_deadline_ns`` (pure) rarely wakes for nothing."""
        while self._deadlines and self._deadlines[0][1] not in self.sessions:
            self._queued.discard(heapq.heappop(self._deadlines))

    def _schedule(self, request_id: int, session: S) -> None:
        """Make sure the heap holds every current deadline of ``session`` (each entry once)."""
        for deadline in self._session_deadlines(session):
            if deadline is None:
                continue
            entry = (deadline, request_id)
            if entry not in self._queued:
                self._queued.add(entry)
                heapq.heappush(self._deadlines, entry)

    def _session_deadlines(self, session: S) -> Iterable[int | None]:
        raise NotImplementedError

    def _admissible(self, request_id: int) -> bool:
        """Rule 5: not below the world watermark (fences compacted) nor below our own."""
        return self.fence.admissible(request_id) and split_request_id(request_id)[0] >= self._local_watermark

    def watermark_refusal(self, epoch: int) -> str:
        """Pure: why ``WatermarkSet(epoch)`` would raise, or '' (the driver asks first: driver rule 7a)."""
        if epoch < self._local_watermark:
            return "watermark cannot move backwards"
        if any(split_request_id(rid)[0] < epoch for rid in self.sessions):
            return "sessions below the new watermark are still live"
        return ""

    def _on_local_watermark(self, epoch: int, actions: list[Action]) -> None:
        from kvown.core.actions import SendControl

        if epoch < self._local_watermark:
            raise LocalProtocolError("watermark cannot move backwards", field="epoch", epoch=epoch)
        live = [rid for rid in self.sessions if split_request_id(rid)[0] < epoch]
        if live:
            raise LocalProtocolError("sessions below the new watermark are still live", field="epoch", live=live[:4])
        self._local_watermark = epoch
        actions.extend(SendControl(peer, Watermark(self.config.rank, epoch)) for peer in self.config.peers)
        self._compact()

    def _compact(self) -> None:
        world = min([self._local_watermark, *(self._peer_watermarks.get(p, 0) for p in self.config.peers)])
        self._count("fences_compacted", self.fence.compact_below(world))

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n
