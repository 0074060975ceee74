"""Sender (context side): physical write operations, ordered result streams, quiescence acks.

Owns: per live session a stream per receiver that published to us, an operation per piece of each;
per rank the fence, the publications waiting for a session, and the poison latch.

Rules (states: ``SX_TRANSITIONS`` over the derived ``SendSession.state``; why: docs/design.md s. 14):
  1. Operation states follow ``OP_TRANSITIONS``; any other input raises ``LocalProtocolError``, no change.
  2. Any backend outcome but DONE makes the op IN_DOUBT: its handle stays rooted, the rank is *poisoned*
     (nothing is posted again) and only a later DONE on that handle settles it (FAILED_QUIESCED).
  3. SESSION_QUIESCED follows every earlier result of its stream, once no op of it is LIVE.
  4. A cancel of a request with no session fences it and acknowledges at once; a later session for a
     fenced id is born cancelled. A publication that can never be served is answered with a final FAILED
     (nothing posted): at arrival when its id is fenced or it does not fit the live session; if it was
     saved for a session not yet open, when that session opens (unfit, or born cancelled) or on a local
     cancel. A peer's CANCEL_SESSION answers only that peer's saved publication (SESSION_QUIESCED).
  4a. A ``dst_suffix`` session also serves fewer blocks (prefix-cache hit): the last ``len(dst)`` of its source.
  5. Source blocks are released (``ReleaseSource``) only when no operation can still read them.
  6. A single-operation stream's PostWrite carries its whole report (SUCCESS, ``is_last``) as the WRITE's
     notification (``carry_results``): after DONE nothing more goes on that stream; any other outcome
     sends the report on the control stream.

Invariants: INV-S1 PostWrite(op) only after its piece was ready (SourceReady, or ``OpenSend.ready_pieces``),
never after a fence, poison or fatal. INV-S2 results in piece order; SESSION_QUIESCED, or a carried final
result, ends its stream. INV-S3 an IN_DOUBT op leaves IN_DOUBT only through WriteCompleted of the same op.
"""

from __future__ import annotations

import enum

from kvown.core.actions import (
    Action,
    AdmissionRefused,
    Conclude,
    FailStop,
    FatalReason,
    Outcome,
    PieceKind,
    PostWrite,
    ReleaseSource,
    SendControl,
)
from kvown.core.deadline import RetirementClock
from kvown.core.errors import InvariantViolation, LocalProtocolError, PeerProtocolError
from kvown.core.events import (
    CancelRequested,
    Event,
    MessageReceived,
    OpenSend,
    SourceReady,
    WriteCompleted,
    WriteFailed,
    WriteNotSubmitted,
    WriteSubmitFailed,
    WriteSubmitted,
)
from kvown.core.fence import ORIGIN_OF_OUTCOME, CancelOrigin
from kvown.core.ids import is_valid_request_id
from kvown.core.machine import CoreConfig, RankCore
from kvown.core.messages import AuxResult, CancelSession, KvResult, RequestData, ResultStatus, SessionQuiesced


class OpState(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: C-level hashing (enum's is Python)

    ADMITTED = "admitted"  # created; waiting for its source piece to be ready
    SUBMITTING = "submitting"  # PostWrite emitted; the driver is posting
    SUBMITTED = "submitted"  # posted; the handle is polled
    BACKEND_DONE = "backend_done"  # the handle reported DONE: the bytes landed, nothing in flight
    NOT_SUBMITTED = "not_submitted"  # refused before posting: nothing can touch memory
    IN_DOUBT = "in_doubt"  # ended without proof; handle rooted until DONE


class OpInput(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: C-level hashing (enum's is Python)

    POST = "post"
    REFUSE = "refuse"
    SUBMITTED = "submitted"
    NOT_SUBMITTED = "not_submitted"
    SUBMIT_FAILED = "submit_failed"
    DONE = "done"
    FAILED = "failed"


OP_TRANSITIONS: dict[tuple[OpState, OpInput], OpState] = {
    (OpState.ADMITTED, OpInput.POST): OpState.SUBMITTING,
    (OpState.ADMITTED, OpInput.REFUSE): OpState.NOT_SUBMITTED,
    (OpState.SUBMITTING, OpInput.SUBMITTED): OpState.SUBMITTED,
    (OpState.SUBMITTING, OpInput.NOT_SUBMITTED): OpState.NOT_SUBMITTED,
    (OpState.SUBMITTING, OpInput.SUBMIT_FAILED): OpState.IN_DOUBT,
    (OpState.SUBMITTED, OpInput.DONE): OpState.BACKEND_DONE,
    (OpState.SUBMITTED, OpInput.FAILED): OpState.IN_DOUBT,
    (OpState.IN_DOUBT, OpInput.DONE): OpState.BACKEND_DONE,  # late settlement, same handle
    (OpState.IN_DOUBT, OpInput.FAILED): OpState.IN_DOUBT,  # repeated failure keeps the evidence
    (OpState.BACKEND_DONE, OpInput.DONE): OpState.BACKEND_DONE,  # idempotent
}
class SxState(enum.Enum):
    """A send session's state: derived from its fields (``SendSession.state``), never stored."""

    __hash__ = object.__hash__  # members are singletons: C-level hashing (enum's is Python)

    OPEN = "open"  # no outcome; no receiver's publication attached yet
    PUBLISHED = "published"  # no outcome; some receiver's stream attached (its writes may be posted)
    DRAINING = "draining"  # outcome committed; operations in flight or acknowledgements owed
    RELEASED = "released"  # ReleaseSource emitted: nothing reads the source; the session is gone (terminal)
    FATAL = "fatal"  # operations unproven at the fail-stop deadline (terminal, sticky)


class SxInput(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: C-level hashing (enum's is Python)

    PUBLISH = "publish"  # a receiver's REQUEST_DATA attached a stream
    SOURCE_READY = "source_ready"  # a piece's write-ready event completed
    WRITE = "write"  # the driver's answer for one of its operations (the op table's inputs)
    CANCEL = "cancel"  # the embedding server's cancel
    PEER_CANCEL = "peer_cancel"  # a receiver's CANCEL_SESSION
    POISON = "poison"  # another session's operation went in doubt (rule 2)
    TIMEOUT = "timeout"  # the request deadline passed with no outcome
    DEADLINE = "deadline"  # operations still unproven at the fail-stop deadline


_OP, _PU, _DR, _RE = SxState.OPEN, SxState.PUBLISHED, SxState.DRAINING, SxState.RELEASED
_MOVES, _ENDS = frozenset({_PU, _DR, _RE}), frozenset({_DR, _RE})
# (state, input) -> the states the session may be in afterwards; ``SenderCore._sx_guard`` checks each
# step against it. Pairs absent here are illegal (for the time inputs: unreachable, our bug).
SX_TRANSITIONS: dict[tuple[SxState, SxInput], frozenset[SxState]] = {
    # posts at once when its source is ready; one that does not fit is declined (rule 4): still OPEN
    (_OP, SxInput.PUBLISH): frozenset({_OP, _PU, _DR, _RE}),
    (_OP, SxInput.SOURCE_READY): frozenset({_OP}),
    (_OP, SxInput.CANCEL): frozenset({_RE}),  # nothing was posted: released at once (rule 4)
    (_OP, SxInput.PEER_CANCEL): frozenset({_RE}),
    (_PU, SxInput.PUBLISH): _MOVES,
    (_PU, SxInput.SOURCE_READY): _MOVES,
    (_PU, SxInput.WRITE): _MOVES,
    (_PU, SxInput.CANCEL): _ENDS,
    (_PU, SxInput.PEER_CANCEL): _ENDS,
    (_PU, SxInput.POISON): _ENDS,
    (_PU, SxInput.TIMEOUT): _ENDS,  # (the request deadline comes before any fail-stop deadline)
    (_DR, SxInput.PUBLISH): _ENDS,  # answered FAILED at once: nothing is posted after the outcome
    (_DR, SxInput.SOURCE_READY): _ENDS,
    (_DR, SxInput.WRITE): _ENDS,
    (_DR, SxInput.CANCEL): _ENDS,
    (_DR, SxInput.PEER_CANCEL): _ENDS,  # (poison reaches only sessions with ADMITTED ops: never DRAINING)
    (_DR, SxInput.DEADLINE): frozenset({SxState.FATAL}),
}
SX_PEER_INPUTS = frozenset({SxInput.PUBLISH, SxInput.PEER_CANCEL})
_FATAL_REASON = "fatal"  # what ``_mark_fatal`` writes into ``reason``: the one field that says FATAL

LIVE = frozenset({OpState.ADMITTED, OpState.SUBMITTING, OpState.SUBMITTED, OpState.IN_DOUBT})
IN_FLIGHT = frozenset({OpState.SUBMITTING, OpState.SUBMITTED, OpState.IN_DOUBT})  # may touch memory
REPORTABLE = frozenset({OpState.BACKEND_DONE, OpState.NOT_SUBMITTED, OpState.IN_DOUBT})


class Operation:
    __slots__ = ("op_id", "request_id", "receiver_rank", "piece", "kind", "state", "was_in_doubt",
                 "reported_in_doubt", "carried")

    def __init__(self, op_id: int, request_id: int, receiver_rank: int, piece: int, kind: PieceKind,
                 state: OpState = OpState.ADMITTED) -> None:
        self.op_id = op_id
        self.request_id = request_id
        self.receiver_rank = receiver_rank
        self.piece = piece  # KV piece index, or the number of KV pieces for the AUX piece
        self.kind = kind
        self.state = state
        self.was_in_doubt = False
        self.reported_in_doubt = False
        self.carried = False  # rule 6: its PostWrite carried the stream's report to NIXL

    @property
    def delivered_by_write(self) -> bool:
        """Rule 6: the carried report reached the receiver with the data (DONE, never in doubt)."""
        return self.carried and self.state is OpState.BACKEND_DONE and not self.was_in_doubt

    def apply(self, event: OpInput) -> None:
        nxt = OP_TRANSITIONS.get((self.state, event))
        if nxt is None:
            raise LocalProtocolError(
                "illegal operation transition", field=event.value, op_id=self.op_id, state=self.state.value
            )
        self.state = nxt
        self.was_in_doubt |= nxt is OpState.IN_DOUBT


class _Stream:
    """One (request, receiver) stream: its publication and its operations in report order."""

    __slots__ = ("request", "ops", "next_report", "quiesce_requested", "acked")

    def __init__(self, request: RequestData, ops: list[Operation]) -> None:
        self.request = request
        self.ops = ops
        self.next_report = 0  # index of the next op whose result is due
        self.quiesce_requested = False
        self.acked = False

    @property
    def reported_all(self) -> bool:
        return self.next_report == len(self.ops)

    def quiescent(self) -> bool:
        return self.reported_all and not any(op.state in LIVE for op in self.ops)


class SendSession:
    __slots__ = ("request_id", "src_blocks", "num_pieces", "num_receivers", "clock", "ready", "streams",
                 "outcome", "reason", "dst_suffix")

    def __init__(self, request_id: int, src_blocks: tuple[int, ...], num_pieces: int, num_receivers: int,
                 clock: RetirementClock, dst_suffix: bool = False) -> None:
        self.request_id = request_id
        self.src_blocks = src_blocks
        self.num_pieces = num_pieces
        self.num_receivers = num_receivers
        self.clock = clock
        self.ready: set[int] = set()
        self.streams: dict[int, _Stream] = {}
        self.outcome: Outcome | None = None
        self.reason = ""
        self.dst_suffix = dst_suffix  # rule 4a

    @property
    def state(self) -> SxState:
        """Derived from the fields (a live session is never RELEASED: that one is gone)."""
        if self.reason == _FATAL_REASON:
            return SxState.FATAL
        if self.outcome is not None:
            return SxState.DRAINING
        return SxState.PUBLISHED if self.streams else SxState.OPEN

    def piece_blocks(self, piece: int) -> slice:
        n = len(self.src_blocks)
        return slice(piece * n // self.num_pieces, (piece + 1) * n // self.num_pieces)

    def has_live_ops(self) -> bool:
        """``bool(live_ops())`` without building the list (called after every input)."""
        for st in self.streams.values():
            for op in st.ops:
                if op.state in IN_FLIGHT:
                    return True
        return False

    def live_ops(self) -> list[Operation]:
        return [op for st in self.streams.values() for op in st.ops if op.state in IN_FLIGHT]


class SenderCore(RankCore[SendSession]):
    """One rank's send side. Sans-IO: ``handle(event, now_ns) -> actions``."""

    def __init__(self, config: CoreConfig, *, max_saved: int = 65536, carry_results: bool = True) -> None:
        super().__init__(config)
        self.carry_results = carry_results  # rule 6 (the peers' "carried_results" capability)
        self.poisoned = ""  # non-empty: an operation went in doubt; nothing is ever posted again
        self.max_saved = max_saved
        self._saved: dict[int, dict[int, RequestData]] = {}  # publications waiting for their session
        self._ops: dict[int, tuple[SendSession, _Stream, Operation]] = {}
        self._next_op = 0

    def _is_admission(self, event: Event) -> bool:
        return isinstance(event, OpenSend)

    # ---- dispatch -----------------------------------------------------------------------------

    def _dispatch(self, event: Event, now_ns: int, actions: list[Action]) -> None:
        s, kind = self._session_input(event)
        if s is None or kind is None:
            self._dispatch_input(event, now_ns, actions)
            return
        before = s.state
        if (before, kind) not in SX_TRANSITIONS:
            error = PeerProtocolError if kind in SX_PEER_INPUTS else LocalProtocolError
            raise error("illegal input for the send session's state", field=kind.value,
                        request_id=s.request_id, state=before.value)
        self._dispatch_input(event, now_ns, actions)
        self._sx_guard(s, before, kind)

    def _session_input(self, event: Event) -> tuple[SendSession | None, SxInput | None]:
        """The live session an input is for, and its kind for SX_TRANSITIONS (None, None: no session)."""
        t = type(event)
        if t is MessageReceived:
            message = event.envelope.message  # type: ignore[attr-defined]
            kind = _MESSAGE_INPUT.get(type(message))
            return (self.sessions.get(message.request_id), kind) if kind is not None else (None, None)
        if t is SourceReady or t is CancelRequested:
            kind = SxInput.SOURCE_READY if t is SourceReady else SxInput.CANCEL
            return self.sessions.get(event.request_id), kind  # type: ignore[attr-defined]
        if t in _WRITE_INPUT:
            entry = self._ops.get(event.op_id)  # type: ignore[attr-defined]
            return (entry[0], SxInput.WRITE) if entry is not None else (None, None)
        return None, None

    def _sx_guard(self, s: SendSession, before: SxState, kind: SxInput) -> None:
        """The session's step from ``before`` must be a cell of SX_TRANSITIONS: its state is derived
        from its fields, so a handler that moved it elsewhere is our bug."""
        after = s.state if self.sessions.get(s.request_id) is s else SxState.RELEASED
        if after not in SX_TRANSITIONS.get((before, kind), ()):
            raise InvariantViolation("send session step outside SX_TRANSITIONS", request_id=s.request_id,
                                     state=before.value, input=kind.value, to=after.value)

    def _dispatch_input(self, event: Event, now_ns: int, actions: list[Action]) -> None:
        t = type(event)
        if t is MessageReceived:
            message, src = event.envelope.message, event.envelope.src_rank  # type: ignore[attr-defined]
            if type(message) is RequestData:
                self._on_request_data(message, src, now_ns, actions)
            elif type(message) is CancelSession:
                self._on_cancel_session(message, src, now_ns, actions)
            else:
                raise PeerProtocolError("message not expected by a sender", field="kind", kind=message.KIND.name)
        elif t in _WRITE_INPUT:
            self._on_write_event(event, now_ns, actions)
        elif t is OpenSend:
            self._open(event, now_ns, actions)  # type: ignore[arg-type]
        elif t is SourceReady:
            self._on_source_ready(event, now_ns, actions)  # type: ignore[arg-type]
        elif t is CancelRequested:
            self._on_local_cancel(event, now_ns, actions)  # type: ignore[arg-type]
        else:
            raise LocalProtocolError("event not handled by a sender", field="event", event=t.__name__)

    # ---- admission -----------------------------------------------------------------------------

    def _open(self, event: OpenSend, now_ns: int, actions: list[Action]) -> None:
        rid = event.request_id
        if not is_valid_request_id(rid):
            raise LocalProtocolError("invalid request id", field="request_id", request_id=rid)
        if rid in self.sessions:
            raise LocalProtocolError("request already has a live send session", field="request_id", request_id=rid)
        if not event.src_blocks or not (1 <= event.num_pieces <= len(event.src_blocks)):
            raise LocalProtocolError("need 1 <= num_pieces <= len(src_blocks)", field="num_pieces")
        if event.dst_suffix and event.num_pieces != 1:
            raise LocalProtocolError("dst_suffix needs a single piece", field="dst_suffix")
        if event.num_receivers < 1:
            raise LocalProtocolError("need at least one receiver", field="num_receivers")
        if not all(0 <= piece < event.num_pieces for piece in event.ready_pieces):
            raise LocalProtocolError("ready piece out of range", field="ready_pieces", ready=event.ready_pieces)
        if not self._admissible(rid):
            actions.append(AdmissionRefused(rid, "stale: the request's epoch is below the world watermark"))
            return
        if self.fence.is_fenced(rid):  # born cancelled (rule 4)
            self._decline_saved(rid, actions)
            actions += [Conclude(rid, Outcome.CANCELLED, "fenced before the session opened"), ReleaseSource(rid)]
            self._count("born_cancelled")
            return
        session = SendSession(
            rid, event.src_blocks, event.num_pieces, event.num_receivers,
            RetirementClock(self.config.timeout_ns, self.config.grace_ns), dst_suffix=event.dst_suffix,
        )
        session.ready.update(event.ready_pieces)  # as one SourceReady each, before any publication attaches
        self.sessions[rid] = session
        for src, request in self._saved.pop(rid, {}).items():
            if not self._fits(session, request):  # the check a live publication gets (defect 7)
                self._count("invalid_publications")
                actions.append(SendControl(src, _declined(self.config.rank, rid)))
                continue
            self._attach(session, request, src, now_ns, actions)

    def _on_request_data(self, request: RequestData, src: int, now_ns: int, actions: list[Action]) -> None:
        rid = request.request_id
        if request.receiver_rank != src:
            raise PeerProtocolError("REQUEST_DATA names another receiver than its stream", field="receiver_rank")
        if not self._admissible(rid):
            raise PeerProtocolError("REQUEST_DATA for a stale epoch", field="request_id", request_id=rid)
        if request.slice_index >= request.num_slices:
            raise PeerProtocolError("slice_index must be < num_slices", field="slice_index")
        session = self.sessions.get(rid)
        if session is not None:
            if src in session.streams:
                raise PeerProtocolError("second REQUEST_DATA on one stream", field="request_id", request_id=rid)
            if not self._fits(session, request):  # rule 4: it can never be served; say so at once
                self._count("invalid_publications")
                actions.append(SendControl(src, _declined(self.config.rank, rid)))
                return
            self._attach(session, request, src, now_ns, actions)
        elif self.fence.is_fenced(rid):  # fenced and no session: refuse the whole stream at once
            actions.append(SendControl(src, _declined(self.config.rank, rid)))
        else:
            if src in self._saved.get(rid, {}):
                raise PeerProtocolError("second REQUEST_DATA on one stream", field="request_id", request_id=rid)
            if rid not in self._saved and len(self._saved) >= self.max_saved:
                raise PeerProtocolError("too many publications waiting for sessions", field="request_id")
            self._saved.setdefault(rid, {})[src] = request

    @staticmethod
    def _fits(s: SendSession, request: RequestData) -> bool:
        """A publication names one destination block per source block of the session, or (rule 4a) one
        per block of a suffix of it."""
        n = len(request.dst_blocks)
        return n == len(s.src_blocks) or (s.dst_suffix and 1 <= n < len(s.src_blocks))

    def _attach(self, s: SendSession, request: RequestData, src: int, now_ns: int, actions: list[Action]) -> None:
        kinds = [(p, PieceKind.KV) for p in range(s.num_pieces)]
        if request.aux_slot >= 0 and request.slice_index == 0:
            kinds.append((s.num_pieces, PieceKind.AUX))
        ops = []
        for piece, kind in kinds:
            op = Operation(self._next_op, s.request_id, src, piece, kind)
            self._next_op += 1
            ops.append(op)
        stream = _Stream(request, ops)
        s.streams[src] = stream
        for op in ops:
            self._ops[op.op_id] = (s, stream, op)
        self._post_ready(s, stream, now_ns, actions)
        self._after_progress(s, now_ns, actions)

    # ---- posting -------------------------------------------------------------------------------

    def _on_source_ready(self, event: SourceReady, now_ns: int, actions: list[Action]) -> None:
        s = self.sessions.get(event.request_id)
        if s is None:
            if self.fence.is_fenced(event.request_id):
                return  # the session was born cancelled or already finished after a cancel
            raise LocalProtocolError("no live send session", field="request_id", request_id=event.request_id)
        if not (0 <= event.piece < s.num_pieces):
            raise LocalProtocolError("piece out of range", field="piece", piece=event.piece)
        s.ready.add(event.piece)
        for stream in s.streams.values():
            self._post_ready(s, stream, now_ns, actions)

    def _source_ready(self, s: SendSession, op: Operation) -> bool:
        """INV-S1 guard: the KV this op reads has been written (AUX needs every KV piece)."""
        if op.kind is PieceKind.AUX:
            return len(s.ready) == s.num_pieces
        return op.piece in s.ready

    def _post_ready(self, s: SendSession, stream: _Stream, now_ns: int, actions: list[Action]) -> None:
        if self.poisoned and s.outcome is None:  # rule 2: a session attached after the poison fails too
            self._conclude(s, Outcome.FAILED, "sender poisoned", now_ns, actions)
        if s.outcome is not None or self.poisoned:
            self._refuse_admitted(s, stream, actions)
            return
        for op in stream.ops:
            if op.state is OpState.ADMITTED and self._source_ready(s, op):
                op.apply(OpInput.POST)
                s.clock.expose(now_ns)
                actions.append(self._post_action(s, stream.request, op))
        self._schedule(s.request_id, s)

    def _post_action(self, s: SendSession, request: RequestData, op: Operation) -> PostWrite:
        if not self._fits(s, request):  # every attach path checked this (rule 4)
            raise InvariantViolation("PostWrite with a destination of another length", request_id=s.request_id,
                                     src=len(s.src_blocks), dst=len(request.dst_blocks))
        result = None
        if self._carries(s, op):
            op.carried = True
            result = _result(self.config.rank, s.request_id, op, True, ResultStatus.SUCCESS)
        if op.kind is PieceKind.AUX:
            return PostWrite(op.op_id, s.request_id, op.receiver_rank, op.piece, op.kind, (), (),
                             request.slice_index, request.num_slices, request.aux_slot, result)
        skip = len(s.src_blocks) - len(request.dst_blocks)  # rule 4a: 0 unless the receiver holds a prefix
        if skip:
            src, dst = s.src_blocks[skip:], request.dst_blocks
        else:
            span = s.piece_blocks(op.piece)
            src, dst = s.src_blocks[span], request.dst_blocks[span]
        return PostWrite(op.op_id, s.request_id, op.receiver_rank, op.piece, op.kind, src, dst,
                         request.slice_index, request.num_slices, -1, result)

    def _carries(self, s: SendSession, op: Operation) -> bool:
        """Rule 6 guard: only the one operation of a single-operation stream carries its report."""
        return self.carry_results and len(s.streams[op.receiver_rank].ops) == 1

    def _refuse_admitted(self, s: SendSession, stream: _Stream, actions: list[Action]) -> None:
        for op in stream.ops:
            if op.state is OpState.ADMITTED:
                op.apply(OpInput.REFUSE)
        self._flush(s, stream, actions)

    # ---- backend outcomes ----------------------------------------------------------------------

    def _on_write_event(self, event: Event, now_ns: int, actions: list[Action]) -> None:
        entry = self._ops.get(event.op_id)  # type: ignore[attr-defined]
        if entry is None:
            raise LocalProtocolError("unknown operation", field="op_id", op_id=event.op_id)  # type: ignore[attr-defined]
        s, stream, op = entry
        op.apply(_WRITE_INPUT[type(event)])
        if op.state is OpState.IN_DOUBT:
            self.poisoned = self.poisoned or f"op {op.op_id} of request {s.request_id} in doubt: {event.reason}"  # type: ignore[attr-defined]
            s.clock.start_drain(now_ns, "backend quiescence unproven")
            self._conclude(s, Outcome.FAILED, "write in doubt", now_ns, actions)
            for other in list(self.sessions.values()):  # rule 2: poison refuses everything not yet posted
                if other is not s and any(op.state is OpState.ADMITTED for st in other.streams.values() for op in st.ops):
                    before = other.state
                    self._conclude(other, Outcome.FAILED, "sender poisoned", now_ns, actions)
                    self._after_progress(other, now_ns, actions)
                    self._sx_guard(other, before, SxInput.POISON)
        elif op.state is OpState.NOT_SUBMITTED:
            self._conclude(s, Outcome.FAILED, f"write not submitted: {event.reason}", now_ns, actions)  # type: ignore[attr-defined]
        self._flush(s, stream, actions)
        self._after_progress(s, now_ns, actions)

    # ---- cancellation --------------------------------------------------------------------------

    def _on_cancel_session(self, cancel: CancelSession, src: int, now_ns: int, actions: list[Action]) -> None:
        rid = cancel.request_id
        if cancel.receiver_rank != src:
            raise PeerProtocolError("CANCEL_SESSION routes to another rank than its stream", field="receiver_rank")
        if not self._admissible(rid):  # its fence was compacted; nothing can exist for it
            actions.append(SendControl(src, SessionQuiesced(self.config.rank, rid)))
            return
        self.fence.install(rid, CancelOrigin.PEER)
        s = self.sessions.get(rid)
        stream = s.streams.get(src) if s is not None else None
        if s is None or stream is None:  # rule 4: nothing was or will be posted to src: ack now
            saved = self._saved.get(rid)
            if saved is not None:
                saved.pop(src, None)
                if not saved:
                    del self._saved[rid]
            actions.append(SendControl(src, SessionQuiesced(self.config.rank, rid)))
            if s is not None:
                self._conclude(s, Outcome.CANCELLED, "cancelled by a receiver", now_ns, actions)
                self._after_progress(s, now_ns, actions)
            return
        stream.quiesce_requested = True
        self._conclude(s, Outcome.CANCELLED, "cancelled by a receiver", now_ns, actions)
        self._after_progress(s, now_ns, actions)

    def _on_local_cancel(self, event: CancelRequested, now_ns: int, actions: list[Action]) -> None:
        rid = event.request_id
        if not is_valid_request_id(rid):
            raise LocalProtocolError("invalid request id", field="request_id", request_id=rid)
        if not self._admissible(rid):
            self._count("stale_cancels")
            return
        self.fence.install(rid, event.origin)
        s = self.sessions.get(rid)
        if s is not None:
            self._conclude(s, Outcome.CANCELLED, f"cancelled ({event.origin.name.lower()})", now_ns, actions)
            self._after_progress(s, now_ns, actions)
        else:
            self._decline_saved(rid, actions)

    def _decline_saved(self, rid: int, actions: list[Action]) -> None:
        """Rule 4: publications waiting for a session that can now never open get their final answer."""
        for src in self._saved.pop(rid, {}):
            actions.append(SendControl(src, _declined(self.config.rank, rid)))

    # ---- results, acks, outcome ----------------------------------------------------------------

    def _flush(self, s: SendSession, stream: _Stream, actions: list[Action]) -> None:
        """Emit due results in piece order (INV-S2), late settlements, then the ack if asked."""
        me, rid, ops = self.config.rank, s.request_id, stream.ops
        for op in ops[: stream.next_report]:  # late settlement of an already reported IN_DOUBT
            if op.reported_in_doubt and op.state is OpState.BACKEND_DONE:
                op.reported_in_doubt = False
                actions.append(SendControl(stream.request.receiver_rank, _result(me, rid, op, False, ResultStatus.FAILED_QUIESCED)))
        while stream.next_report < len(ops) and ops[stream.next_report].state in REPORTABLE:
            op = ops[stream.next_report]
            stream.next_report += 1
            last = stream.reported_all
            if op.delivered_by_write:  # rule 6: the WRITE's notification carried this report
                continue
            if op.was_in_doubt:
                actions.append(SendControl(stream.request.receiver_rank, _result(me, rid, op, last, ResultStatus.IN_DOUBT)))
                op.reported_in_doubt = op.state is OpState.IN_DOUBT
                if op.state is OpState.BACKEND_DONE:
                    actions.append(SendControl(stream.request.receiver_rank, _result(me, rid, op, False, ResultStatus.FAILED_QUIESCED)))
            else:
                status = ResultStatus.SUCCESS if op.state is OpState.BACKEND_DONE else ResultStatus.FAILED
                actions.append(SendControl(stream.request.receiver_rank, _result(me, rid, op, last, status)))
        if stream.quiesce_requested and not stream.acked and stream.quiescent():  # rule 3
            stream.acked = True
            if not ops[-1].delivered_by_write:  # rule 6: a carried final result is the stream's end
                actions.append(SendControl(stream.request.receiver_rank, SessionQuiesced(me, rid)))

    def _conclude(self, s: SendSession, outcome: Outcome, reason: str, now_ns: int, actions: list[Action]) -> None:
        if s.outcome is not None:
            return
        s.outcome, s.reason = outcome, reason
        actions.append(Conclude(s.request_id, outcome, reason))
        if outcome is not Outcome.COMPLETED:
            self.fence.install(s.request_id, ORIGIN_OF_OUTCOME[outcome])
            s.clock.start_drain(now_ns, reason)
            for stream in s.streams.values():
                self._refuse_admitted(s, stream, actions)

    def _after_progress(self, s: SendSession, now_ns: int, actions: list[Action]) -> None:
        """Complete the session when every stream delivered; release the source when nothing reads it."""
        if s.outcome is None and len(s.streams) == s.num_receivers and all(
            st.reported_all and all(op.state is OpState.BACKEND_DONE and not op.was_in_doubt for op in st.ops)
            for st in s.streams.values()
        ):
            self._conclude(s, Outcome.COMPLETED, "every stream delivered", now_ns, actions)
        for stream in s.streams.values():
            self._flush(s, stream, actions)
        if s.outcome is not None and not s.has_live_ops() and all(
            st.quiescent() and (st.acked or not st.quiesce_requested) for st in s.streams.values()
        ):
            del self.sessions[s.request_id]
            for stream in s.streams.values():
                for op in stream.ops:
                    self._ops.pop(op.op_id, None)
            actions.append(ReleaseSource(s.request_id))
        else:
            self._schedule(s.request_id, s)

    # ---- time ----------------------------------------------------------------------------------

    def _evaluate(self, request_id: int, s: SendSession, now_ns: int, actions: list[Action]) -> None:
        if s.outcome is None and s.clock.timed_out(now_ns):
            before = s.state
            self.fence.install(request_id, CancelOrigin.TIMEOUT)
            self._conclude(s, Outcome.TIMED_OUT, "transfer timeout", now_ns, actions)
            self._after_progress(s, now_ns, actions)
            self._sx_guard(s, before, SxInput.TIMEOUT)

    def _session_deadlines(self, s: SendSession) -> tuple[int | None, int | None]:
        return (s.clock.request_deadline_ns if s.outcome is None else None), self._fatal_deadline_ns(s)

    def _fatal_deadline_ns(self, s: SendSession) -> int | None:
        return s.clock.fatal_deadline_ns if s.has_live_ops() else None

    def _fatal_action(self, request_id: int, s: SendSession) -> FailStop:
        ops = ", ".join(f"op {op.op_id} {op.state.value} -> rank {op.receiver_rank}" for op in s.live_ops())
        return FailStop(FatalReason.DEADLINE, request_id, f"send operations unproven at the deadline: {ops}")

    def _mark_fatal(self, s: SendSession) -> None:
        before = s.state
        s.reason = _FATAL_REASON
        self._sx_guard(s, before, SxInput.DEADLINE)

    def _state_name(self, s: SendSession) -> str:
        return s.state.value

    def open_sessions(self) -> list[dict[str, object]]:
        """Pure: every live session as plain values, for post-mortems (see ``ReceiverCore.open_sessions``)."""
        out: list[dict[str, object]] = []
        for rid, s in list(self.sessions.items()):
            live = [f"op {op.op_id} {op.kind.value} piece {op.piece} {op.state.value} -> rank {op.receiver_rank}"
                    for op in s.live_ops()]
            out.append({"role": "sender", "request_id": rid, "state": self._state_name(s),
                        "outcome": None if s.outcome is None else s.outcome.value, "reason": s.reason,
                        "writers": [{"rank": r, "acked": st.acked, "quiesce_requested": st.quiesce_requested,
                                     "reported_all": st.reported_all} for r, st in list(s.streams.items())],
                        "missing": live, "opened_ns": s.clock.exposed_ns,
                        "drain_started_ns": s.clock.drain_started_ns, "drain_reason": s.clock.drain_reason,
                        "fatal_deadline_ns": self._fatal_deadline_ns(s)})
        return out

    def saved_publications(self) -> int:
        """Pure: publications waiting for a session that has not opened yet (for audits)."""
        return len(self._saved)

    def published(self, request_id: int) -> bool:
        """Pure: some receiver's publication is attached to the live session (for the driver's handles)."""
        s = self.sessions.get(request_id)
        return s is not None and bool(s.streams)

    def may_write(self, request_id: int, receiver_rank: int) -> bool:
        """True if some operation of this stream is posted or could still be posted (for checkers)."""
        s = self.sessions.get(request_id)
        stream = s.streams.get(receiver_rank) if s is not None else None
        if stream is None:
            saved = self._saved.get(request_id, {})
            return receiver_rank in saved and not self.fence.is_fenced(request_id) and not self.poisoned
        return any(op.state in LIVE for op in stream.ops)


def _declined(writer: int, rid: int) -> KvResult:
    """The final answer to a publication that will never be served: nothing was or will be posted."""
    return KvResult(writer, rid, 0, True, ResultStatus.FAILED, 0)


def _result(writer: int, rid: int, op: Operation, last: bool, status: ResultStatus) -> KvResult | AuxResult:
    cls = AuxResult if op.kind is PieceKind.AUX else KvResult
    nbytes = 0  # the driver knows the byte counts; the protocol does not depend on them
    return cls(writer, rid, 0 if op.kind is PieceKind.AUX else op.piece, last, status, nbytes)


_MESSAGE_INPUT = {RequestData: SxInput.PUBLISH, CancelSession: SxInput.PEER_CANCEL}
_WRITE_INPUT = {
    WriteSubmitted: OpInput.SUBMITTED,
    WriteNotSubmitted: OpInput.NOT_SUBMITTED,
    WriteSubmitFailed: OpInput.SUBMIT_FAILED,
    WriteCompleted: OpInput.DONE,
    WriteFailed: OpInput.FAILED,
}
