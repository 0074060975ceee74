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
