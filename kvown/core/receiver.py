"""Receiver (generation side): the evidence ledger that decides when destination blocks may retire.

Owns: for every live receive session, who was published, what each writer reported, the logical
outcome, the local completions still pending, and the retirement clock; for the rank, the fence and
the admission quarantine.

Theory of operation:
  OpenReceive publishes the destination: REQUEST_DATA to every writer. From the moment the core
  emits those actions each writer counts as *published*, because a send that fails may still have
  delivered the frame (the driver resends it or fail-stops; it never reports "not sent"). Writers answer per piece
  (KV_RESULT, AUX_RESULT) and, when asked with CANCEL_SESSION, with SESSION_QUIESCED after every
  earlier result. The *logical* outcome (completed, cancelled, failed, timed out) is committed once.
  The *physical* side retires the blocks only when every published writer is settled and nothing
  local is pending. Until then the blocks are held; if the fail-stop deadline passes first, the
  rank fail-stops instead.

Rules:
  1. Only a published writer's evidence counts. A result from outside the published set, from a second
     writer touching an already-claimed head slice, a contradictory repeat, or any result after the
     writer's stream ended (except FAILED_QUIESCED for an in-doubt piece) is *invalid evidence*: the
     session is disputed (it can never retire: it drains to a fail-stop), admission is quarantined,
     and ``handle`` returns a ``Disputed`` action. It does not raise: the dispute IS the response.
     Only a message that changes nothing raises ``PeerProtocolError`` (unknown request, wrong stream).
  1a. A writer *claims* its head slice with its first SUCCESS or IN_DOUBT (the only results that say
     bytes may have moved). A FAILED result means nothing was posted for that piece: from a writer that
     claimed nothing it is a *decline* (a broadcast candidate that was not selected, or was fenced), which
     settles that writer with its ``is_last`` and fails the session only when no other candidate of
     the slice can still deliver it.
  2. A writer is settled when its stream ended (a result with ``is_last``) or it acknowledged with
     SESSION_QUIESCED, and none of its pieces is in doubt. An ack never settles an in-doubt piece.
  3. SESSION_QUIESCED counts only from a published writer of a session whose outcome is committed.
     From a rank outside the published set it cannot be honest, but it claims nothing either: admission
     is quarantined (counted as ``foreign_acks``, reported with a ``Disputed`` action) and the session
     itself is left as it was. For an unknown request or an uncommitted session it is stale or
     unsolicited: ignored and counted.
  4. IN_DOUBT fails the session, holds the destination and quarantines admission. FAILED_QUIESCED
     settles that piece only after that writer's IN_DOUBT for it.
  4a. A carried report (``MessageReceived.carried``: the WRITE's own notification, sender rule 6)
     is ordered against no control message. Arriving after that writer's SESSION_QUIESCED it is
     stale, not a lie: NIXL sends it only once its WRITE completed, so it can announce no write in
     flight, and the ack already proved the writer quiescent (a writer acks a cancel for a session it
     finished at once, while the report may still be on its way). It is counted (``stale_carried``)
     and changes nothing. On the ordered stream a result after the ack stays invalid evidence (rule 1).
  5. CANCEL_SESSION is emitted only after the REQUEST_DATA it follows (same stream, later sequence
     number), to every published writer not yet settled, once. The one exception carries no claim:
     a cancel of a request with no session here that names writers (``CancelRequested.notify``)
     tells each of them, so a writer holding source blocks for a publication that will never come
     releases them at once; their acknowledgements arrive for no session and are counted stale.
  6. Every open claim has a fail-stop deadline, and the deadline heap holds it after every input:
     writer claims and disputes use the session's retirement clock (request deadline + grace, or
     drain start + grace); each local completion has its own clock, started when it was queued
     (start + grace), so a copy queued after delivery never inherits an old deadline.
     ``check_fatal(now)`` and ``handle(Tick(), now)`` therefore agree at every instant.

Invariants:
  INV-R1: RetireBlocks(r) is emitted only when every published writer of r is settled, no local
          completion is pending and r is not disputed.
  INV-R2: the outcome of a session is committed at most once.
  INV-R3: each (writer, piece kind, piece) result is counted at most once.
  INV-R4: after FailStop nothing retires.

Tools that read this table: ``kvown.apps.docs_gen`` (docs/state-machines.md) and tests/core/test_totality.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvown.core.actions import (
    Action,
    AdmissionRefused,
    Conclude,
    Deliver,
    Disputed,
    FailStop,
    FatalReason,
    Outcome,
    RetireBlocks,
    SendControl,
)
from kvown.core.deadline import RetirementClock
from kvown.core.errors import LocalProtocolError, PeerProtocolError
from kvown.core.events import (
    CancelRequested,
    Event,
    LocalCompletionDone,
    LocalCompletionPending,
    MessageReceived,
    OpenReceive,
    ReleaseRequested,
)
from kvown.core.fence import CancelOrigin
from kvown.core.ids import is_valid_request_id
from kvown.core.machine import CoreConfig, RankCore
from kvown.core.messages import AuxResult, CancelSession, KvResult, RequestData, ResultStatus, SessionQuiesced


class RxState(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: C-level hashing (enum's is Python)

    ACTIVE = "active"  # published; collecting evidence; no outcome yet
    DELIVERED = "delivered"  # completed: the consumer may read; waiting for release and settlement
    DRAINING = "draining"  # outcome committed; waiting for every claim to settle
    RETIRED = "retired"  # blocks returned (terminal)
    FATAL = "fatal"  # claims unproven at the deadline (terminal, sticky)


class RxInput(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: C-level hashing (enum's is Python)

    CANCEL = "cancel"
    RESULT = "result"
    QUIESCED = "quiesced"
    LOCAL_PENDING = "local_pending"
    LOCAL_DONE = "local_done"
    RELEASE = "release"


# (state, input) -> handler. Pairs absent here are illegal: local inputs raise LocalProtocolError,
# peer inputs raise PeerProtocolError; either way the state is unchanged.
RX_TRANSITIONS: dict[tuple[RxState, RxInput], str] = {
    (RxState.ACTIVE, RxInput.CANCEL): "_on_cancel",
    (RxState.ACTIVE, RxInput.RESULT): "_on_result",
    (RxState.ACTIVE, RxInput.QUIESCED): "_on_quiesced",
    (RxState.ACTIVE, RxInput.LOCAL_PENDING): "_on_local_pending",
    (RxState.ACTIVE, RxInput.LOCAL_DONE): "_on_local_done",
    (RxState.DELIVERED, RxInput.CANCEL): "_on_release",
    (RxState.DELIVERED, RxInput.RESULT): "_on_result",
    (RxState.DELIVERED, RxInput.QUIESCED): "_on_quiesced",
    (RxState.DELIVERED, RxInput.LOCAL_PENDING): "_on_local_pending",
    (RxState.DELIVERED, RxInput.LOCAL_DONE): "_on_local_done",
    (RxState.DELIVERED, RxInput.RELEASE): "_on_release",
    (RxState.DRAINING, RxInput.CANCEL): "_on_repeat_cancel",
    (RxState.DRAINING, RxInput.RESULT): "_on_result",
    (RxState.DRAINING, RxInput.QUIESCED): "_on_quiesced",
    # A copy or read the consumer queued before it learned of the outcome (or a release's ready token)
    # still touches the blocks: it is a claim like any other, never refused.
    (RxState.DRAINING, RxInput.LOCAL_PENDING): "_on_local_pending",
    (RxState.DRAINING, RxInput.LOCAL_DONE): "_on_local_done",
    (RxState.DRAINING, RxInput.RELEASE): "_on_repeat_release",
}
PEER_INPUTS = frozenset({RxInput.RESULT, RxInput.QUIESCED})
TOUCHING = frozenset({ResultStatus.SUCCESS, ResultStatus.IN_DOUBT})  # results that say bytes may have moved


@dataclass(slots=True)
class _Writer:
    """What one published writer has told us."""

    rank: int
    slice_index: int
    results: dict[tuple[str, int], ResultStatus] = field(default_factory=dict)
    in_doubt: set[tuple[str, int]] = field(default_factory=set)
    stream_ended: bool = False  # a result with is_last arrived
    acked: bool = False  # SESSION_QUIESCED arrived
    touched: bool = False  # some piece SUCCESS or IN_DOUBT: this writer claimed its slice (rule 1a)
    failed: bool = False  # some piece FAILED or went IN_DOUBT
    cancel_sent: bool = False

    @property
    def settled(self) -> bool:
        return (self.stream_ended or self.acked) and not self.in_doubt

    @property
    def may_deliver(self) -> bool:
        """Still a candidate for its slice: nothing failed and its stream is still open."""
        return not (self.failed or self.stream_ended or self.acked)


@dataclass(slots=True)
class ReceiveSession:
    request_id: int
    dst_blocks: tuple[int, ...]
    num_slices: int
    aux_slot: int
    writers: dict[int, _Writer]  # the published set
    clock: RetirementClock
    state: RxState = RxState.ACTIVE
    outcome: Outcome | None = None
    reason: str = ""
    cohort: dict[int, int] = field(default_factory=dict)  # slice index -> the writer that claimed it
    local_pending: dict[int, int] = field(default_factory=dict)  # token -> when it was queued (its clock)
    released: bool = False
    disputed: str = ""  # why the evidence is invalid; non-empty means it can never retire

    def writer_claims(self) -> bool:
        return bool(self.disputed) or any(not w.settled for w in self.writers.values())

    def has_claims(self) -> bool:
        return bool(self.local_pending) or self.writer_claims()

    def claims(self) -> list[str]:
        """What still blocks retirement (empty means every published writer is proven quiescent)."""
        out = [f"writer {w.rank}" for w in self.writers.values() if not w.settled]
        out += [f"local completion {t}" for t in sorted(self.local_pending)]
        if self.disputed:
            out.append(f"disputed: {self.disputed}")
        return out


class ReceiverCore(RankCore[ReceiveSession]):
    """One rank's receive side. Sans-IO: ``handle(event, now_ns) -> actions``."""

    def __init__(self, config: CoreConfig) -> None:
        super().__init__(config)
        self.quarantined = ""  # non-empty: admission of new sessions is closed, and why

    # ---- dispatch -----------------------------------------------------------------------------

    def _is_admission(self, event: Event) -> bool:
        return isinstance(event, OpenReceive)

    def _dispatch(self, event: Event, now_ns: int, actions: list[Action]) -> None:
        if isinstance(event, OpenReceive):
            self._open(event, now_ns, actions)
            return
        if isinstance(event, MessageReceived):
            message = event.envelope.message
            if isinstance(message, (KvResult, AuxResult)):
                if message.writer_rank != event.envelope.src_rank:
                    raise PeerProtocolError(
                        "result names another writer than its stream", field="writer_rank",
                        got=message.writer_rank, src_rank=event.envelope.src_rank,
                    )
                if event.carried and self._stale_carried(message):  # rule 4a
                    self._count("stale_carried")
                    return
                self._route(message.request_id, RxInput.RESULT, (message, now_ns), actions, peer=True)
            elif isinstance(message, SessionQuiesced):
                if message.writer_rank != event.envelope.src_rank:
                    raise PeerProtocolError("ack names another writer than its stream", field="writer_rank")
                if message.request_id not in self.sessions:
                    self._count("stale_acks")
                    return
                self._route(message.request_id, RxInput.QUIESCED, (message, now_ns), actions, peer=True)
            else:
                raise PeerProtocolError("message not expected by a receiver", field="kind", kind=message.KIND.name)
            return
        if isinstance(event, CancelRequested):
            self._cancel(event, now_ns, actions)
            return
        table = {
            LocalCompletionPending: RxInput.LOCAL_PENDING,
            LocalCompletionDone: RxInput.LOCAL_DONE,
            ReleaseRequested: RxInput.RELEASE,
        }
        kind = table.get(type(event))
        if kind is None:
            raise LocalProtocolError("event not handled by a receiver", field="event", event=type(event).__name__)
        self._route(event.request_id, kind, (event, now_ns), actions, peer=False)  # type: ignore[attr-defined]

    def _stale_carried(self, message: KvResult | AuxResult) -> bool:
        """Rule 4a guard: a carried report from a writer that already acknowledged."""
        session = self.sessions.get(message.request_id)
        writer = session.writers.get(message.writer_rank) if session is not None else None
        return writer is not None and writer.acked

    def _route(self, request_id: int, kind: RxInput, args: tuple[Any, ...], actions: list[Action], *, peer: bool) -> None:
        session = self.sessions.get(request_id)
        if session is None:
            error = PeerProtocolError if peer else LocalProtocolError
            raise error("no live receive session for this request", field="request_id", request_id=request_id)
        handler = RX_TRANSITIONS.get((session.state, kind))
        if handler is None:
            error = PeerProtocolError if kind in PEER_INPUTS else LocalProtocolError
            raise error(
                "illegal input for the session's state", field=kind.value, request_id=request_id,
                state=session.state.value,
            )
        getattr(self, handler)(session, *args, actions)
        self._settle(session, args[-1], actions)

    # ---- admission and publication -----------------------------------------------------------

    def _open(self, event: OpenReceive, now_ns: int, actions: list[Action]) -> None:
        rid = event.request_id
        self._validate_open(event)
        if rid in self.sessions:
            raise LocalProtocolError("request already has a live receive session", field="request_id", request_id=rid)
        if not self._admissible(rid):
            actions.append(AdmissionRefused(rid, "stale: the request's epoch is below the watermark"))
            return
        if self.fence.is_fenced(rid):  # born cancelled: nothing is ever published
            actions += [Conclude(rid, Outcome.CANCELLED, "fenced before publication"), RetireBlocks(rid)]
            self._count("born_cancelled")
            return
        if self.quarantined:
            actions.append(AdmissionRefused(rid, f"quarantined: {self.quarantined}"))
            return
        writers = {w: _Writer(w, i % event.num_slices) for i, w in enumerate(event.writers)}
        session = ReceiveSession(
            rid, event.dst_blocks, event.num_slices, event.aux_slot, writers,
            RetirementClock(self.config.timeout_ns, self.config.grace_ns),
        )
        session.clock.expose(now_ns)
        self.sessions[rid] = session
        self._schedule(rid, session)
        for w in writers.values():  # published from here on, whatever the send does (module header)
            message = RequestData(rid, self.config.rank, event.dst_blocks, w.slice_index, event.num_slices, event.aux_slot)
            actions.append(SendControl(w.rank, message))

    def _validate_open(self, event: OpenReceive) -> None:
        if not is_valid_request_id(event.request_id):
            raise LocalProtocolError("invalid request id", field="request_id", request_id=event.request_id)
        if not event.writers or len(set(event.writers)) != len(event.writers):
            raise LocalProtocolError("writers must be a non-empty list of distinct ranks", field="writers")
        if self.config.rank in event.writers:
            raise LocalProtocolError("a rank cannot publish to itself", field="writers", rank=self.config.rank)
        if event.num_slices < 1 or len(event.writers) % event.num_slices:
            raise LocalProtocolError(
                "the number of writers must be a multiple of num_slices", field="num_slices",
                writers=len(event.writers), num_slices=event.num_slices,
            )
        if not event.dst_blocks:
            raise LocalProtocolError("a destination needs at least one block", field="dst_blocks")

    # ---- cancellation and release --------------------------------------------------------------

    def _cancel(self, event: CancelRequested, now_ns: int, actions: list[Action]) -> None:
        rid = event.request_id
        if not is_valid_request_id(rid):
            raise LocalProtocolError("invalid request id", field="request_id", request_id=rid)
        if not self._admissible(rid):
            self._count("stale_cancels")
            return
        self.fence.install(rid, event.origin)
        if rid in self.sessions:
            self._route(rid, RxInput.CANCEL, (event, now_ns), actions, peer=False)
            return
        for writer in dict.fromkeys(event.notify):  # rule 5's exception: nothing was published to them
            if writer != self.config.rank:  # the API checked each is a loaded sender rank
                actions.append(SendControl(writer, CancelSession(rid, self.config.rank)))

    def _on_cancel(self, s: ReceiveSession, event: CancelRequested, now_ns: int, actions: list[Action]) -> None:
        self._commit(s, Outcome.CANCELLED, f"cancelled ({event.origin.name.lower()})", now_ns, actions)

    def _on_repeat_cancel(self, s: ReceiveSession, event: CancelRequested, now_ns: int, actions: list[Action]) -> None:
        s.released = True  # cancelling again is idempotent; a completed session is thereby released

    def _on_release(self, s: ReceiveSession, event: Event, now_ns: int, actions: list[Action]) -> None:
        s.released = True
        s.state = RxState.DRAINING

    def _on_repeat_release(self, s: ReceiveSession, event: Event, now_ns: int, actions: list[Action]) -> None:
        if s.outcome is not Outcome.COMPLETED:
            raise LocalProtocolError("only a delivered session can be released; cancel it instead", field="request_id")
        s.released = True

    # ---- evidence ------------------------------------------------------------------------------

    def _on_result(self, s: ReceiveSession, message: KvResult | AuxResult, now_ns: int, actions: list[Action]) -> None:
        writer = s.writers.get(message.writer_rank)
        if writer is None:
            self._dispute(s, f"result from unpublished writer {message.writer_rank}", now_ns, actions)
            return
        key = ("aux" if isinstance(message, AuxResult) else "kv", message.piece)
        problem = self._result_problem(s, writer, key, message)
        if problem:
            self._dispute(s, f"writer {writer.rank}: {problem}", now_ns, actions)
            return
        status = message.status
        writer.results[key] = status
        if status is ResultStatus.FAILED_QUIESCED:
            writer.in_doubt.discard(key)
            return
        if status in TOUCHING:  # rule 1a: this writer claims its slice
            writer.touched = True
            s.cohort.setdefault(writer.slice_index, writer.rank)
        if message.is_last:
            writer.stream_ended = True
        if status is ResultStatus.IN_DOUBT:
            writer.in_doubt.add(key)
            writer.failed = True
            self.quarantined = self.quarantined or f"writer {writer.rank} in doubt for request {s.request_id}"
            self._commit(s, Outcome.FAILED, f"writer {writer.rank} in doubt", now_ns, actions)
        elif status is ResultStatus.FAILED:
            writer.failed = True
            if writer.touched or not self._slice_deliverable(s, writer.slice_index):
                self._commit(s, Outcome.FAILED, f"writer {writer.rank} failed piece {key}", now_ns, actions)
        elif writer.failed:  # a writer that failed one piece and then touched the slice with another
            self._commit(s, Outcome.FAILED, f"writer {writer.rank} failed an earlier piece", now_ns, actions)
        elif s.outcome is None and self._complete(s):
            self._commit(s, Outcome.COMPLETED, "every slice delivered", now_ns, actions)

    @staticmethod
    def _result_problem(s: ReceiveSession, writer: _Writer, key: tuple[str, int], message: KvResult | AuxResult) -> str:
        """Rule 1: why this result is invalid evidence, or '' if it may be counted."""
        if message.status is ResultStatus.FAILED_QUIESCED:
            return "" if key in writer.in_doubt else "FAILED_QUIESCED without an earlier IN_DOUBT"
        if key in writer.results:
            return f"second result for piece {key}"
        if writer.stream_ended or writer.acked:
            return f"result for piece {key} after its stream ended"
        claimed_by = s.cohort.get(writer.slice_index)
        if message.status in TOUCHING and claimed_by is not None and claimed_by != writer.rank:
            return f"slice {writer.slice_index} already delivered by writer {claimed_by}"
        return ""

    @staticmethod
    def _slice_deliverable(s: ReceiveSession, slice_index: int) -> bool:
        """Rule 1a: the slice is claimed, or some candidate for it may still deliver."""
        return slice_index in s.cohort or any(
            w.slice_index == slice_index and w.may_deliver for w in s.writers.values()
        )

    @staticmethod
    def _complete(s: ReceiveSession) -> bool:
        """Every slice has a cohort writer whose stream ended with every piece SUCCESS (+ AUX if asked)."""
        if len(s.cohort) < s.num_slices:
            return False
        for rank in s.cohort.values():
            w = s.writers[rank]
            if not w.stream_ended or w.failed:
                return False
        if s.aux_slot >= 0:
            return s.writers[s.cohort[0]].results.get(("aux", 0)) is ResultStatus.SUCCESS
        return True

    def _on_quiesced(self, s: ReceiveSession, message: SessionQuiesced, now_ns: int, actions: list[Action]) -> None:
        writer = s.writers.get(message.writer_rank)
        if writer is None:  # rule 3: quarantine, but the session's own evidence is untouched
            why = f"SESSION_QUIESCED from unpublished writer {message.writer_rank} for request {s.request_id}"
            self.quarantined = self.quarantined or why
            self._count("foreign_acks")
            actions.append(Disputed(s.request_id, why))
            return
        if s.outcome is None or not writer.cancel_sent:
            self._count("unsolicited_acks")
            return
        writer.acked = True

    def _on_local_pending(self, s: ReceiveSession, event: LocalCompletionPending, now_ns: int, actions: list[Action]) -> None:
        if event.token in s.local_pending:
            raise LocalProtocolError("local completion token already pending", field="token", token=event.token)
        s.local_pending[event.token] = now_ns

    def _on_local_done(self, s: ReceiveSession, event: LocalCompletionDone, now_ns: int, actions: list[Action]) -> None:
        if event.token not in s.local_pending:
            raise LocalProtocolError("unknown local completion token", field="token", token=event.token)
        del s.local_pending[event.token]

    # ---- outcome, drain, retirement ------------------------------------------------------------

    def _commit(self, s: ReceiveSession, outcome: Outcome, reason: str, now_ns: int, actions: list[Action]) -> None:
        """INV-R2: commit once; start the drain; ask every unsettled published writer to quiesce."""
        if s.outcome is not None:
            return
        s.outcome, s.reason = outcome, reason
        if outcome is Outcome.COMPLETED:  # Deliver first: whoever learns the outcome may read at once
            actions.append(Deliver(s.request_id))
            s.state = RxState.DELIVERED
        actions.append(Conclude(s.request_id, outcome, reason))
        if outcome is not Outcome.COMPLETED:
            self.fence.install(s.request_id, _ORIGIN[outcome])
            s.state = RxState.DRAINING
        if s.writer_claims():
            s.clock.start_drain(now_ns, reason)
        self._send_cancels(s, actions)

    def _send_cancels(self, s: ReceiveSession, actions: list[Action]) -> None:
        for w in s.writers.values():
            if not w.settled and not w.cancel_sent:
                w.cancel_sent = True
                actions.append(SendControl(w.rank, CancelSession(s.request_id, self.config.rank)))

    def _dispute(self, s: ReceiveSession, why: str, now_ns: int, actions: list[Action]) -> None:
        """Rule 1: the session can never retire, admission closes, and the driver hears of it."""
        s.disputed = s.disputed or why
        s.clock.start_drain(now_ns, "invalid evidence")
        self.quarantined = self.quarantined or f"invalid evidence on request {s.request_id}: {why}"
        self._count("invalid_evidence")
        actions.append(Disputed(s.request_id, why))

    def _settle(self, s: ReceiveSession, now_ns: int, actions: list[Action]) -> None:
        """After any input: retire if the outcome allows it and no claim is left (INV-R1); else make
        sure every open claim's deadline is in the heap (rule 6)."""
        if s.request_id not in self.sessions:
            return
        retirable = s.outcome is not None and (s.outcome is not Outcome.COMPLETED or s.released)
        if not retirable or s.has_claims():
            self._schedule(s.request_id, s)
            return
        s.state = RxState.RETIRED
        del self.sessions[s.request_id]
        actions.append(RetireBlocks(s.request_id))

    # ---- time ----------------------------------------------------------------------------------

    def _evaluate(self, request_id: int, s: ReceiveSession, now_ns: int, actions: list[Action]) -> None:
        if s.outcome is None and s.clock.timed_out(now_ns):
            self.fence.install(request_id, CancelOrigin.TIMEOUT)
            self._commit(s, Outcome.TIMED_OUT, "transfer timeout", now_ns, actions)
            self._settle(s, now_ns, actions)

    def _session_deadlines(self, s: ReceiveSession) -> tuple[int | None, int | None]:
        request = s.clock.request_deadline_ns if s.outcome is None else None
        return request, self._fatal_deadline_ns(s)

    def _fatal_deadline_ns(self, s: ReceiveSession) -> int | None:
        deadlines = [started + self.config.grace_ns for started in s.local_pending.values()]
        if s.writer_claims():
            deadlines.append(s.clock.fatal_deadline_ns)  # type: ignore[arg-type]  # exposed at open
        return min(deadlines, default=None)

    def _fatal_action(self, request_id: int, s: ReceiveSession) -> FailStop:
        return FailStop(
            FatalReason.DEADLINE, request_id,
            f"receive claims unproven at the deadline (drain: {s.clock.drain_reason or 'transfer timeout'}): "
            + ", ".join(s.claims()),
        )

    def _mark_fatal(self, s: ReceiveSession) -> None:
        s.state = RxState.FATAL

    def open_sessions(self) -> list[dict[str, object]]:
        """Pure: every live session as plain values, for post-mortems (the flight recorder's dump). Reads
        a copy of the table, so a reader on another thread sees some recent state, never an error."""
        out: list[dict[str, object]] = []
        for rid, s in list(self.sessions.items()):
            writers = [{"rank": w.rank, "slice": w.slice_index, "settled": w.settled, "acked": w.acked,
                        "stream_ended": w.stream_ended, "in_doubt": sorted(map(list, w.in_doubt)),
                        "cancel_sent": w.cancel_sent} for w in list(s.writers.values())]
            out.append({"role": "receiver", "request_id": rid, "state": s.state.value,
                        "outcome": None if s.outcome is None else s.outcome.value, "reason": s.reason,
                        "writers": writers, "missing": s.claims(), "opened_ns": s.clock.exposed_ns,
                        "drain_started_ns": s.clock.drain_started_ns, "drain_reason": s.clock.drain_reason,
                        "fatal_deadline_ns": self._fatal_deadline_ns(s)})
        return out

    def _state_name(self, s: ReceiveSession) -> str:
        return s.state.value


_ORIGIN = {
    Outcome.CANCELLED: CancelOrigin.CLIENT,
    Outcome.FAILED: CancelOrigin.FAILURE,
    Outcome.TIMED_OUT: CancelOrigin.TIMEOUT,
}
