"""CancellationFence: permanence, first origin, growth, compaction by epoch, stale admission."""

from __future__ import annotations

import random

import pytest

from kvown.core.fence import CancellationFence, CancelOrigin
from kvown.core.ids import MAX_SEQ, make_request_id


@pytest.mark.timeout(10)
def test_install_is_permanent_and_first_origin_wins() -> None:
    f = CancellationFence()
    rid = make_request_id(1, 5)
    assert not f.is_fenced(rid) and f.origin(rid) is None
    assert f.install(rid, CancelOrigin.PEER) is CancelOrigin.PEER
    for later in (CancelOrigin.CLIENT, CancelOrigin.TIMEOUT, CancelOrigin.PEER):
        assert f.install(rid, later) is CancelOrigin.PEER  # INV-F2
    assert f.is_fenced(rid) and f.origin(rid) is CancelOrigin.PEER and len(f) == 1


@pytest.mark.timeout(10)
def test_many_ids_survive_growth_and_misses_stay_misses() -> None:
    rng = random.Random(5)
    f = CancellationFence()
    ids = {make_request_id(rng.randrange(3), rng.randrange(MAX_SEQ + 1)) for _ in range(5000)}
    for i, rid in enumerate(sorted(ids)):
        f.install(rid, CancelOrigin(1 + i % 5))
    assert len(f) == len(ids)
    for i, rid in enumerate(sorted(ids)):
        assert f.is_fenced(rid) and f.origin(rid) is CancelOrigin(1 + i % 5)
    misses = [make_request_id(rng.randrange(3), rng.randrange(MAX_SEQ + 1)) for _ in range(2000)]
    assert all(not f.is_fenced(r) for r in misses if r not in ids)
    assert f.is_fenced(make_request_id(0, 0)) == (make_request_id(0, 0) in ids)
    assert f.nbytes() <= 16 * len(f) * 2  # slots stay between 1/3 and 2/3 full


@pytest.mark.timeout(10)
def test_seq_edges() -> None:
    f = CancellationFence()
    f.install(make_request_id(0, 0), CancelOrigin.CLIENT)
    f.install(make_request_id(0, MAX_SEQ), CancelOrigin.SHUTDOWN)
    assert f.origin(make_request_id(0, MAX_SEQ)) is CancelOrigin.SHUTDOWN
    assert not f.is_fenced(make_request_id(1, 0))


@pytest.mark.timeout(10)
def test_compaction_drops_only_lower_epochs_and_makes_them_inadmissible() -> None:
    f = CancellationFence()
    old, new = make_request_id(1, 3), make_request_id(2, 3)
    f.install(old, CancelOrigin.CLIENT)
    f.install(new, CancelOrigin.CLIENT)
    assert f.compact_below(2) == 1
    assert not f.admissible(old) and f.admissible(new)  # INV-F1: the dropped fence can never be needed
    assert f.is_fenced(new) and f.watermark == 2
    assert f.compact_below(1) == 0 and f.watermark == 2  # never moves back
    assert f.admissible(make_request_id(7, 0))


@pytest.mark.timeout(10)
def test_stale_ids_are_refused_by_the_cores() -> None:
    from corekit import kinds, msg, receiver, sender

    from kvown.core.errors import PeerProtocolError
    from kvown.core.events import CancelRequested, OpenReceive, OpenSend
    from kvown.core.messages import RequestData

    stale = make_request_id(0, 1)
    for core, event in ((receiver(), OpenReceive(stale, (1,), (1,))), (sender(), OpenSend(stale, (1,)))):
        core.fence.compact_below(1)
        assert kinds(core.handle(event, 0)) == ["AdmissionRefused"] and not core.sessions
        assert core.handle(CancelRequested(stale), 1) == [] and core.counters["stale_cancels"] == 1
    s = sender()
    s.fence.compact_below(1)
    with pytest.raises(PeerProtocolError):
        s.handle(msg(9, 1, RequestData(stale, 9, (1,), 0, 1, -1)), 0)
