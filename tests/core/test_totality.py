"""Totality: every (state, input) pair of RX_TRANSITIONS and OP_TRANSITIONS is either routed to its
named handler / next state, or raises the right error and leaves the state unchanged."""

from __future__ import annotations

import itertools

import pytest
from corekit import RX, msg, receiver, sender

from kvown.core.errors import LocalProtocolError, PeerProtocolError
from kvown.core.events import (
    CancelRequested,
    LocalCompletionDone,
    LocalCompletionPending,
    OpenReceive,
    OpenSend,
    ReleaseRequested,
    SourceReady,
    WriteCompleted,
    WriteFailed,
    WriteNotSubmitted,
    WriteSubmitFailed,
    WriteSubmitted,
)
from kvown.core.messages import KvResult, RequestData, ResultStatus, SessionQuiesced
from kvown.core.receiver import PEER_INPUTS, RX_TRANSITIONS, RxInput, RxState
from kvown.core.sender import OP_TRANSITIONS, Operation, OpInput, OpState, PieceKind

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

    assert all(callable(getattr(ReceiverCore, h, None)) for h in RX_TRANSITIONS.values())


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("state", "kind"), list(itertools.product(RxState, RxInput)), ids=lambda v: v.value)
def test_receiver_pair(state: RxState, kind: RxInput, monkeypatch: pytest.MonkeyPatch) -> None:
    r = receiver()
    r.handle(OpenReceive(1, (0,), (1,)), 0)
    s = r.sessions[1]
    s.state = state
    s.local_pending[5] = 0
    handler = RX_TRANSITIONS.get((state, kind))
    if handler is not None:
        called = []
        monkeypatch.setattr(type(r), handler, lambda self, *args: called.append(args[0]))
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
