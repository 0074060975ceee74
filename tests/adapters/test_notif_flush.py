"""A notification NIXL accepted is not yet sent (issue 19 item 1): it leaves only while the sender's
worker is progressed, and closing the endpoint first cancels it (UCX status -16, dropped by NIXL).

``NixlEndpoint.close`` therefore progresses the agent for ``CLOSE_FLUSH_S`` of its thread's CPU
after the last ``send_notif`` (``flush_notifs``): a starved thread gets as many progress passes as a
quiet one (the fabric's ``wall_ns_per_tick`` starves it, ``notifs_per_progress`` backs UCX up). The fake fabric's ``NotifFault(in_flight=True)`` plays UCX's part;
``test_real_*`` holds the fake to real NIXL: a large notification burst really does sit in the
sender's UCX until the sender is progressed, and ``close`` delivers what is left.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from kvown.adapters.nixl import CLOSE_FLUSH_S, NixlEndpoint
from kvown.testing.fake_nixl import FakeFabric, FakeNixlEndpoint, NotifFault

_ids = itertools.count()


def _fake_pair() -> tuple[FakeFabric, NixlEndpoint, NixlEndpoint]:
    fabric = FakeFabric()
    a = FakeNixlEndpoint(f"flush-a{next(_ids)}", fabric=fabric)
    b = FakeNixlEndpoint(f"flush-b{next(_ids)}", fabric=fabric)
    a.add_peer(b.metadata())
    b.add_peer(a.metadata())
    return fabric, a, b


def _frames_after_close(n: int = 3) -> tuple[list[bytes], int, FakeFabric]:
    """``a`` sends ``n`` frames UCX keeps in flight, then closes; what ``b`` got and the cancels."""
    fabric, a, b = _fake_pair()
    fabric.inject_notif(NotifFault(src=a.name, count=n, in_flight=True))
    for i in range(n):
        a.send_notif(b.name, b"frame%d" % i)
    before = [m for _, m in b.drain_notifs()]
    assert before == []  # accepted by NIXL, not sent: the sender was not progressed since
    a.close()
    got = [m for _, m in b.drain_notifs()]
    b.close()
    return got, fabric.canceled_notifs, fabric


@pytest.mark.timeout(30)
def test_close_flushes_notifications_still_in_flight() -> None:
    got, canceled, _ = _frames_after_close()
    assert got == [b"frame0", b"frame1", b"frame2"]
    assert canceled == 0


@pytest.mark.timeout(30)
@pytest.mark.interpreted_only("patches NixlEndpoint.flush_notifs, a native method in the compiled build")
def test_mutant_close_without_the_flush_loses_the_frames(monkeypatch) -> None:
    """The bug: peers dropped while UCX still held accepted notifications; each was canceled."""
    monkeypatch.setattr(NixlEndpoint, "flush_notifs", lambda self, flush_s=CLOSE_FLUSH_S: 0)
    got, canceled, _ = _frames_after_close()
    assert got == [] and canceled == 3


@pytest.mark.timeout(30)
def test_the_flush_is_bounded_and_only_after_a_send() -> None:
    fabric, a, b = _fake_pair()
    ticks = fabric.ticks
    assert a.flush_notifs() == 0 and fabric.ticks == ticks  # never sent: no progress call at all
    a.send_notif(b.name, b"x")
    b.send_notif(a.name, b"for-a")
    ticks = fabric.ticks
    assert a.flush_notifs() == 1  # arrivals while flushing are counted and dropped
    calls = fabric.ticks - ticks
    assert 1 <= calls <= int(CLOSE_FLUSH_S * 1000) + 2  # 1 fake CPU ms per call: bounded by flush_s
    fabric.wall_ns_per_tick = 10**9  # starved for good: 1 s of wall time per call
    b.send_notif(a.name, b"again")
    ticks = fabric.ticks
    assert a.flush_notifs() == 1 and fabric.ticks - ticks <= 3  # max_s (2 s of wall time) ends it
    a.close()
    b.close()


def _starved_close(n: int = 200) -> tuple[int, int]:
    """``a`` sends ``n`` frames UCX keeps in flight, 10 of which leave per progress call, then closes
    while starved: each call takes 1 ms of its CPU and 20 ms of wall time. (delivered, canceled)."""
    fabric, a, b = _fake_pair()
    fabric.notifs_per_progress, fabric.wall_ns_per_tick = 10, 20_000_000
    fabric.inject_notif(NotifFault(src=a.name, count=n, in_flight=True))
    for i in range(n):
        a.send_notif(b.name, b"frame%d" % i)
    a.close()
    got = len(b.drain_notifs())
    b.close()
    return got, fabric.canceled_notifs


@pytest.mark.timeout(30)
def test_a_starved_close_still_flushes_everything() -> None:
    """20 progress passes are needed; 50 ms of wall time would give a starved thread only 3 of them."""
    assert _starved_close() == (200, 0)


def _wall_clock_flush(self: NixlEndpoint, flush_s: float = CLOSE_FLUSH_S, max_s: float = 0.0) -> int:
    """The old flush: 50 ms of wall time, however little of it the thread got to run."""
    if self._last_notif_ns is None:
        return 0
    end_ns, arrived = self._clock() + int(flush_s * 1e9), 0
    while True:
        arrived += len(self.drain_notifs())
        if self._clock() >= end_ns:
            return arrived


@pytest.mark.timeout(30)
@pytest.mark.interpreted_only("patches NixlEndpoint.flush_notifs, a native method in the compiled build")
def test_mutant_a_wall_clock_flush_loses_frames_when_starved(monkeypatch) -> None:
    """The bug CI saw (docs/design.md 16.2): a starved close ran out of wall time, UCX still held frames."""
    monkeypatch.setattr(NixlEndpoint, "flush_notifs", _wall_clock_flush)
    got, canceled = _starved_close()
    assert got < 200 and canceled == 200 - got


def _nixl_or_skip() -> None:
    pytest.importorskip("nixl")


def _real_burst(n: int, size: int) -> tuple[int, int]:
    """One real sender/receiver pair: ``n`` notifications of ``size`` bytes sent without progressing
    the sender, a 1.5 s nap, then ``close``. Returns (arrived while it napped, arrived in all)."""
    a = NixlEndpoint(f"flush-real-a{time.monotonic_ns()}")
    ready, stop = threading.Event(), threading.Event()
    box: dict[str, object] = {"count": 0}

    def receiver() -> None:
        b = NixlEndpoint(f"flush-real-b{time.monotonic_ns()}")
        box["md"] = b.metadata()
        ready.wait(30)
        b.add_peer(box["a_md"])  # type: ignore[arg-type]
        end = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < end:
            got = sum(1 for _, m in b.drain_notifs() if m[:1] == b"m")
            box["count"] = int(box["count"]) + got  # type: ignore[call-overload]
        b.close()

    t = threading.Thread(target=receiver, name="flush-real-receiver", daemon=True)
    t.start()
    for _ in range(3000):
        if "md" in box:
            break
        time.sleep(0.01)
    peer = a.add_peer(box["md"])  # type: ignore[arg-type]
    box["a_md"] = a.metadata()
    ready.set()
    a.send_notif(peer, b"hello")  # wire-up, with both sides progressed
    end = time.monotonic() + 2
    while time.monotonic() < end:
        a.drain_notifs()
    for i in range(n):
        a.send_notif(peer, b"m%03d" % i + b"." * (size - 4))
    time.sleep(1.5)  # the sender naps: nothing progresses its worker
    while_napping = int(box["count"])  # type: ignore[call-overload]
    a.close()  # flush_notifs progresses the worker before the peer is dropped
    end = time.monotonic() + 30
    while int(box["count"]) < n and time.monotonic() < end:  # type: ignore[call-overload]
        time.sleep(0.01)
    stop.set()
    t.join(30)
    return while_napping, int(box["count"])  # type: ignore[call-overload]


@pytest.mark.timeout(180)
def test_real_notifications_wait_for_the_senders_progress_and_close_flushes_them() -> None:
    """Real NIXL/UCX, no progress thread: bursts of 800 x 20 KB notifications sent without
    progressing the sender (measured here: usually about a fifth stay in UCX); the receiver drains in
    its own thread meanwhile. Whether a burst backs up depends on the socket buffers of the moment (CI
    runs saw all 800 leave, three bursts in a row), so up to three bursts are sent until one does; every
    burst must arrive in full after ``close``; when none backed up the premise is reported as a skip. 1 MiB ones do not show it: UCX pushes those out inside the send call."""
    _nixl_or_skip()
    n, size = 800, 20_000
    bursts = []
    for _ in range(3):
        bursts.append(_real_burst(n, size))
        if bursts[-1][0] < n:
            break
    assert all(total == n for _, total in bursts), f"frames lost at close: {bursts}"
    if bursts[-1][0] == n:  # seen in full-suite CI runs: the premise, not kvown, is what did not show
        pytest.skip(f"no burst stayed in UCX this time (arrived while napping, in all: {bursts}); the fake's "
                    "in_flight knob and the flush are still checked by the fake-fabric tests and the mutant")
