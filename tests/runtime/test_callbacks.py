"""Handle callbacks (``on_landed``, ``on_done``) and the API called from them, on the real driver.

The pair tests step both drivers over the fake NIXL library with their own clock (no threads), so a
callback runs on the stepping thread exactly where the engine thread would run it. The last test runs
real engines over real NIXL: there a callback is on the engine thread, and the API must not wait for it.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvown.cache.layout import KVLayout
from kvown.core.actions import FatalReason, Outcome
from kvown.core.errors import LocalProtocolError
from kvown.core.ids import make_request_id
from kvown.runtime.config import TransferConfig
from kvown.runtime.driver import Driver
from kvown.runtime.engine import Engine
from kvown.runtime.handles import SendPhase
from kvown.testing.clockguard import forbid_real_clock
from kvown.testing.fake_nixl import WriteFault
from kvown.testing.pair import RX, TX, DriverPair

LAYOUT = KVLayout.standard(num_layers=1, num_blocks=16, tokens_per_block=2, num_kv_heads=2, head_dim=4, dtype="uint8")


def Pair() -> DriverPair:  # noqa: N802 - reads as the pair it builds
    """Both ranks' production drivers over one fake fabric, with deadlines of 10 us on the pair's clock."""
    config = TransferConfig(transfer_timeout_s=10e-6, grace_s=10e-6, control_retry_s=1e-6, metrics_port=0)
    return DriverPair(config, layout=LAYOUT, key=b"k" * 32)


@pytest.fixture
def no_real_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_real_clock(monkeypatch)


def _landed_and_released(p: DriverPair, rid: int, seen: list) -> object:
    """A receive whose ``on_landed`` notes what it saw and releases; returns its ticket."""

    def landed(h):
        seen.append(("landed", h.landed.is_set(), h.result(), h.retired.is_set()))
        p.rx.release(h.request_id)

    def done(h):
        seen.append(("retired", h.retired.is_set(), h.result()))

    return p.rx.submit_receive(rid, 2, (TX,), on_landed=landed, on_done=done)


@pytest.mark.timeout(30)
def test_on_landed_then_on_done_run_once_each_with_the_state_settled(no_real_clock) -> None:
    p = Pair()
    rid, seen, sent = make_request_id(1, 1), [], []
    ticket = _landed_and_released(p, rid, seen)
    send = p.tx.send(rid, (0, 1), on_done=lambda h: sent.append((h.released.is_set(), h.result())))
    p.run(lambda: ticket.future.done() and ticket.future.result(0).retired.is_set() and send.released.is_set())
    assert seen == [("landed", True, Outcome.COMPLETED, False), ("retired", True, Outcome.COMPLETED)]
    assert sent == [(True, Outcome.COMPLETED)]
    p.run(steps=20)  # nothing fires twice
    assert len(seen) == 2 and len(sent) == 1
    assert p.drivers[RX].stats["callback_errors"] == 0


@pytest.mark.timeout(30)
def test_callbacks_alone_drive_a_window_of_sessions(no_real_clock) -> None:
    """The W1 shape: each side opens its next session from the last one's callback; no waits anywhere."""
    p = Pair()
    rids = [make_request_id(2, i) for i in range(24)]
    todo_rx, todo_tx = iter(rids), iter(enumerate(rids))
    retired, released = [], []

    def receive_next(_h=None) -> None:
        rid = next(todo_rx, None)
        if rid is not None:
            p.rx.submit_receive(rid, 2, (TX,), on_landed=lambda h: p.rx.release(h.request_id), on_done=retired_cb)

    def retired_cb(h) -> None:
        retired.append(h.result())
        receive_next()

    def send_next(_h=None) -> None:
        item = next(todo_tx, None)
        if item is not None:
            i, rid = item
            p.tx.send(rid, (2 * (i % 3), 2 * (i % 3) + 1), on_done=released_cb)

    def released_cb(h) -> None:
        released.append(h.result())
        send_next()

    for _ in range(3):
        receive_next()
        send_next()
    p.run(lambda: len(retired) == len(released) == len(rids), steps=2000)
    assert retired == released == [Outcome.COMPLETED] * len(rids)
    assert p.drivers[RX].pool.statistics().free == LAYOUT.num_blocks  # every block back, with proof


def _raising_landed(p: DriverPair, rid: int) -> object:
    def landed(h):
        raise RuntimeError("the server's bug")

    return p.rx.submit_receive(rid, 1, (TX,), on_landed=landed)


@pytest.mark.timeout(30)
def test_a_raising_callback_is_counted_and_recorded_not_a_crash(no_real_clock) -> None:
    p = Pair()
    rid = make_request_id(3, 1)
    ticket = _raising_landed(p, rid)
    p.tx.send(rid, (4,), on_done=lambda h: 1 / 0)
    p.run(lambda: ticket.future.done() and ticket.future.result(0).landed.is_set())
    h = ticket.future.result(0)
    assert p.drivers[RX].stats["callback_errors"] == 1 and not p.fatal
    events = [e for e in p.drivers[RX].recorder.events() if e[1] == "callback_error"]
    assert events and events[0][2] == rid and events[0][3]["callback"] == "on_landed"
    p.rx.release(rid)  # the callback never released: the session waits for its consumer, safely
    p.run(h.retired.is_set)
    assert h.retired.is_set() and h.result() is Outcome.COMPLETED
    assert p.drivers[TX].stats["callback_errors"] == 1  # the sender's on_done raised too
    rid2, seen = make_request_id(3, 2), []
    t2 = _landed_and_released(p, rid2, seen)  # the rank goes on serving
    p.tx.send(rid2, (0, 1))
    p.run(lambda: t2.future.done() and t2.future.result(0).retired.is_set())
    assert [s[0] for s in seen] == ["landed", "retired"]


@pytest.mark.timeout(30)
@pytest.mark.interpreted_only
def test_mutant_calling_callbacks_unguarded_crashes_the_step(no_real_clock, monkeypatch) -> None:
    monkeypatch.setattr(Driver, "_callback", lambda self, fn, handle, name: fn(handle))
    p = Pair()
    rid = make_request_id(3, 3)
    _raising_landed(p, rid)
    p.tx.send(rid, (4,))
    with pytest.raises(RuntimeError, match="the server's bug"):  # the engine would turn it into ENGINE_CRASH
        p.run(steps=200)


@pytest.mark.timeout(30)
def test_a_callback_that_is_not_callable_is_refused_naming_it(no_real_clock) -> None:
    p = Pair()
    rid = make_request_id(4, 1)
    with pytest.raises(LocalProtocolError) as err:
        p.rx.submit_receive(rid, 1, (TX,), on_landed="release")
    assert err.value.field == "on_landed"
    with pytest.raises(LocalProtocolError) as err:
        p.rx.submit_receive(rid, 1, (TX,), on_done=3)
    assert err.value.field == "on_done"
    assert not p.drivers[RX].inbox  # nothing queued, the id is still free
    assert not p.rx.submit_receive(rid, 1, (TX,)).future.done()


# ---- Engine.fail_stopping: the API's admission check -------------------------------------------------


def _pair_with_a_due_fail_stop() -> tuple[DriverPair, Engine]:
    """A receiver whose cancelled session waits for a WRITE that never completes: its drain deadline is
    in the core's heap; the clock is then moved past it without stepping the receiver."""
    p = Pair()
    p.fabric.inject_write(WriteFault(delay_polls=10**9))  # in flight for good
    rid = make_request_id(5, 1)
    ticket = p.rx.submit_receive(rid, 1, (TX,))
    send = p.tx.send(rid, (3,))
    p.run(lambda: send.phase is SendPhase.POSTED, steps=50)
    p.rx.cancel(rid)
    p.run(lambda: ticket.future.result(0).outcome.done(), steps=50)
    engine = p.stacks[RX].engine
    assert engine.fail_stopping() is None and p.drivers[RX].fatal is None
    p.now = p.drivers[RX].earliest_deadline_ns + 10**9  # past every deadline; no step ran since
    return p, engine


def _reports_the_due_fail_stop(engine: Engine) -> bool:
    fatal = engine.fail_stopping()
    return fatal is not None and fatal.reason is FatalReason.DEADLINE and engine.driver.fatal is None


@pytest.mark.timeout(30)
def test_a_due_fail_stop_is_reported_before_the_engine_latched_it(no_real_clock) -> None:
    _, engine = _pair_with_a_due_fail_stop()
    assert _reports_the_due_fail_stop(engine)


@pytest.mark.timeout(30)
def test_mutant_trusting_only_the_latched_fail_stop_misses_it(no_real_clock, monkeypatch) -> None:
    _, engine = _pair_with_a_due_fail_stop()
    monkeypatch.setattr(Engine, "fail_stopping", lambda self: self.driver.fatal)
    assert not _reports_the_due_fail_stop(engine)


def _answers_while_the_lock_is_held(engine: Engine) -> bool:
    answered = threading.Event()
    caller = threading.Thread(target=lambda: (engine.fail_stopping(), answered.set()), daemon=True)
    with engine.driver.lock:  # the engine is inside a core's handle
        caller.start()
        ok = answered.wait(0.5)
    caller.join(5)
    return ok


@pytest.mark.timeout(30)
def test_the_admission_check_takes_no_lock_while_nothing_can_be_due() -> None:
    p = Pair()
    rid = make_request_id(6, 1)
    p.rx.submit_receive(rid, 1, (TX,))
    p.run(steps=3)  # a session with a deadline: the step published the earliest one
    engine = p.stacks[RX].engine
    assert p.now < p.drivers[RX].earliest_deadline_ns
    assert _answers_while_the_lock_is_held(engine)


@pytest.mark.timeout(30)
def test_mutant_locking_on_every_call_waits_for_the_engine(monkeypatch) -> None:
    p = Pair()
    p.run(steps=3)
    engine = p.stacks[RX].engine

    def always_locked(self):
        with self.driver.lock:
            return self.driver.check_fatal(self.clock())

    monkeypatch.setattr(Engine, "fail_stopping", always_locked)
    assert not _answers_while_the_lock_is_held(engine)


# ---- on the engine thread (real NIXL) -------------------------------------------------------------


@pytest.mark.timeout(60)
def test_from_a_callback_receive_refuses_to_wait_and_submit_receive_goes_on() -> None:
    from kvown import KVLayout, TransferConfig
    from kvown.testing.local import local_world

    layout = KVLayout.standard(num_layers=1, num_blocks=16, tokens_per_block=4, num_kv_heads=2, head_dim=16,
                               dtype="bfloat16")
    world = local_world({0: {"sender"}, 1: {"receiver"}}, layout=layout, config=TransferConfig(transfer_timeout_s=2.0))
    tx, rx = world[0], world[1]
    first, second = make_request_id(7, 1), make_request_id(7, 2)
    seen: dict[str, object] = {}
    chained = threading.Event()

    def on_landed(h) -> None:
        try:
            rx.receiver.receive(second, 1, (0,))
        except LocalProtocolError as exc:
            seen["field"] = exc.field
        seen["thread"] = threading.current_thread().name
        seen["inline"] = rx.engine.call(lambda driver: driver.rank)  # runs here: no wait for our own step
        seen["ticket"] = rx.receiver.submit_receive(second, 1, (0,), on_done=lambda h2: chained.set())
        rx.receiver.release(h.request_id)

    try:
        h = rx.receiver.receive(first, 1, (0,), on_landed=on_landed)
        tx.sender.send(first, (1,))
        assert h.retired.wait(10)
        assert seen["field"] == "receive" and seen["thread"].startswith("kvown-engine") and seen["inline"] == 1
        h2 = seen["ticket"].future.result(10)
        tx.sender.send(second, (2,))
        assert h2.landed.wait(10)
        rx.receiver.release(second)
        assert chained.wait(10) and h2.result() is Outcome.COMPLETED
        deadline = time.monotonic() + 5
        while rx.engine.statistics().counter("callback_errors") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rx.engine.statistics().counter("callback_errors") == 0
    finally:
        for rt in world.values():
            rt.close()


# ---- a command's frame leaves before the step reads arrivals (driver rule 2) -------------------------


@pytest.mark.timeout(30)
def test_a_publication_leaves_before_the_step_reads_what_arrived(no_real_clock) -> None:
    """The receiver's step holds a new receive (a command) and a landed WRITE's report (an arrival): the
    new REQUEST_DATA is sent first, so it never waits behind the arrivals' work (or WRITEs they post)."""
    p = Pair()
    first, second = make_request_id(8, 1), make_request_id(8, 2)
    t1 = p.rx.submit_receive(first, 1, (TX,))
    p.drivers[RX].step(p.now)  # REQUEST_DATA(first) out
    send = p.tx.send(first, (1,))
    for _ in range(20):  # only the sender moves: its WRITE and the carried report reach the fabric
        p.drivers[TX].step(p.now)
        p.now += 10
    assert send.phase is not SendPhase.OPEN and not t1.future.result(0).landed.is_set()
    p.rx.submit_receive(second, 1, (TX,))
    recorder = p.drivers[RX].recorder
    mark = recorder.recorded
    p.drivers[RX].step(p.now)  # one step: the command and the arrival together
    _, events = recorder.events_since(mark)
    kinds = [(kind, rid) for _, kind, rid, _ in events if kind in ("send", "recv_carried")]
    assert kinds == [("send", second), ("recv_carried", first)], kinds
    assert t1.future.result(0).landed.is_set()
