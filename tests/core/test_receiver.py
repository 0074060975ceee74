"""ReceiverCore alone: table-driven cases over the evidence ledger, deadlines and admission."""

from __future__ import annotations

import pytest
from corekit import G, RX, T, kinds, msg, receiver

from kvown.core.actions import Conclude, FailStop, Outcome, SendControl
from kvown.core.events import OpenReceive, PublicationSent, Tick
from kvown.core.messages import CancelSession


def _open(r, rid=1, writers=(1,), slices=1, aux=-1, now=0):
    out = r.handle(OpenReceive(rid, (0, 1), writers, slices, aux), now)
    out += r.handle(PublicationSent(rid), now)
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
    assert kinds(out) == ["Conclude", "Deliver", "SendControl:CancelSession"]
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
