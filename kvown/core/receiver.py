"""Receiver (generation side): the evidence ledger that decides when destination blocks may retire.

Owns: per live session the published writers, their reports, the outcome, pending local completions
and the retirement clock; per rank the fence and the admission quarantine.

Rules (states: ``RX_TRANSITIONS``, ``RX_TIMER_TRANSITIONS``, ``_rx_guard``; why: docs/design.md s. 14):
  1. Only a published writer's evidence counts; invalid evidence disputes the session (it never retires),
     quarantines admission and returns ``Disputed``; only a message that changes nothing raises.
  1a. A writer claims its head slice with its first SUCCESS or IN_DOUBT; a FAILED from one that claimed
     nothing is a decline, failing the session only when no candidate of the slice can still deliver.
  2. A writer is settled when its stream ended (``is_last``) or it acked, and no piece is in doubt.
  3. SESSION_QUIESCED counts only from a published writer of a committed session; an outsider's
     quarantines admission (``foreign_acks``, ``Disputed``) and leaves the session; else it is stale.
  4. IN_DOUBT fails the session, holds the destination and quarantines admission; FAILED_QUIESCED
     settles that piece only after that writer's IN_DOUBT for it.
  4a. A carried report after its writer's SESSION_QUIESCED is stale (``stale_carried``), not disputed.
  5. CANCEL_SESSION follows its REQUEST_DATA, once to each unsettled published writer; a cancel with
     no session here tells the writers in ``CancelRequested.notify``.
  6. Every open claim's fail-stop deadline is in the heap after every input (a local completion has
     its own clock), so ``check_fatal(now)`` and ``handle(Tick(), now)`` agree at every instant.

Invariants: INV-R1 RetireBlocks(r) only when every published writer of r is settled, no local completion
is pending and r is not disputed. INV-R2 the outcome is committed at most once. INV-R3 each (writer,
piece kind, piece) result is counted at most once. INV-R4 after FailStop nothing retires.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
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
from kvown.core.errors import InvariantViolation, LocalProtocolError, PeerProtocolError
from kvown.core.events import (
    CancelRequested,
    Event,
    LocalCompletionDone,
    LocalCompletionPending,
    MessageReceived,
    OpenReceive,
    ReleaseRequested,
)
from kvown.core.fence import ORIGIN_OF_OUTCOME, CancelOrigin
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


class RxTimer(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: C-level hashing (enum's is Python)

    TIMEOUT = "timeout"  # the request deadline passed with no outcome
    DEADLINE = "deadline"  # claims still open at the fail-stop deadline


@dataclass(frozen=True, slots=True)
class RxTransition:
    """One table cell: the handler that computes the input's effects, and the states it may lead to.
    With several, ``ReceiverCore._rx_guard`` picks one from the session's evidence."""

    handler: str
    to: frozenset[RxState]


_A, _DL, _DR, _RE = RxState.ACTIVE, RxState.DELIVERED, RxState.DRAINING, RxState.RETIRED


def _t(handler: str, *to: RxState) -> RxTransition:
    return RxTransition(handler, frozenset(to))


# (state, input) -> (handler, next states). Pairs absent here are illegal: local inputs raise
# LocalProtocolError, peer inputs raise PeerProtocolError; either way the state is unchanged.
RX_TRANSITIONS: dict[tuple[RxState, RxInput], RxTransition] = {
    (_A, RxInput.CANCEL): _t("_on_cancel", _DR, _RE),
    (_A, RxInput.RESULT): _t("_on_result", _A, _DL, _DR, _RE),
    (_A, RxInput.QUIESCED): _t("_on_quiesced", _A),  # no outcome yet: unsolicited (rule 3)
    (_A, RxInput.LOCAL_PENDING): _t("_on_local_pending", _A),
    (_A, RxInput.LOCAL_DONE): _t("_on_local_done", _A),
    (_DL, RxInput.CANCEL): _t("_on_release", _DR, _RE),
    (_DL, RxInput.RESULT): _t("_on_result", _DL),  # the outcome is committed; not released yet
    (_DL, RxInput.QUIESCED): _t("_on_quiesced", _DL),
    (_DL, RxInput.LOCAL_PENDING): _t("_on_local_pending", _DL),
    (_DL, RxInput.LOCAL_DONE): _t("_on_local_done", _DL),
    (_DL, RxInput.RELEASE): _t("_on_release", _DR, _RE),
    (_DR, RxInput.CANCEL): _t("_on_repeat_cancel", _DR),  # settles nothing: it would have retired
    (_DR, RxInput.RESULT): _t("_on_result", _DR, _RE),
    (_DR, RxInput.QUIESCED): _t("_on_quiesced", _DR, _RE),
    # A copy or read the consumer queued before it learned of the outcome (or a release's ready token)
    # still touches the blocks: it is a claim like any other, never refused.
    (_DR, RxInput.LOCAL_PENDING): _t("_on_local_pending", _DR),
    (_DR, RxInput.LOCAL_DONE): _t("_on_local_done", _DR, _RE),
    (_DR, RxInput.RELEASE): _t("_on_repeat_release", _DR),
}
# What time does to a session (``_evaluate``, ``_advance``): the same guard picks among the states.
RX_TIMER_TRANSITIONS: dict[tuple[RxState, RxTimer], frozenset[RxState]] = {
    (_A, RxTimer.TIMEOUT): frozenset({_DR, _RE}),
    (_A, RxTimer.DEADLINE): frozenset({RxState.FATAL}),
    (_DL, RxTimer.DEADLINE): frozenset({RxState.FATAL}),
    (_DR, RxTimer.DEADLINE): frozenset({RxState.FATAL}),
}
PEER_INPUTS = frozenset({RxInput.RESULT, RxInput.QUIESCED})
TOUCHING = frozenset({ResultStatus.SUCCESS, ResultStatus.IN_DOUBT})  # results that say bytes may have moved


class _Writer:
    """What one published writer has told us."""

    __slots__ = ("rank", "slice_index", "results", "in_doubt", "stream_ended", "acked", "touched", "failed",
                 "cancel_sent")

    def __init__(self, rank: int, slice_index: int) -> None:
        self.rank = rank
        self.slice_index = slice_index
        self.results: dict[tuple[str, int], ResultStatus] = {}
        self.in_doubt: set[tuple[str, int]] = set()
        self.stream_ended = False  # a result with is_last arrived
        self.acked = False  # SESSION_QUIESCED arrived
        self.touched = False  # some piece SUCCESS or IN_DOUBT: this writer claimed its slice (rule 1a)
        self.failed = False  # some piece FAILED or went IN_DOUBT
        self.cancel_sent = False

    @property
    def settled(self) -> bool:
        return (self.stream_ended or self.acked) and not self.in_doubt

    @property
    def may_deliver(self) -> bool:
        """Still a candidate for its slice: nothing failed and its stream is still open."""
        return not (self.failed or self.stream_ended or self.acked)


class ReceiveSession:
    __slots__ = ("request_id", "dst_blocks", "num_slices", "aux_slot", "writers", "clock", "state", "outcome",
                 "reason", "cohort", "local_pending", "released", "disputed")

    def __init__(self, request_id: int, dst_blocks: tuple[int, ...], num_slices: int, aux_slot: int,
                 writers: dict[int, _Writer], clock: RetirementClock) -> None:
        self.request_id = request_id
        self.dst_blocks = dst_blocks
        self.num_slices = num_slices
        self.aux_slot = aux_slot
        self.writers = writers  # the published set
        self.clock = clock
        self.state = RxState.ACTIVE
        self.outcome: Outcome | None = None
        self.reason = ""
        self.cohort: dict[int, int] = {}  # slice index -> the writer that claimed it
        self.local_pending: dict[int, int] = {}  # token -> when it was queued (its clock)
        self.released = False
        self.disputed = ""  # why the evidence is invalid; non-empty means it can never retire

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
        step = RX_TRANSITIONS.get((session.state, kind))
        if step is None:
            error = PeerProtocolError if kind in PEER_INPUTS else LocalProtocolError
            raise error(
                "illegal input for the session's state", field=kind.value, request_id=request_id,
                state=session.state.value,
            )
        getattr(self, step.handler)(session, *args, actions)  # effects only: the table sets the state
        self._enter(session, self._rx_guard(session, step.to), args[-1], actions)

    @staticmethod
    def _rx_guard(s: ReceiveSession, to: frozenset[RxState]) -> RxState:
        """The one reader of evidence for the state: which of ``to`` the session moves to.

        RETIRED when the outcome allows it and no claim is left (INV-R1); otherwise a cell with one
        other state is the table's own decision, and among several the evidence decides: no outcome
        is ACTIVE, a completed and unreleased one DELIVERED, anything else DRAINING."""
        retirable = s.outcome is not None and (s.outcome is not Outcome.COMPLETED or s.released)
        if RxState.RETIRED in to and retirable and not s.has_claims():
            return RxState.RETIRED
        stay = to - {RxState.RETIRED}
        if len(stay) == 1:
            return next(iter(stay))
        if s.outcome is None:
            return RxState.ACTIVE
        return RxState.DELIVERED if s.outcome is Outcome.COMPLETED and not s.released else RxState.DRAINING

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
        actions.append(Conclude(s.request_id, outcome, reason))
        if outcome is not Outcome.COMPLETED:
            self.fence.install(s.request_id, ORIGIN_OF_OUTCOME[outcome])
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

    def _enter(self, s: ReceiveSession, state: RxState, now_ns: int, actions: list[Action]) -> None:
        """After any input: move to ``state`` (the guard's choice); retire on RETIRED (INV-R1), else make
        sure every open claim's deadline is in the heap (rule 6)."""
        s.state = state
        if state is not RxState.RETIRED:
            self._schedule(s.request_id, s)
            return
        del self.sessions[s.request_id]
        actions.append(RetireBlocks(s.request_id))

    # ---- time ----------------------------------------------------------------------------------

    def _evaluate(self, request_id: int, s: ReceiveSession, now_ns: int, actions: list[Action]) -> None:
        if s.outcome is None and s.clock.timed_out(now_ns):
            self.fence.install(request_id, CancelOrigin.TIMEOUT)
            self._commit(s, Outcome.TIMED_OUT, "transfer timeout", now_ns, actions)
            self._enter(s, self._rx_guard(s, self._timer(s, RxTimer.TIMEOUT)), now_ns, actions)

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
        s.state = self._rx_guard(s, self._timer(s, RxTimer.DEADLINE))

    @staticmethod
    def _timer(s: ReceiveSession, timer: RxTimer) -> frozenset[RxState]:
        to = RX_TIMER_TRANSITIONS.get((s.state, timer))
        if to is None:  # time is our own input: a missing cell is our bug
            raise InvariantViolation("illegal timer for the session's state", request_id=s.request_id,
                                     state=s.state.value, timer=timer.value)
        return to

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

