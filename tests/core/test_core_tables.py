"""The receiver's table decides its states (issue 18 item 2): handlers compute effects, and
``ReceiverCore._rx_guard`` picks the next state among a cell's states from the evidence.

Checked here: after every step of the ledger's Hypothesis machine the stored state is the one the
evidence implies (an oracle written in this file, not the guard), and two planted guard bugs are
caught by their check, each on a fixed sequence of the same machine's rules. Every (state, input) pair of each table: tests/core/test_totality.py.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant
from test_receiver_stateful import Ledger

from kvown.core.actions import Outcome
from kvown.core.messages import ResultStatus
from kvown.core.receiver import ReceiverCore, RxState

SETTINGS = settings(max_examples=100, stateful_step_count=30, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def implied_state(s) -> RxState:
    """What the evidence says the session is, read off its fields alone."""
    if s.outcome is None:
        return RxState.ACTIVE
    if s.outcome is Outcome.COMPLETED and not s.released:
        return RxState.DELIVERED
    return RxState.DRAINING


class LedgerStates(Ledger):
    @invariant()
    def state_follows_evidence(self) -> None:
        if not hasattr(self, "r"):
            return
        for s in self.r.sessions.values():
            if s.state is RxState.FATAL:
                assert self.r.fatal is not None, "a FATAL session on a rank that is not fatal"
            else:
                assert s.state is implied_state(s), f"state {s.state} but the evidence says {implied_state(s)}"


LedgerStates.TestCase.settings = SETTINGS
TestLedgerStates = pytest.mark.timeout(60)(LedgerStates.TestCase)


@pytest.mark.interpreted_only
@pytest.mark.timeout(60)
def test_the_retirement_check_catches_a_guard_that_ignores_claims(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the guard retires whenever the outcome allows it, unsettled writers or not."""
    real = ReceiverCore._rx_guard

    def careless(s, to):
        if RxState.RETIRED in to and s.outcome is not None:
            return RxState.RETIRED
        return real(s, to)

    monkeypatch.setattr(ReceiverCore, "_rx_guard", staticmethod(careless))
    ledger = LedgerStates()  # a cancel while the writer may still write
    ledger.open(n=1, slices=1)
    with pytest.raises(AssertionError, match="INV-R1: retired while writers"):
        ledger.cancel()


@pytest.mark.interpreted_only
@pytest.mark.timeout(60)
def test_the_state_check_catches_a_guard_that_never_delivers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: a completed, unreleased session is put in DRAINING (the consumer would never be told)."""
    real = ReceiverCore._rx_guard

    def no_delivered(s, to):
        got = real(s, to)
        return RxState.DRAINING if got is RxState.DELIVERED else got

    monkeypatch.setattr(ReceiverCore, "_rx_guard", staticmethod(no_delivered))
    ledger = LedgerStates()  # one writer delivers both pieces: COMPLETED, not released
    ledger.open(n=1, slices=1)
    ledger.report(w=1, status=ResultStatus.SUCCESS)
    ledger.state_follows_evidence()  # first piece: still ACTIVE, right under the mutant too
    ledger.report(w=1, status=ResultStatus.SUCCESS)
    with pytest.raises(AssertionError, match="the evidence says"):
        ledger.state_follows_evidence()
