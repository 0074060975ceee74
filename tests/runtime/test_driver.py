"""The real driver over the fake NIXL library: each library behaviour that real NIXL shows (a send that
raises after it delivered, ERROR then DONE, duplicated notifications, get_new_notifs raising, a
release that fails) is exercised end to end through Sender/Receiver, driver, cores and transport.
No threads and no real clock: the test steps both drivers with its own integer clock."""

from __future__ import annotations

import pytest
import torch

from kvown.adapters.transport import KVTransport, Role
from kvown.api import Receiver, Sender
from kvown.cache.layout import KVLayout
from kvown.cache.pool import KVPool
from kvown.core.actions import FatalReason, Outcome
from kvown.core.errors import LocalProtocolError
from kvown.core.ids import make_request_id
from kvown.runtime.commands import LiveRequests
from kvown.runtime.config import TransferConfig
from kvown.runtime.driver import Driver
from kvown.runtime.engine import Engine
from kvown.runtime.flight import FlightRecorder
from kvown.testing.clockguard import forbid_real_clock
from kvown.testing.fake_nixl import FakeFabric, FakeNixlEndpoint, FakeOutcome, NotifFault, WriteFault

LAYOUT = KVLayout.standard(num_layers=1, num_blocks=16, tokens_per_block=2, num_kv_heads=2, head_dim=4, dtype="uint8")
KEY = b"k" * 32
TX, RX = 0, 1


@pytest.fixture(autouse=True)
def _no_real_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_real_clock(monkeypatch)


class Pair:
    """A sender rank and a receiver rank, each the production driver over one fabric."""

    def __init__(self, *, timeout_ns: int = 10_000, grace_ns: int = 10_000, retry_ns: int = 1_000,
                 layout: KVLayout = LAYOUT) -> None:
        self.now = 0
        self.fabric = FakeFabric()
        self.fatal: dict[int, object] = {}
        self.drivers: dict[int, Driver] = {}
        transports = {}
        for rank, role in ((TX, Role.SENDER), (RX, Role.RECEIVER)):
            pool = KVPool(layout)
            aux = torch.zeros(4 * 8, dtype=torch.uint8)
            transports[rank] = KVTransport(FakeNixlEndpoint(f"r{rank}", fabric=self.fabric), rank, pool.space(), aux,
                                           aux_slot_nbytes=8, roles=frozenset({role}),
                                           geometry_digest=layout.geometry_digest())
            config = TransferConfig(transfer_timeout_s=timeout_ns * 1e-9, grace_s=grace_ns * 1e-9,
                                    control_retry_s=retry_ns * 1e-9, aux_slots=4, aux_slot_nbytes=8, fault=None,
                                    metrics_port=0, canary=True)
            self.drivers[rank] = Driver(rank=rank, peers=(1 - rank,), roles=frozenset({role}),
                                        transport=transports[rank], pool=pool, aux=aux, key=KEY, config=config,
                                        recorder=FlightRecorder(rank, clock_ns=lambda: self.now),
                                        on_fail_stop=lambda a, r=rank: self.fatal.setdefault(r, a))
        for rank, transport in transports.items():
            transport.connect({1 - rank: transports[1 - rank].info})
        clock = lambda: self.now  # noqa: E731
        self.tx = Sender(Engine(self.drivers[TX], fail_stop=lambda a: None, clock=clock))
        self.rx = Receiver(Engine(self.drivers[RX], fail_stop=lambda a: None, clock=clock))

    def run(self, until=lambda: False, steps: int = 200, dt: int = 10) -> None:
        """Step both drivers, advancing the clock, until ``until()`` or ``steps`` rounds (bounded)."""
        for _ in range(steps):
            for driver in self.drivers.values():
                driver.step(self.now)
            if until():
                return
            self.now += dt

    def transfer(self, seq: int, nblocks: int = 2):
        rid = make_request_id(1, seq)
        ticket = self.rx.submit_receive(rid, nblocks, (TX,))
        self.run(ticket.future.done, steps=5)
        handle = ticket.future.result(0)
        send = self.tx.send(rid, tuple(range(nblocks)))
        self.run(handle.landed.is_set)
        return rid, handle, send


@pytest.mark.timeout(30)
def test_a_send_that_raises_after_delivering_is_resent_and_the_copy_dropped() -> None:
    p = Pair()
    p.fabric.inject_notif(NotifFault(src="r1", raise_after=True))  # REQUEST_DATA left, then send_notif raised
    rid, handle, send = p.transfer(1)
    assert handle.landed.is_set() and handle.outcome.result(0) is Outcome.COMPLETED
    assert p.drivers[RX].stats["control_send_failures"] == 1 and p.drivers[RX].stats["control_resent"] == 1
    assert p.drivers[TX].inn.duplicates == 1  # the resend was a duplicate, dropped by its sequence number
    p.rx.release(rid)
    p.run(handle.retired.is_set)
    assert handle.retired.is_set() and send.released.is_set()


@pytest.mark.timeout(30)
def test_a_send_that_raises_before_sending_is_resent_with_no_hole() -> None:
    p = Pair()
    p.fabric.inject_notif(NotifFault(src="r1", raise_before=True, count=3))
    rid, handle, _ = p.transfer(2)
    assert handle.outcome.result(0) is Outcome.COMPLETED and p.drivers[RX].stats["control_resent"] == 1
    assert p.drivers[TX].inn.duplicates == 0 and not p.fatal


@pytest.mark.timeout(30)
def test_a_stream_that_cannot_be_repaired_fail_stops_at_once_naming_the_peer() -> None:
    p = Pair(retry_ns=100)
    p.fabric.inject_notif(NotifFault(src="r1", raise_before=True, count=10_000))
    rid = make_request_id(1, 3)
    p.rx.submit_receive(rid, 1, (TX,))
    p.run(lambda: RX in p.fatal, steps=50)
    fatal = p.fatal[RX]
    assert fatal.reason is FatalReason.CONTROL_LOST and "rank 0" in fatal.detail and "REQUEST_DATA" in fatal.detail
    assert p.now < 10_000  # long before the request deadline: never a quiet stall until then


@pytest.mark.timeout(30)
def test_error_then_done_is_in_doubt_then_settled_late() -> None:
    p = Pair()
    p.fabric.inject_write(WriteFault(src="r0", outcome=FakeOutcome.ERR_THEN_DONE, err_polls=3))
    rid = make_request_id(1, 4)
    ticket = p.rx.submit_receive(rid, 2, (TX,))
    p.run(ticket.future.done, steps=5)
    handle = ticket.future.result(0)
    send = p.tx.send(rid, (0, 1))
    p.run(handle.retired.is_set)
    assert handle.outcome.result(0) is Outcome.FAILED and handle.retired.is_set()
    assert p.drivers[RX].receiver.quarantined  # the receiver no longer trusts that backend
    assert p.drivers[TX].sender.poisoned and send.released.is_set()
    kinds = [e[1] for e in p.drivers[RX].recorder.events()]
    assert kinds.count("retire") == 1


@pytest.mark.timeout(30)
def test_duplicated_notifications_are_dropped_once_each() -> None:
    p = Pair()
    p.fabric.inject_notif(NotifFault(dup=True, count=100))
    rid, handle, _ = p.transfer(5)
    assert handle.outcome.result(0) is Outcome.COMPLETED
    # the receiver's report came as the WRITE's notification (carried, outside the ordered stream):
    # its copy is dropped by the driver before the core, never disputed
    assert p.drivers[TX].inn.duplicates >= 1 and p.drivers[RX].stats["duplicate_carried"] >= 1
    assert p.drivers[RX].receiver.counters.get("invalid_evidence", 0) == 0


@pytest.mark.timeout(30)
def test_get_new_notifs_raising_is_counted_and_survived() -> None:
    p = Pair()
    p.fabric.fail_get_notifs = 3
    rid, handle, _ = p.transfer(6)
    assert handle.outcome.result(0) is Outcome.COMPLETED
    assert p.drivers[TX].stats["receive_errors"] + p.drivers[RX].stats["receive_errors"] == 3


@pytest.mark.timeout(30)
def test_a_release_that_fails_is_retried_and_the_endpoint_closes_clean() -> None:
    p = Pair()
    p.fabric.fail_release = 2
    rid, handle, send = p.transfer(7)
    p.rx.release(rid)
    p.run(lambda: handle.retired.is_set() and not p.drivers[TX]._unreleased)
    assert p.drivers[TX].stats["release_failures"] == 2 and not p.drivers[TX]._unreleased
    assert p.drivers[TX].transport.endpoint.live_handles == 0
    p.drivers[TX].transport.close()  # nothing live: close is allowed


@pytest.mark.timeout(30)
def test_next_deadline_and_check_fatal_are_pure() -> None:
    """Defect 3: next_deadline_ns popped stale heap entries, so a second thread calling it raced the
    engine. Readers must change nothing; a mutant that pops is caught here."""
    p = Pair(timeout_ns=1_000)
    rid, handle, _ = p.transfer(8)
    p.rx.release(rid)
    p.run(handle.retired.is_set)  # the session is gone; its deadlines are stale heap entries
    core = p.drivers[RX].receiver
    before = (list(core._deadlines), set(core._queued), dict(core.sessions))
    for _ in range(3):
        core.next_deadline_ns()
        core.check_fatal(p.now + 10**9)
        p.drivers[RX].check_fatal(p.now)
    assert (list(core._deadlines), set(core._queued), dict(core.sessions)) == before


def _duplicate_ids_are_refused() -> None:
    p = Pair()
    rid = make_request_id(1, 1)
    ticket = p.rx.submit_receive(rid, 2, (TX,))
    with pytest.raises(LocalProtocolError) as info:  # the receive is not even answered yet
        p.rx.submit_receive(rid, 2, (TX,))
    assert info.value.field == "request_id"
    p.run(ticket.future.done, steps=5)
    handle = ticket.future.result(0)
    with pytest.raises(LocalProtocolError):
        p.rx.submit_receive(rid, 2, (TX,))
    send = p.tx.send(rid, (0, 1))
    with pytest.raises(LocalProtocolError):
        p.tx.send(rid, (4, 5))
    p.run(lambda: handle.landed.is_set() and send.released.is_set())
    assert send.outcome.result(0) is Outcome.COMPLETED  # the first handles complete as usual
    p.rx.release(rid)
    p.run(handle.retired.is_set)
    assert not p.fatal and p.drivers[RX].pool.statistics().free == LAYOUT.num_blocks


@pytest.mark.timeout(30)
def test_a_live_request_id_is_refused_before_anything_changes() -> None:
    """Defect 10: a second send()/receive() with a live id overwrote the handle map before the core
    refused it: the first handle never completed, and a WRITE could leave before its ready token."""
    _duplicate_ids_are_refused()


@pytest.mark.timeout(30)
def test_the_duplicate_id_check_catches_a_registry_that_overwrites(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LiveRequests, "claim", LiveRequests.replace)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        _duplicate_ids_are_refused()


@pytest.mark.timeout(30)
def test_a_canary_fail_stop_is_latched_before_the_caller_hears_of_it() -> None:
    """A late write found by the canary fails the receive with AdmissionError. The caller's thread may die
    of that at once, and its exit hook reports driver.fatal: the INVARIANT must already be latched then,
    or the world is killed as a mere rank crash (seen in the demo's retire-on-cancel mutant)."""
    p = Pair()
    rid, handle, _ = p.transfer(1)
    p.rx.release(rid)
    p.run(handle.retired.is_set)
    p.drivers[RX].pool.block_view(handle.blocks[0])[0] ^= 0xFF  # a write lands after retirement
    ticket = p.rx.submit_receive(make_request_id(1, 2), LAYOUT.num_blocks, (TX,))
    seen_at_answer = []
    ticket.future.add_done_callback(lambda f: seen_at_answer.append(p.drivers[RX].fatal))
    p.run(ticket.future.done, steps=5)
    assert "fail-stopping" in str(ticket.future.exception(0))
    assert seen_at_answer and seen_at_answer[0] is not None
    assert seen_at_answer[0].reason is FatalReason.INVARIANT and "canary" in seen_at_answer[0].detail
    assert p.fatal[RX] is seen_at_answer[0]


@pytest.mark.timeout(30)
def test_a_late_write_into_the_separate_scale_pool_fail_stops_too() -> None:
    """The driver's canaries guard every plane of its pool: a late write of NVFP4 scales (the separate,
    TensorRT-LLM layout) is caught before the block is handed out again, like one of values."""
    layout = KVLayout.nvfp4(num_layers=1, num_blocks=8, tokens_per_block=16, num_kv_heads=2, head_dim=16,
                            scale_layout="separate")
    p = Pair(layout=layout)
    rid, handle, _ = p.transfer(1)
    p.rx.release(rid)
    p.run(handle.retired.is_set)
    p.drivers[RX].pool.scales.block_view(handle.blocks[1])[5] ^= 0x01  # type: ignore[union-attr]
    ticket = p.rx.submit_receive(make_request_id(1, 2), layout.num_blocks, (TX,))
    p.run(ticket.future.done, steps=5)
    assert "fail-stopping" in str(ticket.future.exception(0))
    assert p.fatal[RX].reason is FatalReason.INVARIANT and "canary" in p.fatal[RX].detail  # type: ignore[attr-defined]


@pytest.mark.timeout(30)
def test_a_write_that_never_completes_holds_back_no_other_session() -> None:
    """Carried reports are outside the ordered streams: session 1's WRITE never reports DONE (so its report
    never leaves), yet session 2's publication, WRITE and report go through, and session 1 stays held."""
    p = Pair(timeout_ns=100_000, grace_ns=100_000)
    p.fabric.inject_write(WriteFault(src="r0", delay_polls=10**9))  # the first WRITE: in flight forever
    rid1 = make_request_id(1, 20)
    t1 = p.rx.submit_receive(rid1, 2, (TX,))
    p.run(t1.future.done, steps=5)
    h1 = t1.future.result(0)
    p.tx.send(rid1, (0, 1))
    p.run(steps=20)
    rid2, h2, s2 = p.transfer(21)
    assert h2.landed.is_set() and h2.outcome.result(0) is Outcome.COMPLETED
    p.rx.release(rid2)
    p.run(lambda: h2.retired.is_set() and s2.released.is_set())
    assert h2.retired.is_set() and s2.released.is_set()
    assert not h1.landed.is_set() and not h1.retired.is_set()  # no report, no retirement: still claimed
    assert p.drivers[TX].statistics()["writes_in_flight"] == 1 and not p.fatal


@pytest.mark.timeout(30)
def test_release_and_cancel_times_count_from_the_callers_call_not_the_engine_step() -> None:
    """Users read release -> retired and cancel -> retired off the handle: both start when the caller
    asked, so a busy engine's queueing delay is part of the figure (it was once reported as 0 us)."""
    p = Pair()
    rid, handle, _ = p.transfer(7)
    asked_ns = p.now
    p.rx.release(rid)
    p.now += 500  # the engine gets to the command later
    p.run(handle.retired.is_set)
    assert handle.released_ns == asked_ns and handle.retired_ns - handle.released_ns >= 500
    rid = make_request_id(1, 8)
    ticket = p.rx.submit_receive(rid, 1, (TX,))
    p.run(ticket.future.done, steps=5)
    asked_ns = p.now
    p.rx.cancel(rid)
    p.now += 300
    p.run(ticket.future.result(0).retired.is_set)
    assert ticket.future.result(0).cancelled_ns == asked_ns
