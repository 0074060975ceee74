"""SenderCore alone: operations, ordered results, quiescence acks, poison, deadlines."""

from __future__ import annotations

import pytest
from corekit import G, RX, T, kinds, msg, sender

from kvown.core.actions import Conclude, Outcome, PostWrite, ReleaseSource, SendControl
from kvown.core.events import OpenSend, SourceReady, WriteFailed, WriteSubmitted
from kvown.core.messages import KvResult, RequestData, ResultStatus


def _rd(rid: int, rx: int = RX, blocks=(10, 11), slice_index=0, num_slices=1, aux=-1) -> RequestData:
    return RequestData(rid, rx, blocks, slice_index, num_slices, aux)


@pytest.mark.timeout(10)
def test_session_attached_after_poison_concludes_failed_and_releases_its_source() -> None:
    """Regression: a session whose publication arrived after the rank was poisoned refused every op and
    reported FAILED, but never concluded: no Conclude, no ReleaseSource, and no clock to end it."""
    s = sender()
    s.handle(OpenSend(1, (0, 1)), 0)
    s.handle(msg(RX, 1, _rd(1)), 0)
    post = [a for a in s.handle(SourceReady(1, 0), 1) if isinstance(a, PostWrite)][0]
    s.handle(WriteSubmitted(post.op_id), 2)
    s.handle(WriteFailed(post.op_id, "nic error"), 3)  # in doubt: the rank is poisoned
    assert s.poisoned
    s.handle(OpenSend(2, (0, 1)), 4)
    out = s.handle(msg(RX, 1, _rd(2), seq=1), 5)
    assert kinds(out) == ["Conclude", "SendControl:KvResult", "ReleaseSource"]
    assert out[0] == Conclude(2, Outcome.FAILED, "sender poisoned")
    assert out[1] == SendControl(RX, KvResult(1, 2, 0, True, ResultStatus.FAILED, 0))
    assert out[2] == ReleaseSource(2)
    assert 2 not in s.sessions and not s.may_write(2, RX)


def _attached(nblocks=2, pieces=1):
    s = sender()
    s.handle(OpenSend(1, tuple(range(nblocks)), pieces), 0)
    s.handle(msg(RX, 1, _rd(1, blocks=tuple(range(10, 10 + nblocks)))), 0)
    return s


BAD_PUBLICATIONS = [
    ("receiver_rank differs from the stream", RX + 1, _rd(1), "receiver_rank"),
    ("slice_index >= num_slices", RX, _rd(1, slice_index=2, num_slices=2), "slice_index"),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("case", "src", "publication", "field"), BAD_PUBLICATIONS, ids=[c[0] for c in BAD_PUBLICATIONS])
def test_bad_publications_are_refused_without_change(case, src, publication, field) -> None:
    from kvown.core.errors import PeerProtocolError

    s = sender()
    s.handle(OpenSend(1, (0, 1)), 0)
    before = repr(s.sessions[1])
    with pytest.raises(PeerProtocolError) as info:
        s.handle(msg(src, 1, publication), 1)
    assert info.value.field == field and repr(s.sessions[1]) == before


@pytest.mark.timeout(10)
def test_a_publication_of_another_block_count_is_answered_failed_at_once() -> None:
    """Rule 4: it can never be served, so the receiver hears so now instead of at its timeout; the
    session itself is unchanged."""
    from kvown.core.messages import KvResult, ResultStatus

    s = sender()
    s.handle(OpenSend(1, (0, 1)), 0)
    before = repr(s.sessions[1])
    out = s.handle(msg(RX, 1, _rd(1, blocks=(1, 2, 3))), 1)
    assert [(a.dst_rank, a.message) for a in out] == [(RX, KvResult(1, 1, 0, True, ResultStatus.FAILED, 0))]
    assert repr(s.sessions[1]) == before and s.counters["invalid_publications"] == 1


@pytest.mark.timeout(10)
def test_second_publication_on_one_stream_is_refused() -> None:
    from kvown.core.errors import PeerProtocolError

    s = _attached()
    with pytest.raises(PeerProtocolError):
        s.handle(msg(RX, 1, _rd(1), seq=1), 1)
    s2 = sender()
    s2.handle(msg(RX, 1, _rd(5)), 0)  # saved: no session yet
    with pytest.raises(PeerProtocolError):
        s2.handle(msg(RX, 1, _rd(5), seq=1), 1)


BAD_OPENS = [
    (OpenSend(-1, (0,)), "request_id"),
    (OpenSend(1, ()), "num_pieces"),
    (OpenSend(1, (0,), 2), "num_pieces"),
    (OpenSend(1, (0,), 1, 0), "num_receivers"),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("event", "field"), BAD_OPENS)
def test_bad_opens_raise(event, field) -> None:
    from kvown.core.errors import LocalProtocolError

    s = sender()
    with pytest.raises(LocalProtocolError) as info:
        s.handle(event, 0)
    assert info.value.field == field and not s.sessions


@pytest.mark.timeout(10)
def test_nothing_is_posted_before_the_source_is_ready_and_aux_waits_for_every_piece() -> None:
    s = sender()
    s.handle(OpenSend(1, (0, 1, 2, 3), 2), 0)
    assert s.handle(msg(RX, 1, _rd(1, blocks=(5, 6, 7, 8), aux=4)), 0) == []
    out = s.handle(SourceReady(1, 1), 1)
    assert [(a.kind.value, a.piece, a.src_blocks, a.dst_blocks) for a in out] == [("kv", 1, (2, 3), (7, 8))]
    out = s.handle(SourceReady(1, 0), 2)
    assert [(a.kind.value, a.piece) for a in out] == [("kv", 0), ("aux", 2)] and out[1].aux_slot == 4


@pytest.mark.timeout(10)
def test_sender_timeout_refuses_unposted_pieces_and_in_flight_goes_fatal() -> None:
    from kvown.core.actions import FailStop
    from kvown.core.events import Tick

    s = _attached(pieces=2)
    post = s.handle(SourceReady(1, 0), 10)[0]
    s.handle(WriteSubmitted(post.op_id), 11)
    assert s.next_deadline_ns() == 10 + T
    out = s.handle(Tick(), 10 + T)
    assert out[0] == Conclude(1, Outcome.TIMED_OUT, "transfer timeout") and s.sessions[1].clock.drain_started_ns == 10 + T
    assert s.may_write(1, RX)  # the posted write is still in flight
    out = s.handle(Tick(), 10 + T + G)
    assert isinstance(out[0], FailStop) and "submitted" in out[0].detail


@pytest.mark.timeout(10)
def test_peer_cancel_after_compaction_is_acked_at_once() -> None:
    from kvown.core.ids import make_request_id
    from kvown.core.messages import CancelSession, SessionQuiesced

    s = sender()
    s.fence.compact_below(1)
    rid = make_request_id(0, 4)
    assert s.handle(msg(RX, 1, CancelSession(rid, RX)), 0) == [SendControl(RX, SessionQuiesced(1, rid))]


@pytest.mark.timeout(10)
def test_pieces_ready_at_open_post_on_publication_without_a_source_ready() -> None:
    """``OpenSend.ready_pieces``: the driver folds tokens that are ready at once into the open."""
    s = sender()
    s.handle(OpenSend(1, (0, 1, 2, 3), 2, ready_pieces=(1,)), 0)
    out = s.handle(msg(RX, 1, _rd(1, blocks=(10, 11, 12, 13))), 1)
    posts = [a for a in out if isinstance(a, PostWrite)]
    assert [(p.piece, p.src_blocks) for p in posts] == [(1, (2, 3))]  # piece 0 waits for its SourceReady
    assert [a.piece for a in s.handle(SourceReady(1, 0), 2) if isinstance(a, PostWrite)] == [0]


@pytest.mark.timeout(10)
def test_a_ready_piece_out_of_range_is_refused_without_change() -> None:
    from kvown.core.errors import LocalProtocolError

    s = sender()
    with pytest.raises(LocalProtocolError) as info:
        s.handle(OpenSend(1, (0, 1), 1, ready_pieces=(1,)), 0)
    assert info.value.field == "ready_pieces" and s.sessions == {}
