"""A benchmark never crashes its world on a slow session (issue 19 item 1): it counts and reports it.

``kv_sessions`` runs here on rank 0 over a fake communicator and a fake receiver: one session never
lands and retires only when kvown's own deadline would have timed it out (what the loaded suite run
of issue 19 saw). The old ``wait_event`` raised after its wait and the crash guard aborted the world;
the mutant puts that back and must crash.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from kvown import Outcome
from kvown.apps.benchmarks import world
from kvown.apps.benchmarks.slow import SlowSessionError, SlowSessions

STALLED = 0xB2


class _Done:
    def __init__(self, value=None) -> None:
        self.value = value

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        return True

    def test(self):
        return True, self.value


class FakeComm:
    """Rank 0 of a 2-rank world whose writer has always opened session i before rank 0 asks."""

    def __init__(self) -> None:
        self.opened = 0

    def Ibarrier(self) -> _Done:  # noqa: N802 - mpi4py's name
        return _Done()

    def irecv(self, source: int, tag: int) -> _Done:
        self.opened += 1
        return _Done(self.opened - 1)


class FakeReceiver:
    """Lands and retires at once, except request ``STALLED``: never lands, retires TIMED_OUT after
    ``stall_s`` (its deadline), as a session whose control frame stalled does."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.handles: dict[int, SimpleNamespace] = {}
        self.timers: list[threading.Timer] = []

    def receive(self, rid: int, nb: int, writers, num_slices: int) -> SimpleNamespace:
        h = SimpleNamespace(request_id=rid, blocks=tuple(range(nb)), landed=threading.Event(),
                            retired=threading.Event(), outcome=Future(), opened_ns=time.monotonic_ns(),
                            landed_ns=0, retired_ns=0)
        self.handles[rid] = h
        if rid == STALLED:
            timer = threading.Timer(self.stall_s, self._retire, (h, Outcome.TIMED_OUT))
            timer.start()
            self.timers.append(timer)
        else:
            h.landed_ns = time.monotonic_ns()
            h.landed.set()
        return h

    def release(self, rid: int) -> None:
        h = self.handles[rid]
        if not h.retired.is_set():
            self._retire(h, Outcome.COMPLETED)

    cancel = release

    @staticmethod
    def _retire(h: SimpleNamespace, outcome: Outcome) -> None:
        h.retired_ns = time.monotonic_ns()
        if not h.outcome.done():
            h.outcome.set_result(outcome)
        h.retired.set()


def _run(slow: SlowSessions, stall_s: float = 0.3, warmup: int = 0) -> dict:
    receiver = FakeReceiver(stall_s)
    pool = SimpleNamespace(tensor=None, layout=SimpleNamespace(block_nbytes=1))
    rt = SimpleNamespace(receiver=receiver, pool=pool)
    rids = [0xB1, STALLED, 0xB3, 0xB4]
    plan = [(False, 0)] * len(rids)
    try:
        return world.kv_sessions(rt, FakeComm(), world.RX, rids, 1, (1,), plan, 0, False,
                                 time.monotonic() + 30, slow, "w2", warmup)
    finally:
        for timer in receiver.timers:
            timer.join(5)


@pytest.mark.timeout(30)
def test_a_session_that_never_lands_is_counted_and_left_out_of_the_percentiles() -> None:
    slow = SlowSessions(0.05, 5.0)
    out = _run(slow)
    assert out["slow_sessions"] == 1
    assert out["outcomes"] == {"completed": 3, "timed_out": 1}
    assert len(out["release_to_retired_ns"]) == 3  # the stalled one is counted, not timed
    assert len(out["publish_to_landed_ns"]) == 3
    report = slow.report([[{"workload": "w2", "request_id": 7, "waited_for": "sender released",
                            "waited_s": 0.4, "happened": True}]])
    assert report["count"] == 2 and report["excluded_from_percentiles"] is True
    mine = report["waits"][0]
    assert (mine["request_id"], mine["waited_for"], mine["happened"]) == (STALLED, "landed", False)
    assert 0.25 <= mine["waited_s"] < 5.0


@pytest.mark.timeout(30)
def test_the_warm_up_is_left_out_of_the_latencies() -> None:
    out = _run(SlowSessions(0.05, 5.0), warmup=1)
    assert len(out["release_to_retired_ns"]) == 2  # session 0: warm-up; session 1: slow


@pytest.mark.timeout(30)
def test_only_a_wait_past_give_up_raises() -> None:
    slow = SlowSessions(0.02, 0.1)
    with pytest.raises(SlowSessionError) as info:
        slow.wait("w1", 0x42, "retired", threading.Event())
    assert (info.value.request_id, info.value.what, info.value.workload) == (0x42, "retired", "w1")
    assert slow.count() == 1 and slow.waits[0]["happened"] is False


@pytest.mark.timeout(30)
def test_mutant_raising_on_a_slow_wait_crashes_the_benchmark(monkeypatch) -> None:
    """The bug of issue 19: a wait that outran its bound raised in rank 0's main thread."""

    def old_wait(self, workload, request_id, what, event, instead=None):
        if not event.wait(self.slow_s):
            raise world.BenchError(f"{what} did not happen within {self.slow_s} s")
        return True

    monkeypatch.setattr(SlowSessions, "wait", old_wait)
    with pytest.raises(world.BenchError, match="landed did not happen"):
        _run(SlowSessions(0.05, 5.0))
