"""ReceiverCore alone: table-driven cases over the evidence ledger, deadlines and admission."""

from __future__ import annotations

import pytest
from corekit import G, RX, T, kinds, msg, receiver

from kvown.core.actions import Conclude, FailStop, Outcome, SendControl
from kvown.core.events import OpenReceive, Tick
from kvown.core.messages import CancelSession


def _open(r, rid=1, writers=(1,), slices=1, aux=-1, now=0):
    out = r.handle(OpenReceive(rid, (0, 1), writers, slices, aux), now)
    return out


@pytest.mark.timeout(10)
def test_tick_at_next_deadline_applies_the_timeout_and_returns_its_actions() -> None:
    """Regression: Tick (what a driver sends at next_deadline_ns) used to raise LocalProtocolError after
    the timeout had already been applied, so the Conclude and CANCEL_SESSION were lost."""
    r = receiver()
    _open(r)
    assert r.next_deadline_ns() == T
    out = r.handle(Tick(), T)
    assert kinds(out) == ["Conclude", "SendControl:CancelSession"]
    assert out[0] == Conclude(1, Outcome.TIMED_OUT, "transfer timeout")
    assert out[1] == SendControl(1, CancelSession(1, RX))
    assert r.next_deadline_ns() == T + G
    out = r.handle(Tick(), T + G)
    assert len(out) == 1 and isinstance(out[0], FailStop) and r.fatal is out[0]


@pytest.mark.timeout(10)
def test_completion_with_acks_outstanding_schedules_the_drain_deadline() -> None:
    """Regression: a completion that starts the drain (a broadcast candidate has not acked) did not
    schedule drain + grace, so next_deadline_ns() said exposure + timeout and a missing ack went
    unpunished (and late evidence could retire) between the two."""
    from kvown.core.messages import KvResult, ResultStatus

    r = receiver(timeout=10_000, grace=100)
    _open(r, writers=(1, 2))  # broadcast: 2 candidates, 1 slice
    out = r.handle(msg(1, RX, KvResult(1, 1, 0, True, ResultStatus.SUCCESS, 0)), 50)
    assert kinds(out) == ["Deliver", "Conclude", "SendControl:CancelSession"]
    assert r.next_deadline_ns() == 150  # drain started at 50; not 10_000 (exposure + timeout)
    assert r.check_fatal(149) is None and r.check_fatal(150) is not None
    out = r.handle(Tick(), 150)
    assert isinstance(out[0], FailStop) and "writer 2" in out[0].detail


@pytest.mark.timeout(10)
def test_actions_of_applied_time_survive_a_rejected_event() -> None:
    """Regression: handle() applies due timeouts before the event; when the event then raised (a bad
    peer frame delivered after the deadline), the timeout's Conclude and CANCEL_SESSION were lost while
    the session already counted the cancel as sent, so the writer was never asked to quiesce."""
    from kvown.core.errors import PeerProtocolError
    from kvown.core.messages import SessionQuiesced

    r = receiver()
    _open(r)
    forged = msg(3, RX, SessionQuiesced(1, 1))  # rank 3 claims to be writer 1
    with pytest.raises(PeerProtocolError) as info:
        r.handle(forged, T + 5)
    assert info.value.field == "writer_rank"
    assert r.next_deadline_ns() == T + 5  # call back now: actions are waiting
    out = r.handle(Tick(), T + 5)
    assert kinds(out) == ["Conclude", "SendControl:CancelSession"]
    assert r.handle(Tick(), T + 6) == []  # returned once


BAD_OPENS = [
    (OpenReceive(-1, (0,), (1,)), "request_id"),
    (OpenReceive(1, (0,), ()), "writers"),
    (OpenReceive(1, (0,), (1, 1)), "writers"),
    (OpenReceive(1, (0,), (1, 2, 3), 2), "num_slices"),
    (OpenReceive(1, (0,), (1,), 0), "num_slices"),
    (OpenReceive(1, (), (1,)), "dst_blocks"),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("event", "field"), BAD_OPENS)
def test_bad_opens_raise_and_create_nothing(event, field) -> None:
    from kvown.core.errors import LocalProtocolError

    r = receiver()
    with pytest.raises(LocalProtocolError) as info:
        r.handle(event, 0)
    assert info.value.field == field and not r.sessions


def _ok(piece=0, last=False, status=None, writer=1):
    from kvown.core.messages import KvResult, ResultStatus

    return KvResult(writer, 1, piece, last, status or ResultStatus.SUCCESS, 0)


INVALID_EVIDENCE = [
    ("second result for a piece", [_ok(0)], _ok(0)),
    ("result after the stream ended", [_ok(0, last=True)], _ok(1)),
    ("FAILED_QUIESCED without IN_DOUBT", [], "fq"),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("case", "first", "then"), INVALID_EVIDENCE, ids=[c[0] for c in INVALID_EVIDENCE])
def test_invalid_evidence_disputes_quarantines_and_never_retires(case, first, then) -> None:
    from kvown.core.messages import ResultStatus

    r = receiver()
    _open(r, writers=(1, 2), slices=2)
    seq = 0
    for m in first:
        r.handle(msg(1, RX, m, seq), 1)
        seq += 1
    if then == "fq":
        then = _ok(0, status=ResultStatus.FAILED_QUIESCED)
    r.handle(msg(1, RX, then, seq), 2)
    s = r.sessions[1]
    assert s.disputed and r.quarantined and r.counters["invalid_evidence"] == 1
    assert s.has_claims() and s.clock.drain_started_ns == 2
    from kvown.core.actions import AdmissionRefused

    assert isinstance(r.handle(OpenReceive(2, (5,), (1,)), 3)[0], AdmissionRefused)


@pytest.mark.timeout(10)
def test_slice_claims_and_complete_cohort() -> None:
    r = receiver()
    _open(r, writers=(1, 2, 3, 4), slices=2)  # candidates: 1,3 for slice 0; 2,4 for slice 1
    r.handle(msg(1, RX, _ok(0, True, writer=1)), 1)
    r.handle(msg(3, RX, _ok(0, True, writer=3)), 2)  # slice 0 already claimed by writer 1
    assert "already delivered by writer 1" in r.sessions[1].disputed


@pytest.mark.timeout(10)
def test_result_naming_another_writer_is_refused_without_change() -> None:
    from kvown.core.errors import PeerProtocolError

    r = receiver()
    _open(r)
    before = repr(r.sessions[1])
    with pytest.raises(PeerProtocolError) as info:
        r.handle(msg(2, RX, _ok(0, writer=1)), 1)
    assert info.value.field == "writer_rank" and repr(r.sessions[1]) == before and not r.quarantined


@pytest.mark.timeout(10)
def test_release_of_an_undelivered_session_is_a_local_error() -> None:
    from kvown.core.errors import LocalProtocolError
    from kvown.core.events import CancelRequested, ReleaseRequested

    r = receiver()
    _open(r)
    r.handle(CancelRequested(1), 1)
    with pytest.raises(LocalProtocolError):
        r.handle(ReleaseRequested(1), 2)
