"""``LiveRequests`` (commands rule 5): the memory of how finished sessions ended answers late closes, and
it costs the garbage collector nothing. Measured (issue 19): with 65,536 ``CloseResult`` objects kept
as the memory, full collections of the benchmark pair's heap ran every ~3,000 sessions at ~118 ms
each (~40 us per session); as plain ints, none ran in 6,000 sessions."""

from __future__ import annotations

import gc

import pytest

from kvown.adapters.transport import Role
from kvown.core.actions import Outcome
from kvown.runtime import commands
from kvown.runtime.commands import CloseResult, CloseStatus, LiveRequests, SendHandle


def _finished(rid: int, outcome: Outcome | None) -> SendHandle:
    handle = SendHandle(rid)
    if outcome is None:
        handle.outcome.set_exception(RuntimeError("refused"))
    else:
        handle.outcome.set_result(outcome)
    handle.released.set()
    return handle


def _fill(live: LiveRequests, n: int) -> None:
    outcomes = (Outcome.COMPLETED, Outcome.CANCELLED, None)
    for rid in range(1, n + 1):
        live.claim(Role.SENDER, rid, _finished(rid, outcomes[rid % 3]))


def test_late_closes_read_how_each_session_ended() -> None:
    live = LiveRequests(remember=100)
    _fill(live, 300)
    assert live.lookup(Role.SENDER, 298) == (None, CloseResult(298, CloseStatus.ALREADY_RETIRED, Outcome.CANCELLED))
    assert live.lookup(Role.SENDER, 297) == (None, CloseResult(297, CloseStatus.ALREADY_RETIRED, Outcome.COMPLETED))
    assert live.lookup(Role.SENDER, 299) == (None, CloseResult(299, CloseStatus.REFUSED))
    assert live.lookup(Role.RECEIVER, 299) == (None, None)  # another role's memory
    assert live.lookup(Role.SENDER, 5) == (None, None)  # forgotten: only the last 100 are kept
    live.claim(Role.SENDER, 299, SendHandle(299))  # a new session of the id: the record goes
    assert live.lookup(Role.SENDER, 299)[1] is None


def _tracked_growth(n: int) -> int:
    live = LiveRequests()
    _fill(live, 64)
    gc.collect()
    before = len(gc.get_objects())
    _fill(live, n)
    gc.collect()
    return len(gc.get_objects()) - before


@pytest.mark.timeout(60)
def test_the_memory_is_invisible_to_the_garbage_collector() -> None:
    """5,000 remembered sessions add (almost) no object the collector must traverse."""
    assert _tracked_growth(5000) < 200


@pytest.mark.timeout(60)
def test_mutant_remembering_result_objects_grows_the_collectors_heap(monkeypatch) -> None:
    """The old memory: one ``CloseResult`` (and a tuple key) per finished session, each traversed by
    every full collection (up to 64 of the last sessions are still handles, not yet records)."""
    monkeypatch.setattr(commands, "_pack", lambda result: result)
    monkeypatch.setattr(commands, "_unpack", lambda rid, result: result)
    assert _tracked_growth(5000) >= 5000 - 64
