"""Hypothesis state machine over the receiver ledger: honest and hostile writers, cancels, releases and
time, with the safety invariants checked after every step.

The model keeps, per writer, what an honest sender would know: whether it may still write into the
destination (until its stream ended or it acked, and no piece is in doubt). Hostile rules replay a
result or send one for an already-claimed slice; the ledger must then never retire that destination.
"""

from __future__ import annotations

import pytest
from corekit import RX, msg, receiver
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvown.core.actions import Conclude, Disputed, FailStop, RetireBlocks, SendControl
from kvown.core.events import CancelRequested, OpenReceive, ReleaseRequested, Tick
from kvown.core.messages import CancelSession, KvResult, ResultStatus, SessionQuiesced

WRITERS = (1, 2, 3, 4)
PIECES = 2


class Writer:
    def __init__(self) -> None:
        self.next_piece = 0
        self.in_doubt: set[int] = set()
        self.ended = False
        self.acked = False
        self.asked = False  # CANCEL_SESSION seen
        self.seq = 0
        self.sent: list[KvResult] = []

    def may_write(self) -> bool:
        return not (self.ended or self.acked) or bool(self.in_doubt)


class Ledger(RuleBasedStateMachine):
    @initialize(n=st.sampled_from([1, 2, 4]), slices=st.sampled_from([1, 2]))
    def open(self, n: int, slices: int) -> None:
        slices = min(slices, n) if n % min(slices, n) == 0 else 1
        self.r = receiver(timeout=1000, grace=500)
        self.now = 0
        self.writers = {w: Writer() for w in WRITERS[:n]}
        self.disputed = False
        self.retired = self.fatal = False
        self.concludes = 0
        self.run(OpenReceive(1, (0, 1), tuple(self.writers), slices))

    def run(self, event) -> None:
        out = self.r.handle(event, self.now)
        for a in out:
            if isinstance(a, RetireBlocks):
                assert not self.fatal, "INV-R4: retired after FailStop"
                assert not self.disputed, "INV-R1: a disputed destination retired"
                busy = [w for w, m in self.writers.items() if m.may_write()]
                assert not busy, f"INV-R1: retired while writers {busy} may still write"
                self.retired = True
            elif isinstance(a, FailStop):
                self.fatal = True
            elif isinstance(a, Conclude):
                self.concludes += 1
            elif isinstance(a, SendControl) and isinstance(a.message, CancelSession):
                assert not self.writers[a.dst_rank].asked, "CANCEL_SESSION sent twice to one writer"
                self.writers[a.dst_rank].asked = True

    def deliver(self, w: int, message) -> None:
        self.writers[w].seq += 1
        self.run(msg(w, RX, message, self.writers[w].seq))

    @precondition(lambda self: not self.retired)
    @rule(w=st.sampled_from(WRITERS), status=st.sampled_from([ResultStatus.SUCCESS] * 3 + [ResultStatus.FAILED, ResultStatus.IN_DOUBT]))
    def report(self, w: int, status: ResultStatus) -> None:
        m = self.writers.get(w)
        if m is None or m.ended or m.acked:
            return
        piece = m.next_piece
        last = piece == PIECES - 1 or status is ResultStatus.FAILED
        m.next_piece += 1
        m.ended = last
        if status is ResultStatus.IN_DOUBT:
            m.in_doubt.add(piece)
        result = KvResult(w, 1, piece, last, status, 0)
        m.sent.append(result)
        self.deliver(w, result)

    @rule(w=st.sampled_from(WRITERS))
    def late_settlement(self, w: int) -> None:
        m = self.writers.get(w)
        if m is None or not m.in_doubt:
            return
        piece = m.in_doubt.pop()
        self.deliver(w, KvResult(w, 1, piece, False, ResultStatus.FAILED_QUIESCED, 0))

    @rule(w=st.sampled_from(WRITERS))
    def ack(self, w: int) -> None:
        m = self.writers.get(w)
        if m is None or not m.asked or m.acked or m.in_doubt:
            return
        m.acked = True
        self.deliver(w, SessionQuiesced(w, 1))

    @rule(w=st.sampled_from(WRITERS))
    def ack_while_in_doubt(self, w: int) -> None:
        """A writer acks although a piece is still in doubt: the ack must not settle that piece."""
        m = self.writers.get(w)
        if m is None or not m.asked or m.acked or not m.in_doubt:
            return
        m.acked = True  # may_write() stays True while in_doubt is non-empty
        self.deliver(w, SessionQuiesced(w, 1))

    @rule()
    def cancel(self) -> None:
        self.run(CancelRequested(1))

    @rule()
    def release(self) -> None:
        if 1 in self.r.sessions and self.r.sessions[1].outcome is not None:
            if self.r.sessions[1].outcome.value == "completed":
                self.run(ReleaseRequested(1))

    @rule(dt=st.integers(1, 700))
    def tick(self, dt: int) -> None:
        """check_fatal (what the watchdog asks) and handle(Tick) (what the engine does) agree."""
        self.now += dt
        predicted = self.r.check_fatal(self.now)
        was_fatal = self.fatal
        self.run(Tick())
        assert (predicted is not None) == (self.fatal or was_fatal), "check_fatal and handle(Tick) disagree"

    @rule(w=st.sampled_from(WRITERS))
    def hostile_replay(self, w: int) -> None:
        m = self.writers.get(w)
        if m is None or not m.sent or self.retired or self.fatal:
            return
        self.disputed = True  # a second result for the same piece is invalid evidence
        self.deliver(w, m.sent[0])

    @rule()
    def foreign_ack(self) -> None:
        if self.retired or self.fatal or len(self.writers) == len(WRITERS):
            return
        outsider = WRITERS[-1]
        out = self.r.handle(msg(outsider, RX, SessionQuiesced(outsider, 1)), self.now)
        # quarantine is the answer (receiver rule 3): an action, not an exception after mutation
        assert any(isinstance(a, Disputed) for a in out) or self.r.fatal is not None

    @invariant()
    def ledger_is_consistent(self) -> None:
        if not hasattr(self, "r"):
            return
        assert self.concludes <= 1, "INV-R2: outcome committed twice"
        s = self.r.sessions.get(1)
        if s is not None and not self.fatal:
            for w, m in self.writers.items():
                if w in s.writers:
                    counted = len(s.writers[w].results)
                    assert counted <= PIECES, "INV-R3: a piece counted twice"
            deadline = self.r.nearest_fail_stop_ns()
            if s.has_claims():
                assert deadline is not None, "an open claim without a fail-stop deadline"
                assert self.now < deadline, "a claim outlived its fatal deadline without a FailStop"
        if self.retired:
            assert 1 not in self.r.sessions


Ledger.TestCase.settings = settings(
    max_examples=400, stateful_step_count=30, derandomize=True, database=None, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLedger = pytest.mark.timeout(60)(Ledger.TestCase)
