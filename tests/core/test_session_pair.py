"""Real SenderCores and a real ReceiverCore joined in memory (h11's ConnectionPair idea).

Control messages go through real Outbound/Inbound streams in FIFO order when ``flush()`` is called;
writes are completed only when a test says so, so every interleaving below is explicit. The scenarios
follow trtllm.md section 15 (session ack, deadline, ownership regressions, fences) in our API.
"""

from __future__ import annotations

import heapq

import pytest
from corekit import RX, G, T, receiver, sender

from kvown.core.actions import (
    AdmissionRefused,
    Conclude,
    Deliver,
    Disputed,
    FailStop,
    Outcome,
    PostWrite,
    ReleaseSource,
    RetireBlocks,
    SendControl,
)
from kvown.core.errors import PeerProtocolError
from kvown.core.events import (
    CancelRequested,
    LocalCompletionDone,
    LocalCompletionPending,
    MessageReceived,
    OpenReceive,
    OpenSend,
    ReleaseRequested,
    SourceReady,
    Tick,
    WatermarkSet,
    WriteCompleted,
    WriteFailed,
    WriteSubmitted,
)
from kvown.core.fence import CancelOrigin
from kvown.core.ids import make_request_id
from kvown.core.machine import CoreConfig, RankCore
from kvown.core.messages import AuxResult, Envelope, KvResult, ResultStatus, SessionQuiesced
from kvown.core.receiver import ReceiverCore
from kvown.core.sender import SenderCore
from kvown.core.streams import InboundStreams, OutboundStreams

S, F, D, Q = ResultStatus.SUCCESS, ResultStatus.FAILED, ResultStatus.IN_DOUBT, ResultStatus.FAILED_QUIESCED


class Pair:
    """One receiver (rank RX) and writers 1..n, joined by an in-memory, in-order control link."""

    def __init__(self, writers=(1,), timeout: int = T, grace: int = G, carry: bool = True) -> None:
        self.rx = receiver(timeout=timeout, grace=grace)
        self.tx = {w: sender(w, timeout=timeout, grace=grace, carry=carry) for w in writers}
        self.cores = {RX: self.rx, **self.tx}
        self.out = {r: OutboundStreams(r) for r in self.cores}
        self.inb = {r: InboundStreams(r) for r in self.cores}
        self.wire: list = []  # envelopes not yet delivered, FIFO
        self.seen: dict[int, list] = {r: [] for r in self.cores}  # messages each rank received
        self.actions: dict[int, list] = {r: [] for r in self.cores}
        self.posts: dict[int, list[PostWrite]] = {w: [] for w in writers}
        self.now = 0

    def do(self, rank: int, event, at: int | None = None) -> list:
        self.now = self.now if at is None else at
        acts = self.cores[rank].handle(event, self.now)
        self.actions[rank] += acts
        for a in acts:
            if isinstance(a, SendControl):
                self.wire.append(self.out[rank].stamp(a.dst_rank, a.message))
            elif isinstance(a, PostWrite):
                self.posts[rank].append(a)
        return acts

    def flush(self, only_to: int | None = None) -> None:
        for _ in range(1000):  # bounded: a protocol exchange is a handful of messages
            pending = [e for e in self.wire if only_to is None or e.dst_rank == only_to]
            if not pending:
                return
            env = pending[0]
            self.wire.remove(env)
            for e in self.inb[env.dst_rank].deliver(env):
                self.seen[e.dst_rank].append(e.message)
                self.do(e.dst_rank, MessageReceived(e))
        raise AssertionError("control exchange did not converge")

    def open(self, rid=1, blocks=(10, 11), writers=None, slices=1, aux=-1):
        writers = tuple(self.tx) if writers is None else writers
        return self.do(RX, OpenReceive(rid, blocks, writers, slices, aux))

    def send(self, w: int, rid=1, nblocks=2, pieces=1, ready=True):
        self.do(w, OpenSend(rid, tuple(range(nblocks)), pieces))
        if ready:
            for p in range(pieces):
                self.do(w, SourceReady(rid, p))

    def submit_all(self, w: int) -> None:
        for p in self.posts[w]:
            if self.tx[w]._ops.get(p.op_id) and self.tx[w]._ops[p.op_id][2].state.value == "submitting":
                self.do(w, WriteSubmitted(p.op_id))

    def complete_all(self, w: int) -> None:
        self.submit_all(w)
        for p in self.posts[w]:
            entry = self.tx[w]._ops.get(p.op_id)
            if entry and entry[2].state.value in ("submitted", "in_doubt"):
                self.complete(w, p)

    def complete(self, w: int, post: PostWrite) -> None:
        """The backend reports DONE for ``post``; a carried report arrives with the data."""
        entry = self.tx[w]._ops.get(post.op_id)
        self.do(w, WriteCompleted(post.op_id))
        if entry is not None and entry[2].delivered_by_write:  # NIXL delivers the carried report
            self.carried(w, post)

    def carried(self, w: int, post: PostWrite) -> None:
        """The WRITE's notification (sender rule 6) reaches the receiver: outside the ordered streams."""
        self.seen[RX].append(post.result)
        self.do(RX, MessageReceived(Envelope(w, RX, 0, post.result)))

    def retired(self, rid=1) -> bool:
        return RetireBlocks(rid) in self.actions[RX]

    def from_writer(self, w: int) -> list:
        """What the receiver got from writer w: result statuses and 'ACK'."""
        out = []
        for m in self.seen[RX]:
            if isinstance(m, (KvResult, AuxResult)) and m.writer_rank == w:
                out.append(m.status)
            elif isinstance(m, SessionQuiesced) and m.writer_rank == w:
                out.append("ACK")
        return out


T10 = pytest.mark.timeout(10)


@T10
def test_happy_path_gen_first_with_aux() -> None:
    p = Pair()
    p.open(aux=3)
    p.flush()
    p.send(1, pieces=2)
    assert [(a.kind.value, a.piece) for a in p.posts[1]] == [("kv", 0), ("kv", 1), ("aux", 2)]
    p.complete_all(1)
    p.flush()
    assert p.from_writer(1) == [S, S, S]
    assert Deliver(1) in p.actions[RX] and not p.retired()
    p.do(RX, ReleaseRequested(1))
    assert p.retired() and ReleaseSource(1) in p.actions[1]
    assert not p.rx.sessions and not p.tx[1].sessions


@T10
def test_context_first_attaches_when_the_publication_arrives() -> None:
    p = Pair()
    p.send(1)  # nothing to post yet: no destination
    assert p.posts[1] == []
    p.open()
    p.flush()
    assert len(p.posts[1]) == 1
    p.complete_all(1)
    p.flush()
    p.do(RX, ReleaseRequested(1))
    assert p.retired()


@T10
def test_cancel_before_publication_publishes_nothing_and_retires_at_once() -> None:
    p = Pair()
    p.do(RX, CancelRequested(1))
    acts = p.do(RX, OpenReceive(1, (1,), (1,)))
    assert acts == [Conclude(1, Outcome.CANCELLED, "fenced before publication"), RetireBlocks(1)]
    assert p.wire == []


@T10
def test_cancel_mid_transfer_holds_until_the_write_is_done() -> None:
    p = Pair()
    p.open()
    p.flush()
    p.send(1)
    p.submit_all(1)
    p.do(RX, CancelRequested(1))
    p.flush()
    assert not p.retired() and p.from_writer(1) == []  # no ack while the write is in flight
    assert p.tx[1].may_write(1, RX)
    p.complete(1, p.posts[1][0])
    p.flush()
    # the report rode on the WRITE (sender rule 6): with is_last it settles the writer, no ack follows
    assert p.from_writer(1) == [S] and p.retired()
    assert p.rx.fence.is_fenced(1) and p.tx[1].fence.is_fenced(1)


@T10
def test_cancel_mid_transfer_without_carried_results_acks_after_the_result() -> None:
    p = Pair(carry=False)
    p.open()
    p.flush()
    p.send(1)
    p.submit_all(1)
    assert p.posts[1][0].result is None
    p.do(RX, CancelRequested(1))
    p.flush()
    assert not p.retired() and p.from_writer(1) == []
    p.complete(1, p.posts[1][0])
    p.flush()
    assert p.from_writer(1) == [S, "ACK"] and p.retired()


@T10
def test_only_a_single_operation_stream_carries_its_report() -> None:
    p = Pair()
    p.open(aux=3)  # KV piece + AUX piece: two operations on the stream
    p.flush()
    p.send(1)
    assert [post.result for post in p.posts[1]] == [None, None]
    q = Pair()
    q.open()
    q.flush()
    q.send(1)
    (post,) = q.posts[1]
    assert post.result == KvResult(1, 1, 0, True, S, 0)
    q.complete_all(1)
    q.flush()
    assert Deliver(1) in q.actions[RX] and q.from_writer(1) == [S]
    assert not any(isinstance(a, SendControl) for a in q.actions[1])  # nothing on the control stream


@T10
def test_a_carried_write_that_goes_in_doubt_reports_on_the_control_stream() -> None:
    p = Pair()
    p.open()
    p.flush()
    p.send(1)
    p.submit_all(1)
    p.do(1, WriteFailed(p.posts[1][0].op_id, "ERR"))  # NIXL never sends the notification now
    p.do(1, WriteCompleted(p.posts[1][0].op_id))  # late DONE: still no notification
    p.flush()
    assert p.from_writer(1) == [D, Q, "ACK"] and p.retired()  # as for an uncarried write


@T10
def test_cancel_before_the_sender_has_a_session_acks_at_once_and_fences() -> None:
    p = Pair()
    p.open()
    p.flush()  # REQUEST_DATA is saved at the writer
    assert p.tx[1].may_write(1, RX)
    p.do(RX, CancelRequested(1))
    p.flush()
    assert p.from_writer(1) == ["ACK"] and p.retired() and not p.tx[1].may_write(1, RX)
    acts = p.do(1, OpenSend(1, (0, 1)))  # the late session is born cancelled
    assert acts == [Conclude(1, Outcome.CANCELLED, "fenced before the session opened"), ReleaseSource(1)]
    assert p.do(1, SourceReady(1, 0)) == [] and p.posts[1] == []


@T10
def test_fan_in_with_one_writer_cancelled_midway_waits_for_the_sibling() -> None:
    p = Pair(writers=(1, 2))
    p.open(slices=2)
    p.flush()
    p.send(1)
    p.send(2, ready=False)
    p.submit_all(1)
    p.do(2, CancelRequested(1))  # writer 2's server cancels: its op was never posted
    p.flush()
    assert p.from_writer(2) == [F]
    assert p.rx.sessions[1].outcome is Outcome.FAILED and not p.retired()  # writer 1 still writing
    p.complete_all(1)
    p.flush()
    assert p.from_writer(1) == [S] and p.retired()  # the carried is_last report settles writer 1


@T10
def test_broadcast_non_selected_candidates_must_ack() -> None:
    p = Pair(writers=(1, 2, 3, 4))
    p.open(slices=2)  # writer i owns slice i % 2; the group (3, 4) delivers
    p.flush()
    for w in (3, 4):
        p.send(w)
        p.complete_all(w)
    p.flush()
    assert Deliver(1) in p.actions[RX]
    assert p.from_writer(1) == ["ACK"] and p.from_writer(2) == ["ACK"]
    p.do(RX, ReleaseRequested(1))
    assert p.retired()


@T10
def test_broadcast_candidate_acks_do_not_complete_and_missing_ack_is_fatal() -> None:
    p = Pair(writers=(1, 2, 3, 4))
    p.open(slices=2)
    p.flush(only_to=1)
    p.flush(only_to=2)
    p.flush(only_to=3)  # writer 4 never gets its REQUEST_DATA (its link is stuck)
    p.send(3)
    p.complete_all(3)
    p.flush(only_to=RX)
    assert Deliver(1) not in p.actions[RX]  # one slice of two: not complete
    p.do(RX, Tick(), at=T)
    p.flush(only_to=RX)
    p.flush(only_to=1)
    p.flush(only_to=2)
    p.flush(only_to=3)
    p.flush(only_to=RX)
    assert not p.retired()
    out = p.do(RX, Tick(), at=T + G)
    assert isinstance(out[0], FailStop) and "writer 4" in out[0].detail
    p.flush()  # the late ack cannot reverse the fatal
    assert not p.retired() and p.rx.fatal is out[0]


@T10
def test_in_doubt_then_failed_quiesced_then_ack_in_that_order() -> None:
    p = Pair()
    p.open()
    p.flush()
    p.send(1)
    p.submit_all(1)
    op = p.posts[1][0].op_id
    p.do(1, WriteFailed(op, "nic"))
    p.flush()
    assert p.rx.quarantined and p.rx.sessions[1].outcome is Outcome.FAILED and not p.retired()
    assert ReleaseSource(1) not in p.actions[1]  # the in-doubt handle keeps the source rooted
    p.do(1, WriteCompleted(op))  # late settlement on the same handle
    p.flush()
    assert p.from_writer(1) == [D, Q, "ACK"] and p.retired()
    assert ReleaseSource(1) in p.actions[1]
    refused = p.do(RX, OpenReceive(2, (1,), (1,)))
    assert len(refused) == 1 and isinstance(refused[0], AdmissionRefused)


@T10
def test_ack_cannot_bypass_in_doubt_or_pending_local_completion() -> None:
    p = Pair()
    p.open()
    p.do(RX, LocalCompletionPending(1, 77))
    p.flush()
    p.send(1)
    p.submit_all(1)
    p.do(1, WriteFailed(p.posts[1][0].op_id, "x"))
    p.flush()
    p.wire.append(p.out[1].stamp(RX, SessionQuiesced(1, 1)))  # an ack while the piece is in doubt
    p.flush()
    assert p.rx.sessions[1].writers[1].acked and not p.retired()
    p.do(1, WriteCompleted(p.posts[1][0].op_id))
    p.flush()
    assert not p.retired()  # the local copy is still pending
    p.do(RX, LocalCompletionDone(1, 77))
    assert p.retired()


@T10
def test_foreign_ack_disputes_as_an_action_and_unknown_and_unsolicited_acks_are_ignored() -> None:
    """Defect 14: invalid evidence used to raise PeerProtocolError after the dispute had already
    changed state. Now the dispute is the returned action, and the module header says so."""
    p = Pair(writers=(1, 2))
    p.open(writers=(1,))
    p.flush()
    out = p.do(RX, MessageReceived(p.out[2].stamp(RX, SessionQuiesced(2, 1))))
    assert [type(a) for a in out] == [Disputed] and out[0].request_id == 1
    assert p.rx.quarantined and not p.rx.sessions[1].disputed  # an ack claims nothing
    p.do(RX, MessageReceived(p.out[1].stamp(RX, SessionQuiesced(1, 99))))  # unknown request
    p.do(RX, MessageReceived(p.out[1].stamp(RX, SessionQuiesced(1, 1))))  # never asked
    assert p.rx.counters == {"foreign_acks": 1, "stale_acks": 1, "unsolicited_acks": 1}
    assert not p.rx.sessions[1].writers[1].acked


@T10
def test_a_publication_lost_on_the_wire_still_holds_the_destination() -> None:
    """Defect 1: a REQUEST_DATA whose send failed may still have been delivered, so its writer stays
    published: without its answer the blocks never retire, and the deadline fail-stops instead."""
    p = Pair(writers=(7, 8))
    p.open(writers=(7, 8), slices=2)
    p.wire = [e for e in p.wire if e.dst_rank != 8]  # lost (or delivered: nobody knows)
    p.do(RX, CancelRequested(1))
    p.flush()
    assert p.from_writer(7) == ["ACK"] and not p.retired()
    out = p.do(RX, Tick(), at=p.rx.next_deadline_ns())
    assert isinstance(out[0], FailStop) and "writer 8" in out[0].detail and not p.retired()


@T10
def test_cancels_go_once_and_after_the_request_data() -> None:
    p = Pair()
    p.do(RX, OpenReceive(1, (1,), (1,)))
    p.do(RX, CancelRequested(1))  # the cancel follows the REQUEST_DATA on the same stream
    p.do(RX, CancelRequested(1))
    p.do(RX, CancelRequested(1))
    kinds = [type(e.message).__name__ for e in p.wire]
    assert kinds == ["RequestData", "CancelSession"]
    assert [e.seq for e in p.wire] == [0, 1]


@T10
def test_failed_writer_cannot_authorise_reuse_while_sibling_is_active() -> None:
    p = Pair(writers=(1, 2))
    p.open(slices=2)
    p.flush()
    p.send(1)
    p.send(2)
    p.submit_all(1)
    p.submit_all(2)
    p.complete(1, p.posts[1][0])
    p.flush()
    assert p.from_writer(1) == [S]
    p.do(RX, CancelRequested(1))
    p.do(RX, CancelRequested(1))  # repeated cancel
    p.flush()
    assert not p.retired()  # writer 2 is still writing
    p.complete(2, p.posts[2][0])
    p.flush()
    assert p.actions[RX].count(RetireBlocks(1)) == 1


@T10
def test_non_terminal_success_does_not_authorise_reuse() -> None:
    p = Pair()
    p.open()
    p.flush()
    p.send(1, pieces=2, ready=False)
    p.do(1, SourceReady(1, 0))
    p.complete_all(1)
    p.flush()
    assert p.from_writer(1) == [S] and Deliver(1) not in p.actions[RX]
    p.do(1, SourceReady(1, 1))
    p.complete_all(1)
    p.flush()
    assert p.from_writer(1) == [S, S] and Deliver(1) in p.actions[RX]


@T10
def test_second_writer_for_a_claimed_slice_disputes_and_never_retires() -> None:
    p = Pair(writers=(1, 2))
    p.open()  # broadcast: 2 candidates for 1 slice
    p.flush()
    for w in (1, 2):
        p.send(w)
        p.complete_all(w)
    p.flush()
    assert p.rx.sessions[1].disputed and p.rx.quarantined
    p.do(RX, ReleaseRequested(1))
    assert not p.retired()
    out = p.do(RX, Tick(), at=p.rx.next_deadline_ns())
    assert isinstance(out[-1], FailStop) and "disputed" in out[-1].detail


@T10
def test_late_request_data_to_a_fenced_sender_settles_kv_and_aux_at_once() -> None:
    p = Pair()
    p.do(1, CancelRequested(1))
    p.open(aux=0)
    p.flush()
    assert p.from_writer(1) == [F]  # one FAILED with is_last ends the whole stream
    assert p.rx.sessions == {} and p.retired()


@T10
def test_session_ack_waits_for_admitted_and_submitting_pieces() -> None:
    p = Pair()
    p.open(aux=0)
    p.flush()
    p.send(1, pieces=2, ready=False)
    p.do(1, SourceReady(1, 0))  # kv0 SUBMITTING; kv1, aux ADMITTED
    p.do(RX, CancelRequested(1))
    p.flush()
    assert "ACK" not in p.from_writer(1)  # kv0 is still SUBMITTING
    p.complete_all(1)
    p.flush()
    assert p.from_writer(1) == [S, F, F, "ACK"] and p.retired()


@T10
def test_repeated_done_is_idempotent_and_poisoned_sender_posts_nothing() -> None:
    p = Pair()
    p.open()
    p.flush()
    p.send(1, pieces=2, ready=False)
    p.do(1, SourceReady(1, 0))
    p.complete_all(1)
    before = list(p.actions[1])
    assert p.do(1, WriteCompleted(p.posts[1][0].op_id)) == []  # BACKEND_DONE + DONE: idempotent
    assert p.actions[1] == before
    p2 = Pair()
    p2.open(rid=5)
    p2.flush()
    p2.send(1, rid=5)
    p2.submit_all(1)
    p2.do(1, WriteFailed(p2.posts[1][0].op_id, "x"))
    p2.do(RX, OpenReceive(6, (1, 2), (1,)))
    p2.flush()
    p2.send(1, rid=6)
    assert [a.request_id for a in p2.posts[1]] == [5]  # nothing posted after the poison


# ---- defects found under review (issue 7): each test failed before its fix ------------------------


@T10
@pytest.mark.parametrize("selected_first", [True, False], ids=["success_first", "decline_first"])
def test_broadcast_decline_from_a_candidate_is_not_a_second_claim(selected_first) -> None:
    """Defect 5: a non-selected (fenced) broadcast candidate answers FAILED with is_last. That is a
    decline - nothing was posted - not a claim on the slice, in either order against the SUCCESS."""
    p = Pair(writers=(1, 2))
    p.do(2, CancelRequested(1))  # candidate 2 is fenced: it declines any publication
    p.open()  # broadcast: two candidates for one slice
    if selected_first:
        p.flush(only_to=1)
        p.send(1)
        p.complete_all(1)
        p.flush(only_to=RX)
    p.flush()
    if not selected_first:
        assert p.rx.sessions[1].outcome is None  # candidate 1 may still deliver the slice
        p.send(1)
        p.complete_all(1)
        p.flush()
    assert p.from_writer(2)[0] == F and p.from_writer(1) == [S]  # an ACK may follow the decline
    assert not p.rx.quarantined and not p.rx.sessions[1].disputed
    assert Deliver(1) in p.actions[RX]
    p.do(RX, ReleaseRequested(1))
    assert p.retired()


@T10
def test_broadcast_fails_when_every_candidate_of_a_slice_declined() -> None:
    p = Pair(writers=(1, 2))
    for w in (1, 2):
        p.do(w, CancelRequested(1))
    p.open()
    p.flush()
    assert p.from_writer(1) == [F] and p.from_writer(2) == [F]
    assert p.retired() and Conclude(1, Outcome.FAILED, "writer 2 failed piece ('kv', 0)") in p.actions[RX]


@T10
def test_a_saved_publication_gets_the_block_count_check_of_a_live_one() -> None:
    """Defect 7: REQUEST_DATA that arrived before OpenSend skipped the length check, and a PostWrite
    with a short destination came out. Now the writer declines it and posts nothing."""
    p = Pair()
    p.open(blocks=(10,))  # one destination block ...
    p.flush()
    p.send(1, nblocks=2)  # ... for two source blocks
    assert p.posts[1] == [] and p.tx[1].counters["invalid_publications"] == 1
    p.flush()
    assert p.from_writer(1) == [F] and p.retired()


@T10
@pytest.mark.parametrize("when", ["cancel_after_saved", "born_cancelled"])
def test_a_cancelled_sender_answers_saved_publications_at_once(when) -> None:
    """Defect 8: a pre-cancelled sender dropped saved publications silently, and the receiver waited out
    its whole timeout. Now each gets a final FAILED at once."""
    p = Pair()
    p.open()
    p.flush()  # REQUEST_DATA saved at the writer (no session yet)
    if when == "cancel_after_saved":
        p.do(1, CancelRequested(1))
    else:
        p.tx[1].fence.install(1, CancelOrigin.CLIENT)  # fenced by an earlier event, then the session opens
        p.send(1)
    p.flush()
    assert p.from_writer(1) == [F] and p.retired() and p.now < T


@T10
def test_the_core_refuses_a_message_for_another_rank_and_stale_epochs() -> None:
    """Defect 9: the core accepted an envelope addressed to another rank (only the stream layer refused
    it), and admission ignored this rank's own watermark."""
    p = Pair()
    misaddressed = MessageReceived(Envelope(1, RX + 1, 0, KvResult(1, 1, 0, True, S, 0)))
    with pytest.raises(PeerProtocolError) as info:
        p.rx.handle(misaddressed, 0)
    assert info.value.field == "dst_rank"
    # with a peer that has not moved its watermark, the world's (fence) watermark stays 0: only this
    # rank's own watermark refuses the stale epoch
    rx = ReceiverCore(CoreConfig(rank=RX, timeout_ns=T, grace_ns=G, peers=(1,)))
    tx = SenderCore(CoreConfig(rank=1, timeout_ns=T, grace_ns=G, peers=(RX,)))
    for core, opening in ((rx, OpenReceive(make_request_id(4, 1), (1,), (1,))),
                          (tx, OpenSend(make_request_id(4, 2), (1,)))):
        core.handle(WatermarkSet(5), 0)
        assert core.fence.admissible(opening.request_id)
        assert [type(a) for a in core.handle(opening, 0)] == [AdmissionRefused] and not core.sessions


@T10
def test_a_local_copy_after_delivery_gets_its_own_clock() -> None:
    """Defect 6: a claim that appeared on a DELIVERED session was never scheduled and inherited the old
    request deadline, so check_fatal said fatal while handle(Tick) said nothing."""
    p = Pair()
    p.open()
    p.flush()
    p.send(1)
    p.complete_all(1)
    p.flush()
    assert Deliver(1) in p.actions[RX]
    start = T + G + 50  # the consumer read for longer than timeout + grace, then queued a copy
    p.do(RX, LocalCompletionPending(1, 3), at=start)
    assert p.rx.check_fatal(start + G - 1) is None
    assert p.rx.next_deadline_ns() == start + G
    predicted = p.rx.check_fatal(start + G)
    out = p.do(RX, Tick(), at=start + G)
    assert predicted is not None and isinstance(out[0], FailStop) and "local completion 3" in out[0].detail


@T10
def test_what_a_second_thread_reads_changes_nothing() -> None:
    """Defect 3: next_deadline_ns popped stale heap entries while the watchdog thread called it too (the
    demo's IndexError). The readers are pure: with a retired session's entry at the head of the heap,
    calling them leaves every field as it was."""
    p = Pair()
    p.open(rid=1)
    p.flush()
    p.send(1, rid=1)
    p.complete_all(1)
    p.flush()
    p.do(RX, OpenReceive(2, (12, 13), (1,)), at=10)  # a later deadline that stays in the heap
    p.do(RX, ReleaseRequested(1))
    assert p.retired(1)

    def snapshot():
        rx = p.rx
        return list(rx._deadlines), set(rx._queued), dict(rx.sessions), dict(rx.counters), rx.fatal

    before = snapshot()
    for _ in range(3):
        p.rx.next_deadline_ns()
        p.rx.check_fatal(p.now + 10 * T)
        p.rx.nearest_fail_stop_ns()
    assert snapshot() == before


# ---- each defect test keeps its teeth: with its fix reverted, it must fail -----------------------


def _saved_path_skips_the_length_check(mp: pytest.MonkeyPatch) -> None:  # defect 7
    mp.setattr(SenderCore, "_fits", lambda self, s, request: True)


def _cancel_drops_saved_publications(mp: pytest.MonkeyPatch) -> None:  # defect 8
    mp.setattr(SenderCore, "_decline_saved", lambda self, rid, actions: self._saved.pop(rid, None))


def _core_trusts_the_stream_layer_for_dst_rank(mp: pytest.MonkeyPatch) -> None:  # defect 9
    apply = RankCore._apply

    def readdressed(self, event, now_ns, actions):
        if isinstance(event, MessageReceived):
            event = MessageReceived(event.envelope.replace(dst_rank=self.config.rank))
        apply(self, event, now_ns, actions)

    mp.setattr(RankCore, "_apply", readdressed)


def _admission_ignores_the_local_watermark(mp: pytest.MonkeyPatch) -> None:  # defect 9
    mp.setattr(RankCore, "_admissible", lambda self, rid: self.fence.admissible(rid))


def _foreign_ack_raises_after_quarantine(mp: pytest.MonkeyPatch) -> None:  # defect 14
    on_quiesced = ReceiverCore._on_quiesced

    def raising(self, s, message, now_ns, actions):
        on_quiesced(self, s, message, now_ns, actions)
        if message.writer_rank not in s.writers:
            raise PeerProtocolError("SESSION_QUIESCED from an unpublished writer", field="writer_rank")

    mp.setattr(ReceiverCore, "_on_quiesced", raising)


def _decline_counts_as_a_claim(mp: pytest.MonkeyPatch) -> None:  # defect 5
    from kvown.core import receiver

    mp.setattr(receiver, "TOUCHING", frozenset(ResultStatus))


def _late_claim_keeps_the_request_deadline(mp: pytest.MonkeyPatch) -> None:  # defect 6
    mp.setattr(ReceiverCore, "_fatal_deadline_ns",
               lambda self, s: s.clock.fatal_deadline_ns if s.has_claims() else None)


def _reader_pops_stale_heads(mp: pytest.MonkeyPatch) -> None:  # defect 3: the reader cleaned the heap
    def popping(self):
        while self._deadlines and self._deadlines[0][1] not in self.sessions:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    mp.setattr(RankCore, "_prune", lambda self: None)
    mp.setattr(RankCore, "next_deadline_ns", popping)


_DECLINE = test_broadcast_decline_from_a_candidate_is_not_a_second_claim
_MISADDRESSED = test_the_core_refuses_a_message_for_another_rank_and_stale_epochs
_FOREIGN_ACK = test_foreign_ack_disputes_as_an_action_and_unknown_and_unsolicited_acks_are_ignored
DEFECT_MUTANTS = [  # (defect, mutant, the defect test that must fail under it, its arguments)
    (3, _reader_pops_stale_heads, test_what_a_second_thread_reads_changes_nothing, {}),
    (5, _decline_counts_as_a_claim, _DECLINE, {"selected_first": True}),
    (5, _decline_counts_as_a_claim, _DECLINE, {"selected_first": False}),
    (6, _late_claim_keeps_the_request_deadline, test_a_local_copy_after_delivery_gets_its_own_clock, {}),
    (7, _saved_path_skips_the_length_check, test_a_saved_publication_gets_the_block_count_check_of_a_live_one, {}),
    (8, _cancel_drops_saved_publications, test_a_cancelled_sender_answers_saved_publications_at_once,
     {"when": "cancel_after_saved"}),
    (8, _cancel_drops_saved_publications, test_a_cancelled_sender_answers_saved_publications_at_once,
     {"when": "born_cancelled"}),
    (9, _core_trusts_the_stream_layer_for_dst_rank, _MISADDRESSED, {}),
    (9, _admission_ignores_the_local_watermark, _MISADDRESSED, {}),
    (14, _foreign_ack_raises_after_quarantine, _FOREIGN_ACK, {}),
]


@T10
@pytest.mark.interpreted_only
@pytest.mark.parametrize(("defect", "mutant", "check", "kwargs"), DEFECT_MUTANTS,
                         ids=[f"{d}-{m.__name__.strip('_')}{''.join(f'-{v}' for v in k.values())}"
                              for d, m, _, k in DEFECT_MUTANTS])
def test_defect_test_fails_with_its_fix_reverted(defect, mutant, check, kwargs, monkeypatch: pytest.MonkeyPatch) -> None:
    check(**kwargs)  # passes on the real code ...
    mutant(monkeypatch)
    with pytest.raises(Exception):  # noqa: B017 - ... and fails on the mutant (an assert, or worse)
        check(**kwargs)
