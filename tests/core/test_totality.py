"""Totality: every (state, input) pair of RX_TRANSITIONS, RX_TIMER_TRANSITIONS, SX_TRANSITIONS and
OP_TRANSITIONS is either routed to its named handler / next state, or raises the right error and leaves
the state unchanged (or, for the sender's time and poison inputs, cannot happen)."""

from __future__ import annotations

import itertools

import pytest
from corekit import RX, msg, receiver, sender

from kvown.core.errors import InvariantViolation, LocalProtocolError, PeerProtocolError
from kvown.core.events import (
    CancelRequested,
    LocalCompletionDone,
    LocalCompletionPending,
    OpenReceive,
    OpenSend,
    ReleaseRequested,
    SourceReady,
    Tick,
    WriteCompleted,
    WriteFailed,
    WriteNotSubmitted,
    WriteSubmitFailed,
    WriteSubmitted,
)
from kvown.core.messages import CancelSession, KvResult, RequestData, ResultStatus, SessionQuiesced
from kvown.core.receiver import PEER_INPUTS, RX_TIMER_TRANSITIONS, RX_TRANSITIONS, ReceiverCore, RxInput, RxState, RxTimer
from kvown.core.sender import OP_TRANSITIONS, SX_TRANSITIONS, Operation, OpInput, OpState, PieceKind, SxInput, SxState

RX_EVENTS = {
    RxInput.CANCEL: lambda: CancelRequested(1),
    RxInput.RESULT: lambda: msg(1, RX, KvResult(1, 1, 0, False, ResultStatus.SUCCESS, 0)),
    RxInput.QUIESCED: lambda: msg(1, RX, SessionQuiesced(1, 1)),
    RxInput.LOCAL_PENDING: lambda: LocalCompletionPending(1, 6),
    RxInput.LOCAL_DONE: lambda: LocalCompletionDone(1, 5),
    RxInput.RELEASE: lambda: ReleaseRequested(1),
}


def _snapshot(r):
    s = r.sessions.get(1)
    if s is None:
        return None
    c = s.clock
    return (repr(s), c.exposed_ns, c.drain_started_ns, c.drain_reason, r.quarantined, len(r.fence))


@pytest.mark.timeout(10)
def test_every_receiver_input_has_an_event() -> None:
    assert set(RX_EVENTS) == set(RxInput)
    from kvown.core.receiver import ReceiverCore

    assert all(callable(getattr(ReceiverCore, t.handler, None)) for t in RX_TRANSITIONS.values())


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("state", "kind"), list(itertools.product(RxState, RxInput)), ids=lambda v: v.value)
def test_receiver_pair(state: RxState, kind: RxInput, monkeypatch: pytest.MonkeyPatch) -> None:
    r = receiver()
    r.handle(OpenReceive(1, (0,), (1,)), 0)
    s = r.sessions[1]
    s.state = state
    s.local_pending[5] = 0
    step = RX_TRANSITIONS.get((state, kind))
    if step is not None:
        called = []
        monkeypatch.setattr(type(r), step.handler, lambda self, *args: called.append(args[0]))
        r.handle(RX_EVENTS[kind](), 1)
        assert len(called) == 1
        return
    before = _snapshot(r)
    error = PeerProtocolError if kind in PEER_INPUTS else LocalProtocolError
    with pytest.raises(error) as info:
        r.handle(RX_EVENTS[kind](), 1)
    assert type(info.value) is error and info.value.field == kind.value
    after = _snapshot(r)
    if kind is RxInput.CANCEL:  # the fence is rank state: a cancel always fences, even when refused here
        assert r.fence.is_fenced(1) and after[:-1] == before[:-1]
    else:
        assert after == before


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("state", "inp"), list(itertools.product(OpState, OpInput)), ids=lambda v: v.value)
def test_operation_pair(state: OpState, inp: OpInput) -> None:
    op = Operation(0, 1, RX, 0, PieceKind.KV, state=state)
    nxt = OP_TRANSITIONS.get((state, inp))
    if nxt is not None:
        op.apply(inp)
        assert op.state is nxt
        return
    with pytest.raises(LocalProtocolError) as info:
        op.apply(inp)
    assert info.value.field == inp.value and op.state is state


WRITE_EVENTS = {
    OpInput.SUBMITTED: lambda i: WriteSubmitted(i),
    OpInput.NOT_SUBMITTED: lambda i: WriteNotSubmitted(i, "r"),
    OpInput.SUBMIT_FAILED: lambda i: WriteSubmitFailed(i, "r"),
    OpInput.DONE: lambda i: WriteCompleted(i),
    OpInput.FAILED: lambda i: WriteFailed(i, "r"),
}


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("state", "inp"), list(itertools.product(OpState, WRITE_EVENTS)), ids=lambda v: v.value)
def test_sender_driver_events_through_handle(state: OpState, inp: OpInput) -> None:
    """The driver's five answers reach the op table; illegal ones raise and change nothing."""
    s = sender()
    s.handle(OpenSend(1, (0, 1), 2), 0)
    s.handle(msg(RX, 1, RequestData(1, RX, (5, 6), 0, 1, -1)), 0)
    session, stream, op = s._ops[0]
    op.state = state
    before = (repr(session), s.poisoned)
    if (state, inp) in OP_TRANSITIONS:
        s.handle(WRITE_EVENTS[inp](0), 1)
        assert op.state is OP_TRANSITIONS[(state, inp)]
        return
    with pytest.raises(LocalProtocolError):
        s.handle(WRITE_EVENTS[inp](0), 1)
    assert (repr(session), s.poisoned) == before


@pytest.mark.timeout(10)
def test_unknown_op_and_unknown_event_raise() -> None:
    s = sender()
    with pytest.raises(LocalProtocolError):
        s.handle(WriteCompleted(42), 0)
    with pytest.raises(LocalProtocolError):
        s.handle(ReleaseRequested(1), 0)
    with pytest.raises(LocalProtocolError):
        s.handle(SourceReady(3, 0), 0)
    with pytest.raises(LocalProtocolError):
        receiver().handle(SourceReady(1, 0), 0)


# ---- receiver time (RX_TIMER_TRANSITIONS) -----------------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("state", "timer"), list(itertools.product(RxState, RxTimer)), ids=lambda v: v.value)
def test_receiver_timer_pair(state: RxState, timer: RxTimer) -> None:
    r = receiver()
    r.handle(OpenReceive(1, (0,), (1,)), 0)
    s = r.sessions[1]
    s.state = state
    to = RX_TIMER_TRANSITIONS.get((state, timer))
    if to is not None:
        assert ReceiverCore._timer(s, timer) == to and to
        return
    with pytest.raises(InvariantViolation) as info:
        ReceiverCore._timer(s, timer)
    assert info.value.state == state.value and s.state is state


# ---- the sender session (SX_TRANSITIONS over the derived SendSession.state) -------------------------

RX2 = 8  # a second receiver


def _sender_in(state: SxState, *, posted: bool = True):
    """A sender whose session 1 is in ``state``; with ``posted`` its one operation is SUBMITTED."""
    s = sender()
    s.handle(OpenSend(1, (0, 1), 1, num_receivers=2), 0)
    if state is not SxState.OPEN:
        s.handle(msg(RX, 1, RequestData(1, RX, (5, 6), 0, 1, -1)), 0)
        if posted:
            s.handle(SourceReady(1, 0), 0)
            s.handle(WriteSubmitted(0), 0)
    if state in (SxState.DRAINING, SxState.FATAL):
        s.handle(CancelRequested(1), 0)  # the posted op keeps it draining
    if state is SxState.FATAL:
        s.handle(Tick(), 10_000)
    assert s.sessions[1].state is state
    return s


def _poison_another(s) -> None:
    """Session 2's WRITE goes in doubt: the rank is poisoned (sender rule 2)."""
    t = s._now_ns
    s.handle(OpenSend(2, (2,), 1), t)
    s.handle(msg(RX2, 1, RequestData(2, RX2, (7,), 0, 1, -1)), t)
    s.handle(SourceReady(2, 0), t)
    op = max(s._ops, default=0)
    s.handle(WriteSubmitted(op), t)
    s.handle(WriteFailed(op, "planted"), t)


def _at(s, t: int) -> int:
    return max(t, s._now_ns)  # a FATAL sender's clock is already at 10_000


SX_FEED = {
    SxInput.PUBLISH: lambda s: s.handle(msg(RX2, 1, RequestData(1, RX2, (3, 4), 0, 1, -1)), _at(s, 1)),
    SxInput.SOURCE_READY: lambda s: s.handle(SourceReady(1, 0), _at(s, 1)),
    SxInput.WRITE: lambda s: s.handle(WriteCompleted(0), _at(s, 1)),
    SxInput.CANCEL: lambda s: s.handle(CancelRequested(1), _at(s, 1)),
    SxInput.PEER_CANCEL: lambda s: s.handle(msg(RX, 1, CancelSession(1, RX)), _at(s, 1)),
    SxInput.POISON: _poison_another,
    SxInput.TIMEOUT: lambda s: s.handle(Tick(), _at(s, 1000)),  # the request deadline (exposure 0 + T)
    SxInput.DEADLINE: lambda s: s.handle(Tick(), _at(s, 20_000)),
}


def _state_of(s) -> SxState:
    return s.sessions[1].state if 1 in s.sessions else SxState.RELEASED


@pytest.mark.timeout(10)
def test_every_sender_input_has_a_feed_and_terminal_states_have_no_row() -> None:
    assert set(SX_FEED) == set(SxInput)
    assert not [k for k in SX_TRANSITIONS if k[0] in (SxState.RELEASED, SxState.FATAL)]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("state", "kind"), list(itertools.product(
    [SxState.OPEN, SxState.PUBLISHED, SxState.DRAINING, SxState.FATAL], SxInput)), ids=lambda v: v.value)
def test_sender_session_pair(state: SxState, kind: SxInput) -> None:
    """A legal pair ends in one of its cell's states (the guard checked every step on the way); an
    illegal one raises and changes nothing, or cannot happen: that input leaves the session alone."""
    s = _sender_in(state, posted=(state, kind) != (SxState.PUBLISHED, SxInput.POISON))  # poison needs ADMITTED
    before = repr(s.sessions[1])
    to = SX_TRANSITIONS.get((state, kind))
    if to is not None:
        SX_FEED[kind](s)
        assert _state_of(s) in to
        return
    if (state, kind) == (SxState.OPEN, SxInput.WRITE):  # no operation exists to answer for
        with pytest.raises(LocalProtocolError):
            SX_FEED[kind](s)
    elif (state, kind) == (SxState.PUBLISHED, SxInput.DEADLINE):
        session = s.sessions[1]  # the request deadline always comes first: PUBLISHED -> DRAINING -> FATAL
        assert s._fatal_deadline_ns(session) > session.clock.request_deadline_ns
        SX_FEED[kind](s)
        assert _state_of(s) is SxState.FATAL
        return
    elif kind is SxInput.TIMEOUT:  # what time does to it, without the fail-stop deadline it also passes
        s._evaluate(1, s.sessions[1], 1000, [])
    else:
        SX_FEED[kind](s)
    assert repr(s.sessions[1]) == before


@pytest.mark.interpreted_only
@pytest.mark.timeout(10)
def test_the_sender_guard_catches_a_step_outside_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: a local cancel that forgets to conclude a session with nothing posted - it would stay
    OPEN, holding its source for a request that is fenced for good."""
    from kvown.core.sender import SenderCore

    monkeypatch.setattr(SenderCore, "_conclude", lambda self, s, outcome, reason, now_ns, actions: None)
    s = _sender_in(SxState.OPEN)
    with pytest.raises(InvariantViolation, match="outside SX_TRANSITIONS") as info:
        s.handle(CancelRequested(1), 1)
    assert info.value.state == "open" and info.value.to == "open"


@pytest.mark.timeout(10)
def test_poison_never_reaches_a_draining_session() -> None:
    """Why (DRAINING, POISON) is not a cell: poison concludes sessions with ADMITTED ops, and the
    outcome refuses every ADMITTED op (an unposted draining session is released at once)."""
    s = _sender_in(SxState.DRAINING)
    assert not any(op.state is OpState.ADMITTED for st in s.sessions[1].streams.values() for op in st.ops)
    s = _sender_in(SxState.PUBLISHED, posted=False)
    s.handle(CancelRequested(1), 1)
    assert 1 not in s.sessions
