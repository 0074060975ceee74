"""Regressions for what the core fuzz target found in the receiver.

Finding (100k-input run, and again in a 200k survey): a SESSION_QUIESCED from a writer outside a live
session's published set quarantined admission *and then* raised ``PeerProtocolError``, so the engine
counted a rejected frame whose state change had already happened (errors rule 3: a raise leaves the
machine unchanged). A result from an unpublished writer did the same with a dispute; the fuzzer did
not reach that one (it needs two consistent bytes), it was fixed by reading the same pattern. Both now
keep their safety effect and return normally, counted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvown.core.events import MessageReceived
from kvown.core.messages import Envelope, KvResult, ResultStatus, SessionQuiesced
from kvown.testing import fuzz_targets as ft

REGRESSIONS = Path(__file__).parent / "regressions" / "core"


@pytest.mark.parametrize("path", sorted(REGRESSIONS.iterdir()), ids=lambda p: p.name)
def test_fuzzer_finding_replays_clean(path):
    assert "handled" in ft.core_one_input(path.read_bytes())


def test_ack_from_an_unpublished_writer_quarantines_without_raising():
    _, rx = ft.core_fixture()
    rx.handle(MessageReceived(Envelope(3, ft.LOCAL, 0, SessionQuiesced(3, ft.RID_ACTIVE))), ft.NOW_NS)
    assert rx.quarantined and rx.counters["foreign_acks"] == 1
    assert not rx.sessions[ft.RID_ACTIVE].disputed  # an ack claims nothing: the session itself is intact


def test_result_from_an_unpublished_writer_disputes_without_raising():
    _, rx = ft.core_fixture()
    result = KvResult(3, ft.RID_ACTIVE, 0, True, ResultStatus.SUCCESS, 4096)
    rx.handle(MessageReceived(Envelope(3, ft.LOCAL, 0, result)), ft.NOW_NS)
    session = rx.sessions[ft.RID_ACTIVE]
    assert "unpublished writer 3" in session.disputed and rx.quarantined
    assert rx.counters["invalid_evidence"] == 1 and session.clock.drain_started_ns == ft.NOW_NS
    assert ft.core_one_input(ft.join_frames([ft._body(3, ft.LOCAL, 0, result)])) == "handled"
