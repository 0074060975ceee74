"""Deliberately broken code: each mutant patches one guard of the real production code (cores, streams,
driver, pool), and the simulator must catch it - by the oracle class it breaks - within the seed budget;
every oracle class is named by at least one mutant.
The seed that catches a mutant must run clean without it, and mutant state lives in the world it
patched, so a seed replays identically. A mutant that survives means an oracle or the workload has a
blind spot."""

from __future__ import annotations

import heapq

import pytest

from kvown.core.actions import Outcome
from kvown.core.deadline import RetirementClock
from kvown.adapters.transport import KVTransport
from kvown.core.errors import AdapterError, InvariantViolation
from kvown.cache.pool import BlockState, KVPool
from kvown.core.fence import CancellationFence, CancelOrigin, _SeqTable
from kvown.core.ids import split_request_id
from kvown.core.machine import RankCore
from kvown.core.events import MessageReceived
from kvown.core.messages import Envelope, ResultStatus, SessionQuiesced
from kvown.core.receiver import ReceiverCore, ReceiveSession, _Writer
from kvown.core.routing import Delivery, Router
from kvown.core import receiver as receiver_module
from kvown.core.sender import SenderCore, _Stream
from kvown.core.streams import InboundStreams
from kvown.runtime.resend import ResendQueue
from kvown.testing import oracles as oracles_module
from kvown.testing.oracles import Oracle
from kvown.testing.sim import SimWorld

SEED_BUDGET = 1000  # every mutant must die within the CI budget


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
            event = type(event)(event.envelope.replace(src_rank=m.writer_rank))
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
    """The legacy behaviour: a fence is forgotten after the first lookup that found it (per fence)."""
    original = CancellationFence.is_fenced

    def once(self, request_id):
        consumed = _SIDE.setdefault(id(self), (self, set()))[1]  # per fence, so per world
        if request_id in consumed:
            return False
        hit = original(self, request_id)
        if hit:
            consumed.add(request_id)
        return hit

    mp.setattr(CancellationFence, "is_fenced", once)


_SIDE: dict[int, tuple[object, set[int]]] = {}  # fence -> consumed ids; holds the fence so ids never repeat


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


def driver_forgets_a_failed_send(mp: pytest.MonkeyPatch) -> None:
    """Defects 1 and 2: a control frame whose send raised is given up (it may never have left), leaving a
    hole in the stream that stalls every later frame until a deadline."""

    def forget(self, dst, pending, exc: AdapterError) -> None:
        pending.frames.popleft()

    mp.setattr(ResendQueue, "_note_failure", forget)


def decline_claims_the_slice(mp: pytest.MonkeyPatch) -> None:
    """Defect 5: a broadcast candidate's honest FAILED (a decline) claims the slice like a write would."""
    mp.setattr(receiver_module, "TOUCHING", frozenset(ResultStatus))


def local_copy_inherits_the_request_deadline(mp: pytest.MonkeyPatch) -> None:
    """Defect 6: a local copy gets no clock of its own; its claim rides on the session's old deadline."""

    def old_deadline(self, s):
        return s.clock.fatal_deadline_ns if s.has_claims() else None

    mp.setattr(ReceiverCore, "_fatal_deadline_ns", old_deadline)


def every_report_rides_its_write(mp: pytest.MonkeyPatch) -> None:
    """Carried results (sender rule 6) on multi-operation streams too: a carried report can overtake an
    earlier one, and each claims to be the stream's last."""
    mp.setattr(SenderCore, "_carries", lambda self, s, op: self.carry_results)


def late_carried_report_disputed(mp: pytest.MonkeyPatch) -> None:
    """Receiver rule 4a forgotten: a carried report that arrives after its writer's ack (a cancel of a
    finished send is acked at once, and NIXL orders the WRITE's notification against nothing) is taken
    for a result after the end of the stream, and honest evidence is disputed."""
    mp.setattr(ReceiverCore, "_stale_carried", lambda self, message: False)


def carried_copies_counted_twice(mp: pytest.MonkeyPatch) -> None:
    """The receiver's driver hands every copy of a carried report to the core (no duplicate check)."""

    def carried(self, src, message, index):
        return Delivery(MessageReceived(Envelope(src, self.rank, 0, message), carried=True), index,
                        (self.receiver,))

    mp.setattr(Router, "_carried", carried)


def complete_before_every_piece_reported(mp: pytest.MonkeyPatch) -> None:
    """The receiver calls a session delivered once each slice's writer reported one piece, not all."""

    def complete(s: ReceiveSession) -> bool:
        return len(s.cohort) >= s.num_slices and not any(s.writers[r].failed for r in s.cohort.values())

    mp.setattr(ReceiverCore, "_complete", staticmethod(complete))


def coalesced_transfer_writes_only_its_first_session(mp: pytest.MonkeyPatch) -> None:
    """A coalesced transfer (driver rule 3a) writes the first session's blocks only, yet its notification
    carries every session's report."""
    original = KVTransport._post
    mp.setattr(KVTransport, "_post",
               lambda self, peer, actions, slot, notif: original(self, peer, actions[:1], slot, notif))


def install_forgets_the_epochs_fences(mp: pytest.MonkeyPatch) -> None:
    """Fencing an id starts a new table for its epoch: the epoch's earlier fences vanish (raw tables)."""

    def install(self, request_id, origin):
        epoch, seq = split_request_id(request_id)
        table = self._tables[epoch] = _SeqTable()
        return CancelOrigin(table.add(seq, int(origin)))

    mp.setattr(CancellationFence, "install", install)


def engine_leaves_the_kill_to_the_watchdog(mp: pytest.MonkeyPatch) -> None:
    """The core's clock applies timeouts but never fail-stops at a fatal deadline, so only the watchdog
    thread's ``check_fatal`` would: a daemon thread as the only road to the kill."""

    def advance(self, now_ns, actions):
        due = []
        while self._deadlines and self._deadlines[0][0] <= now_ns:
            due.append(heapq.heappop(self._deadlines))
            self._queued.discard(due[-1])
        for _, request_id in due:
            session = self.sessions.get(request_id)
            if session is not None:
                self._evaluate(request_id, session, now_ns, actions)
                if request_id in self.sessions:
                    self._schedule(request_id, session)

    mp.setattr(RankCore, "_advance", advance)


def hold_keeps_counting_owned(mp: pytest.MonkeyPatch) -> None:
    """OWNED -> HELD forgets to take the blocks off the owned counter (the pool's own check trips)."""

    def hold(self, blocks):
        blocks = self._validated(blocks, allowed={BlockState.OWNED}, owner=None)
        for block in blocks:
            self._state[block] = BlockState.HELD
        self._num_held += len(blocks)
        self.check()

    mp.setattr(KVPool, "hold", hold)


def hold_keeps_counting_owned_unchecked(mp: pytest.MonkeyPatch) -> None:
    """The same miscount with the pool's own check gone: the oracle must see it on its own."""
    hold_keeps_counting_owned(mp)
    mp.setattr(KVPool, "check", lambda self, deep=False: None)


def retire_leaks_the_last_block(mp: pytest.MonkeyPatch) -> None:
    """Retirement gives back every block of a request but the last, which no session holds any more."""
    original = KVPool.retire
    mp.setattr(KVPool, "retire", lambda self, blocks, owner: original(self, tuple(blocks)[:-1] or tuple(blocks), owner))


MUTANTS = [  # (mutant, the oracle class(es) that must catch it; each oracle's tag is in its class)
    (retire_on_cancel_without_ack, "RetirementProof"),
    # an early ack either lets the receiver retire under a live WRITE (a), or the result that follows the
    # ack on the stream exposes the lie and the receiver disputes it (c): both are this mutant's footprint
    (ack_before_in_flight_write_done, ("RetirementProof", "EvidenceOnce")),
    # a forged ack settles the named writer early: the receiver retires under that writer's WRITE (a), or,
    # when the writer's report rides on its WRITE and lands after the forged ack, disputes it (c)
    (ack_from_unpublished_writer, ("RetirementProof", "EvidenceOnce")),
    (resettable_deadline, "SessionBounds"),
    (fence_consumed_once, "SessionBounds"),  # (d): a session for a fenced id not born cancelled
    (first_failure_retires_despite_active_sibling, "RetirementProof"),
    (post_before_source_ready, "WritesAfterReady"),
    (streams_redeliver_duplicates, "EvidenceOnce"),
    (in_doubt_settles_on_ack, "RetirementProof"),
    (driver_forgets_a_failed_send, "NoStreamHoles"),
    (decline_claims_the_slice, "EvidenceOnce"),
    (local_copy_inherits_the_request_deadline, "SessionBounds"),
    (every_report_rides_its_write, ("RetirementProof", "EvidenceOnce")),
    (late_carried_report_disputed, "EvidenceOnce"),
    (carried_copies_counted_twice, "EvidenceOnce"),
    (complete_before_every_piece_reported, "LandedBytes"),  # the consumer reads unlanded blocks
    (coalesced_transfer_writes_only_its_first_session, "LandedBytes"),
    (install_forgets_the_epochs_fences, "FencesNeverReopen"),
    (engine_leaves_the_kill_to_the_watchdog, "WatchdogAgrees"),
    (hold_keeps_counting_owned, "NoInvariantFailStop"),
    (hold_keeps_counting_owned_unchecked, "PoolAccounting"),
    (retire_leaks_the_last_block, "EndState"),
]


def _first_caught(budget: int = SEED_BUDGET) -> tuple[int, InvariantViolation]:
    for seed in range(budget):
        try:
            SimWorld(seed).run()
        except InvariantViolation as e:
            return seed, e
    pytest.fail(f"mutant survived {budget} seeds")


@pytest.mark.sim
@pytest.mark.timeout(600)
@pytest.mark.interpreted_only
@pytest.mark.parametrize(("mutant", "oracles"), MUTANTS, ids=[m.__name__ for m, _ in MUTANTS])
def test_simulator_catches_mutant(mutant, oracles, monkeypatch: pytest.MonkeyPatch) -> None:
    mutant(monkeypatch)
    seed, error = _first_caught()
    _SIDE.clear()
    assert error.seed == seed and f"seed={seed}" in str(error)  # the report names the seed to replay
    assert error.oracle in oracles, f"caught by the wrong oracle ({error.oracle}, not {oracles}): {str(error)[:400]}"
    monkeypatch.undo()
    SimWorld(seed).run()  # the catching seed is clean without the mutant


def test_every_oracle_has_a_mutant() -> None:
    """A check that no mutant trips is a check nobody has seen fail."""
    named = {o for _, oracles in MUTANTS for o in ((oracles,) if isinstance(oracles, str) else oracles)}
    classes = {c.__name__ for c in vars(oracles_module).values()
               if isinstance(c, type) and issubclass(c, Oracle) and c is not Oracle}
    assert classes <= named, f"oracles without a mutant: {sorted(classes - named)}"


@pytest.mark.sim
@pytest.mark.timeout(60)
def test_unmutated_code_passes_the_first_seeds() -> None:
    """The control: without a mutant the same seeds are clean."""
    for seed in range(20):
        SimWorld(seed).run()
