"""The retirement clock and how the cores use it: validation, first trigger wins, anchoring, the
inclusive boundary, and the sticky fatal latch."""

from __future__ import annotations

import math

import pytest
from corekit import G, RX, T, kinds, msg, receiver, sender

from kvown.core.actions import AdmissionRefused, FailStop, Outcome, RetireBlocks
from kvown.core.deadline import RetirementClock, timeout_ns_from_s
from kvown.core.errors import ConfigError
from kvown.core.events import CancelRequested, OpenReceive, OpenSend, Tick
from kvown.core.machine import CoreConfig
from kvown.core.messages import KvResult, ResultStatus, SessionQuiesced


@pytest.mark.timeout(10)
@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, -math.inf, True, "5", None, 1e6])
def test_invalid_timeouts_are_rejected(bad) -> None:
    with pytest.raises(ConfigError) as info:
        timeout_ns_from_s(bad, field="kv_transfer_timeout_s")
    assert info.value.field == "kv_transfer_timeout_s"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("bad", [0, -1, 1.5, None])
def test_core_config_rejects_bad_nanoseconds(bad) -> None:
    with pytest.raises(ConfigError):
        CoreConfig(rank=1, timeout_ns=bad, grace_ns=1)
    assert timeout_ns_from_s(0.5, field="t") == 500_000_000


@pytest.mark.timeout(10)
def test_no_clock_before_exposure_and_later_exposures_do_not_move_it() -> None:
    c = RetirementClock(100, 50)
    assert c.request_deadline_ns is None and c.fatal_deadline_ns is None and not c.timed_out(10**9)
    c.expose(10)
    c.expose(60)
    assert c.request_deadline_ns == 110 and c.fatal_deadline_ns == 160


@pytest.mark.timeout(10)
@pytest.mark.parametrize("second", ["failure", "in doubt", "release", "shutdown"])
def test_first_drain_trigger_wins(second) -> None:
    c = RetirementClock(100, 50)
    c.expose(0)
    assert c.start_drain(20, "cancel") is True
    assert c.start_drain(40, second) is False
    assert (c.drain_started_ns, c.drain_reason, c.fatal_deadline_ns) == (20, "cancel", 70)  # INV-D1/D2


@pytest.mark.timeout(10)
def test_late_trigger_is_anchored_at_the_request_deadline() -> None:
    c = RetirementClock(100, 50)
    c.expose(0)
    c.start_drain(170, "cancel")  # noticed late: the timeout had already started the drain at 100
    assert (c.drain_started_ns, c.drain_reason, c.fatal_deadline_ns) == (100, "transfer timeout", 150)


def _cancelled_receiver():
    r = receiver()
    r.handle(OpenReceive(1, (0,), (1,)), 0)
    r.handle(CancelRequested(1), 100)  # drain starts at 100; fatal at 100 + G
    return r


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("at", "retires"), [(100 + G - 1, True), (100 + G, False), (100 + G + 1, False)])
def test_inclusive_boundary(at, retires) -> None:
    r = _cancelled_receiver()
    out = r.handle(msg(1, RX, SessionQuiesced(1, 1)), at)
    assert (RetireBlocks(1) in out) is retires
    assert any(isinstance(a, FailStop) for a in out) is (not retires)


@pytest.mark.timeout(10)
def test_timeout_is_anchored_at_the_request_deadline_even_when_noticed_late() -> None:
    r = receiver()
    r.handle(OpenReceive(1, (0,), (1,)), 0)
    out = r.handle(Tick(), T + 300)  # the driver is late by 300
    assert r.sessions[1].outcome is Outcome.TIMED_OUT and r.sessions[1].clock.drain_started_ns == T
    assert r.next_deadline_ns() == T + G
    assert kinds(out) == ["Conclude", "SendControl:CancelSession"]


@pytest.mark.timeout(10)
def test_completion_at_the_deadline_cannot_replace_the_timeout() -> None:
    r = receiver()
    r.handle(OpenReceive(1, (0,), (1,)), 0)
    out = r.handle(msg(1, RX, KvResult(1, 1, 0, True, ResultStatus.SUCCESS, 0)), T)
    assert kinds(out)[:2] == ["Conclude", "SendControl:CancelSession"] and out[0].outcome is Outcome.TIMED_OUT
    assert kinds(out)[-1] == "RetireBlocks"  # the writer's stream ended: settled, so it retires


@pytest.mark.timeout(10)
def test_fatal_is_sticky_and_closes_admission_for_every_session() -> None:
    r = _cancelled_receiver()
    r.handle(OpenReceive(2, (1,), (2,)), 110)
    out = r.handle(Tick(), 100 + G)
    assert isinstance(out[0], FailStop) and out[0].request_id == 1 and r.fatal is out[0]
    assert r.next_deadline_ns() is None and r.check_fatal(10**9) is r.fatal
    # INV-C1: evidence for any session changes nothing; admission is refused
    assert r.handle(msg(1, RX, SessionQuiesced(1, 1)), 100 + G + 1) == []
    assert r.handle(msg(2, RX, KvResult(2, 2, 0, True, ResultStatus.SUCCESS, 0)), 100 + G + 2) == []
    assert 2 in r.sessions and r.sessions[2].outcome is None
    out = r.handle(OpenReceive(3, (2,), (1,)), 100 + G + 3)
    assert out == [AdmissionRefused(3, "fatal: this rank is fail-stopping")] and 3 not in r.sessions
    s = sender()
    s.fatal = FailStop(r.fatal.reason, None, "latched")
    assert s.handle(OpenSend(4, (1,)), 0) == [AdmissionRefused(4, "fatal: this rank is fail-stopping")]


@pytest.mark.timeout(10)
def test_clock_cannot_go_backwards() -> None:
    from kvown.core.errors import LocalProtocolError

    r = receiver()
    r.handle(Tick(), 10)
    with pytest.raises(LocalProtocolError):
        r.handle(Tick(), 9)
