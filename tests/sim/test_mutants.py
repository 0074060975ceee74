"""Deliberately broken cores: each mutant patches one named guard of the real core classes, and the
simulator must catch it (InvariantViolation, which includes detected corruption) within the CI seed
budget. A mutant that survives means the simulator's oracles or workloads have a blind spot."""

from __future__ import annotations

import pytest

from kvown.core.actions import Outcome
from kvown.core.deadline import RetirementClock
from kvown.core.errors import InvariantViolation
from kvown.core.fence import CancellationFence
from kvown.core.messages import SessionQuiesced
from kvown.core.receiver import ReceiverCore, ReceiveSession, _Writer
from kvown.core.sender import SenderCore, _Stream
from kvown.core.streams import InboundStreams
from kvown.testing.sim import SimWorld

SEED_BUDGET = 200  # the CI budget: every mutant must die within it


def _first_caught(budget: int = SEED_BUDGET) -> tuple[int, InvariantViolation]:
    for seed in range(budget):
        try:
            SimWorld(seed).run()
        except InvariantViolation as e:
            return seed, e
    pytest.fail(f"mutant survived {budget} seeds")


def retire_on_cancel_without_ack(mp: pytest.MonkeyPatch) -> None:
    """A writer counts as settled once CANCEL_SESSION was sent to it, without its ack."""
    mp.setattr(_Writer, "settled", property(lambda w: (w.stream_ended or w.acked or w.cancel_sent) and not w.in_doubt))


def ack_before_in_flight_write_done(mp: pytest.MonkeyPatch) -> None:
    """The sender's quiescence guard ignores operations still in flight."""
    mp.setattr(_Stream, "quiescent", lambda st: True)


def ack_from_unpublished_writer(mp: pytest.MonkeyPatch) -> None:
    """The receiver trusts the writer named in SESSION_QUIESCED instead of the stream it came on."""
    original = ReceiverCore._dispatch

    def trusting(self, event, now_ns, actions):
        m = getattr(getattr(event, "envelope", None), "message", None)
        if isinstance(m, SessionQuiesced) and m.writer_rank != event.envelope.src_rank:
            from dataclasses import replace

            event = type(event)(replace(event.envelope, src_rank=m.writer_rank))
        return original(self, event, now_ns, actions)

    mp.setattr(ReceiverCore, "_dispatch", trusting)


def resettable_deadline(mp: pytest.MonkeyPatch) -> None:
    """A second drain trigger restarts the drain (extends the fatal deadline)."""
    original = RetirementClock.start_drain

    def restart(self, now_ns, reason):
        self.drain_started_ns = None
        return original(self, now_ns, reason)

    mp.setattr(RetirementClock, "start_drain", restart)


def fence_consumed_once(mp: pytest.MonkeyPatch) -> None:
    """The legacy behaviour: a fence is forgotten after the first lookup that found it."""
    original = CancellationFence.is_fenced
    consumed: set[tuple[int, int]] = set()

    def once(self, request_id):
        key = (id(self), request_id)
        if key in consumed:
            return False
        hit = original(self, request_id)
        if hit:
            consumed.add(key)
        return hit

    mp.setattr(CancellationFence, "is_fenced", once)


def first_failure_retires_despite_active_sibling(mp: pytest.MonkeyPatch) -> None:
    """Once a writer reported FAILED, the session no longer waits for its siblings."""
    original = ReceiveSession.has_claims

    def lenient(self):
        if self.outcome is Outcome.FAILED and any(w.failed and not w.in_doubt for w in self.writers.values()):
            return bool(self.local_pending or self.disputed)
        return original(self)

    mp.setattr(ReceiveSession, "has_claims", lenient)


def post_before_source_ready(mp: pytest.MonkeyPatch) -> None:
    """The write-ready gate is skipped: a WRITE may read KV that is not written yet."""
    mp.setattr(SenderCore, "_source_ready", lambda self, s, op: True)


def streams_redeliver_duplicates(mp: pytest.MonkeyPatch) -> None:
    """The inbound stream hands a duplicate of an already-delivered frame to the core again."""
    original = InboundStreams.deliver

    def leaky(self, envelope):
        if envelope.seq < self._expected.get(envelope.src_rank, 0):
            return [envelope]
        return original(self, envelope)

    mp.setattr(InboundStreams, "deliver", leaky)


def in_doubt_settles_on_ack(mp: pytest.MonkeyPatch) -> None:
    """An ack is taken to settle an in-doubt piece too."""
    mp.setattr(_Writer, "settled", property(lambda w: w.stream_ended or w.acked))


MUTANTS = [
    retire_on_cancel_without_ack,
    ack_before_in_flight_write_done,
    ack_from_unpublished_writer,
    resettable_deadline,
    fence_consumed_once,
    first_failure_retires_despite_active_sibling,
    post_before_source_ready,
    streams_redeliver_duplicates,
    in_doubt_settles_on_ack,
]


@pytest.mark.sim
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.__name__ for m in MUTANTS])
def test_simulator_catches_mutant(mutant, monkeypatch: pytest.MonkeyPatch) -> None:
    mutant(monkeypatch)
    seed, error = _first_caught()
    assert error.seed == seed
    assert f"seed={seed}" in str(error)  # the report names the seed to replay


@pytest.mark.sim
@pytest.mark.timeout(30)
def test_unmutated_core_passes_the_first_seeds() -> None:
    """The control: without a mutant the same seeds are clean."""
    for seed in range(20):
        SimWorld(seed).run()
