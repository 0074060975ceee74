"""The real driver over the fake NIXL library: each library behaviour that real NIXL shows (a send that
raises after it delivered, ERROR then DONE, duplicated notifications, get_new_notifs raising, a
release that fails) is exercised end to end through Sender/Receiver, driver, cores and transport.
No threads and no real clock: the test steps both drivers with its own integer clock."""

from __future__ import annotations

import pytest

from kvown.cache.layout import KVLayout
from kvown.core.actions import FatalReason, Outcome
from kvown.core.errors import LocalProtocolError
from kvown.core.ids import make_request_id
from kvown.adapters.cuda import HostReadyToken
from kvown.runtime.commands import CloseStatus, LiveRequests, Receive, ReceivePhase, SendPhase, Ticket
from kvown.runtime.config import TransferConfig
from kvown.runtime.driver import Driver
from kvown.testing.clockguard import forbid_real_clock
from kvown.testing.fake_nixl import FakeOutcome, NotifFault, WriteFault
from kvown.testing.pair import DriverPair

LAYOUT = KVLayout.standard(num_layers=1, num_blocks=16, tokens_per_block=2, num_kv_heads=2, head_dim=4, dtype="uint8")
KEY = b"k" * 32
TX, RX = 0, 1


@pytest.fixture(autouse=True)
def _no_real_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_real_clock(monkeypatch)


class Pair(DriverPair):
    """A sender rank and a receiver rank, each the production driver over one fabric."""

    def __init__(self, *, timeout_ns: int = 10_000, grace_ns: int = 10_000, retry_ns: int = 1_000,
                 clock=None, layout: KVLayout = LAYOUT, **levers: bool) -> None:
        config = TransferConfig(transfer_timeout_s=timeout_ns * 1e-9, grace_s=grace_ns * 1e-9,
                                control_retry_s=retry_ns * 1e-9, aux_slots=4, aux_slot_nbytes=8,
                                metrics_port=0, canary=True, **levers)
        super().__init__(config, layout=layout, key=KEY, clock=clock)  # clock: the engine's (API calls, stamps)

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
    assert p.drivers[TX].statistics().writes_in_flight == 1 and not p.fatal


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


# ---- issue 16: the embedding API (ready-gated release, late closes are no-ops, true clocks) ----------


def _release_waits_for_the_token(p: Pair) -> bool:
    """A release whose ready token completes late keeps the blocks out of the pool (and un-canaried)
    until it completes; True if that held at every step."""
    rid, handle, send = p.transfer(30)
    token = HostReadyToken()  # the consumer's decode kernel still reads the blocks
    assert p.rx.release(rid, ready=token).status is CloseStatus.QUEUED
    pool = p.drivers[RX].pool
    held = True
    for _ in range(50):
        p.run(steps=1)
        held &= not handle.retired.is_set() and pool.statistics().free == LAYOUT.num_blocks - len(handle.blocks)
    assert send.released.is_set()  # the writer is long quiescent: only the consumer's read holds the blocks
    token.signal()
    p.run(handle.retired.is_set)
    assert handle.retired.is_set() and pool.statistics().free == LAYOUT.num_blocks
    return held


@pytest.mark.timeout(30)
def test_a_release_waits_for_the_consumers_ready_token() -> None:
    assert _release_waits_for_the_token(Pair())


@pytest.mark.interpreted_only
@pytest.mark.timeout(30)
def test_a_release_that_ignores_its_token_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    original = Driver._release
    monkeypatch.setattr(Driver, "_release", lambda self, rid, issued_ns, ready: original(self, rid, issued_ns, None))
    assert not _release_waits_for_the_token(Pair())


@pytest.mark.timeout(30)
def test_a_cancel_of_a_landed_session_waits_for_its_token_too() -> None:
    p = Pair()
    rid, handle, _ = p.transfer(31)
    token = HostReadyToken()
    p.rx.cancel(rid, ready=token)  # a client abort while the decode kernel reads: the cancel releases
    p.run(steps=50)
    assert not handle.retired.is_set()
    token.signal()
    p.run(handle.retired.is_set)
    assert handle.retired.is_set() and handle.outcome.result(0) is Outcome.COMPLETED


def _late_closes(p: Pair) -> None:
    """A cancel wins the race with the caller's release-on-landed: the release is a no-op."""
    rid, handle, _ = p.transfer(32)
    p.rx.cancel(rid)  # a client abort, just after the landing: it releases the session
    p.run(handle.retired.is_set)
    late = p.rx.release(rid)  # the caller releases on landed (the obvious code)
    assert late.status is CloseStatus.ALREADY_RETIRED and late.outcome is Outcome.COMPLETED


@pytest.mark.timeout(30)
def test_a_release_that_lost_the_race_with_a_cancel_is_a_no_op() -> None:
    p = Pair()
    _late_closes(p)
    assert not p.fatal and p.drivers[RX].stats["local_protocol_errors"] == 0


@pytest.mark.timeout(30)
def test_every_close_after_the_first_says_what_happened() -> None:
    p = Pair()
    rid, handle, _ = p.transfer(35)
    assert p.rx.cancel(rid).status is CloseStatus.QUEUED
    assert p.rx.release(rid).status is CloseStatus.ALREADY_CLOSING  # queued behind the cancel: no-op
    assert p.rx.status(rid).phase is ReceivePhase.CLOSING
    p.run(handle.retired.is_set)
    assert p.rx.cancel(rid).status is CloseStatus.ALREADY_RETIRED
    assert p.rx.status(rid).phase is ReceivePhase.RETIRED
    with pytest.raises(LocalProtocolError, match="no receive session") as err:
        p.rx.release(make_request_id(1, 999))  # only an id never seen is an error
    assert err.value.field == "request_id"
    assert not p.fatal and p.drivers[RX].stats["local_protocol_errors"] == 0


@pytest.mark.timeout(30)
def test_a_release_command_that_reaches_a_retired_session_is_a_counted_no_op() -> None:
    """The engine side of the race: a Release already queued when the cancel retired the session."""
    from kvown.runtime.commands import Release

    p = Pair()
    rid, handle, _ = p.transfer(33)
    p.rx.cancel(rid)
    p.run(handle.retired.is_set)
    p.drivers[RX].submit(Release(rid, p.now))
    p.run(steps=3)
    stats = p.drivers[RX].statistics()
    assert stats.counter("late_release") == 1 and stats.counter("local_protocol_errors") == 0 and not p.fatal


@pytest.mark.timeout(30)
def test_the_race_check_catches_a_release_that_raises_when_it_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the API's old release, which refused an id with no live session."""
    from kvown.api import Receiver as Rx
    from kvown.runtime.commands import Release

    def old_release(self, request_id, *, ready=None):
        handle = self._live_handle(request_id, "release")  # raised for an id with no live session
        handle.closing = True
        self._engine.submit(Release(request_id, self._engine.clock()))

    monkeypatch.setattr(Rx, "release", old_release)
    with pytest.raises(LocalProtocolError, match="no live receive session"):
        _late_closes(Pair())


@pytest.mark.timeout(30)
def test_send_status_walks_open_published_posted_released() -> None:
    p = Pair()
    rid = make_request_id(1, 34)
    token = HostReadyToken()
    send = p.tx.send(rid, (0, 1), ready=token)  # context-first: nobody published yet
    p.run(steps=3)
    assert p.tx.status(rid).phase is SendPhase.OPEN
    ticket = p.rx.submit_receive(rid, 2, (TX,))
    p.run(lambda: send.published_ns != 0)
    assert p.tx.status(rid).phase is SendPhase.PUBLISHED and send.posted_ns == 0
    token.signal()
    p.run(lambda: send.released.is_set())
    status = p.tx.status(rid)
    assert status.phase is SendPhase.RELEASED and status.outcome is Outcome.COMPLETED
    assert send.opened_ns <= send.published_ns <= send.posted_ns <= send.released_ns
    handle = ticket.future.result(0)
    p.rx.release(rid)
    p.run(handle.retired.is_set)


@pytest.mark.timeout(30)
def test_a_watermark_reaching_a_sender_with_an_unpublished_send_is_not_a_crash() -> None:
    """A WATERMARK names no request: the publication stamp must not look for one (the CI soak's
    worlds died with ENGINE_CRASH when a receiver's watermark met a context-first send)."""
    from kvown.runtime.commands import SetWatermark

    p = Pair()
    rid = make_request_id(1, 35)
    send = p.tx.send(rid, (0, 1), ready=HostReadyToken())  # unpublished: the stamp is armed
    p.run(steps=3)
    p.drivers[RX].inbox.append(SetWatermark(1))
    p.run(steps=5)
    assert p.drivers[TX].fatal is None and p.fatal == {}
    assert send.published_ns == 0 and p.tx.status(rid).phase is SendPhase.OPEN


class _AdvancingClock:
    """The engine's real clock moves on while a step runs: every read is later than the last, and later
    than the step's own ``now_ns`` (which the engine read before the step began)."""

    def __init__(self) -> None:
        self.pair: Pair | None = None
        self.reads = 0

    def __call__(self) -> int:
        self.reads += 1
        return (self.pair.now if self.pair is not None else 0) + self.reads


def _handle_times_are_true(p: Pair) -> list[int]:
    """Release and cancel queued after the step's clock was read (the mid-step case): every
    latency read off the handles, ``retired_ns - released_ns`` and the rest; all must be >= 0."""
    out = []
    for seq in range(40, 46):
        rid, handle, send = p.transfer(seq)
        p.rx.release(rid) if seq % 2 else p.rx.cancel(rid)
        p.run(handle.retired.is_set)
        start = handle.released_ns if seq % 2 else handle.cancelled_ns
        out += [handle.retired_ns - start, handle.landed_ns - handle.opened_ns]
        out += [send.published_ns - send.opened_ns, send.posted_ns - send.published_ns]  # one step: post too
        p.run(send.released.is_set)
        out.append(send.released_ns - send.posted_ns)
    return out


@pytest.mark.timeout(30)
def test_handle_times_are_the_events_own_even_for_a_command_taken_mid_step() -> None:
    clock = _AdvancingClock()
    p = Pair(clock=clock)
    clock.pair = p
    assert all(v >= 0 for v in _handle_times_are_true(p))


@pytest.mark.interpreted_only
@pytest.mark.timeout(30)
def test_the_clock_check_catches_stamps_taken_from_the_steps_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the old stamps (the ``now_ns`` the engine read before the step) - negative latencies."""
    clock = _AdvancingClock()
    p = Pair(clock=clock)
    clock.pair = p
    for d in p.drivers.values():
        d._stamp = lambda d=d: d._now_ns
    assert any(v < 0 for v in _handle_times_are_true(p))


@pytest.mark.interpreted_only
@pytest.mark.timeout(30)
def test_the_clock_check_catches_a_publication_stamped_after_its_post(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the old order in ``_pump`` - the actions (the WRITE's post) first, then the publication's
    stamp - gives ``posted_ns < published_ns`` whenever the publication and the post share a step. Without
    coalescing: a coalesced WRITE posts after the pump, which would hide the order (rule 3a)."""
    def old_pump(self: Driver) -> None:
        while self._events and self.fatal is None:
            core, event = self._events.popleft()
            actions = self._handle(core, event)
            if actions is None:
                continue
            self._execute(core, actions)
            if core is self.sender and self._unpublished:
                self._note_publication(event)

    monkeypatch.setattr(Driver, "_pump", old_pump)
    clock = _AdvancingClock()
    p = Pair(clock=clock, coalesce_writes=False)
    clock.pair = p
    assert any(v < 0 for v in _handle_times_are_true(p))


@pytest.mark.interpreted_only
@pytest.mark.timeout(30)
def test_the_late_release_check_catches_a_driver_that_hands_it_to_the_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the driver passes a late Release to the core, which refuses it as an illegal input."""
    from kvown.core.events import ReleaseRequested
    from kvown.runtime.commands import Release

    monkeypatch.setattr(Driver, "_release", lambda self, rid, issued_ns, ready: self._events.append(
        (self.receiver, ReleaseRequested(rid))))
    p = Pair()
    rid, handle, _ = p.transfer(36)
    p.rx.cancel(rid)
    p.run(handle.retired.is_set)
    p.drivers[RX].submit(Release(rid, p.now))
    p.run(steps=3)
    assert p.drivers[RX].statistics().counter("local_protocol_errors") == 1  # what the check above rules out


# ---- prefix-cache hits and publications that will never come (the vLLM connector's needs) -----------


def _suffix_transfer(p: Pair, *, dst_suffix: bool):
    """The receiver already holds the first 2 of 4 token blocks (a prefix-cache hit): it publishes 2."""
    rid = make_request_id(1, 50)
    src = (4, 5, 6, 7)
    tx_pool, rx_pool = p.drivers[TX].pool, p.drivers[RX].pool
    for i, b in enumerate(src):
        tx_pool.block_view(b).fill_(0x10 + i)
    send = p.tx.send(rid, src, dst_suffix=dst_suffix)
    ticket = p.rx.submit_receive(rid, 2, (TX,))
    p.run(ticket.future.done, steps=5)
    handle = ticket.future.result(0)
    p.run(lambda: handle.outcome.done() and send.released.is_set())
    return handle, send, [int(rx_pool.block_view(b)[0]) for b in handle.blocks]


@pytest.mark.timeout(30)
def test_a_suffix_publication_gets_the_last_source_blocks() -> None:
    p = Pair()
    handle, send, firsts = _suffix_transfer(p, dst_suffix=True)
    assert handle.outcome.result(0) is Outcome.COMPLETED and send.outcome.result(0) is Outcome.COMPLETED
    assert firsts == [0x12, 0x13]  # token blocks 2 and 3: never the prefix (vLLM's front-trim bug, #48758)


@pytest.mark.timeout(30)
def test_a_short_publication_without_suffix_is_declined_at_once() -> None:
    p = Pair()
    handle, send, _ = _suffix_transfer(p, dst_suffix=False)
    assert handle.outcome.result(0) is Outcome.FAILED and p.now < 5_000  # long before the 10 us timeout
    assert p.drivers[TX].sender.counters.get("invalid_publications") == 1


def _unpublished_cancel(p: Pair, writers) -> tuple:
    """The decode side decides never to publish (it computed the KV itself) while the writer holds an
    open send for the id: a cancel naming the writer frees the writer's source blocks at once."""
    rid = make_request_id(1, 51)
    send = p.tx.send(rid, (0, 1))
    p.run(steps=3)
    p.rx.cancel(rid, writers=writers)
    p.run(send.released.is_set, steps=50)
    return send, p.now


@pytest.mark.timeout(30)
def test_a_cancel_naming_writers_releases_their_unpublished_sends() -> None:
    p = Pair()
    send, t_ns = _unpublished_cancel(p, (TX,))
    assert send.released.is_set() and send.outcome.result(0) is Outcome.CANCELLED and t_ns < 1_000
    assert p.drivers[RX].receiver.counters.get("stale_acks") == 1  # the writer's ack, for no session here
    assert not p.fatal


@pytest.mark.timeout(30)
def test_a_cancel_without_writers_leaves_the_writer_waiting() -> None:
    """What the notification buys: without it the writer holds its source blocks (until its own timeout)."""
    send, _ = _unpublished_cancel(Pair(), ())
    assert not send.released.is_set()


@pytest.mark.timeout(30)
def test_cancel_writers_are_checked_in_the_callers_thread() -> None:
    p = Pair()
    with pytest.raises(LocalProtocolError) as err:
        p.rx.cancel(make_request_id(1, 52), writers=(7,))
    assert err.value.field == "writers"
    with pytest.raises(LocalProtocolError) as err:
        p.tx.send(make_request_id(1, 53), (0, 1), num_pieces=2, dst_suffix=True)
    assert err.value.field == "dst_suffix"


# ---- a LocalProtocolError inside the engine is our bug: an INVARIANT fail-stop (driver rule 6a) -----


def _planted_core_bug(p: Pair, monkeypatch: pytest.MonkeyPatch):
    """The receiver core refuses a release it should accept (a planted bug): what does the rank do?"""
    from kvown.core.events import ReleaseRequested

    rid, handle, _ = p.transfer(37)
    core = p.drivers[RX].receiver
    real = core.handle

    def buggy(event, now_ns):
        if type(event) is ReleaseRequested:
            raise LocalProtocolError("planted core bug", field="request_id", request_id=event.request_id)
        return real(event, now_ns)

    monkeypatch.setattr(core, "handle", buggy)
    p.rx.release(rid)
    p.run(steps=5)
    return rid, handle


@pytest.mark.interpreted_only("it plants a core bug by patching a core's handle, which compiled code never looks up")
@pytest.mark.timeout(30)
def test_a_local_protocol_error_inside_the_engine_fail_stops_with_invariant(monkeypatch: pytest.MonkeyPatch) -> None:
    p = Pair()
    rid, handle = _planted_core_bug(p, monkeypatch)
    fatal = p.fatal.get(RX)
    assert fatal is not None and fatal.reason is FatalReason.INVARIANT and fatal.request_id == rid
    assert "planted core bug" in fatal.detail and "ReleaseRequested" in fatal.detail
    assert p.drivers[RX].fatal is fatal and not handle.retired.is_set()  # everything stays held
    kinds = [e[1] for e in p.drivers[RX].recorder.events()]
    assert kinds.index("local_protocol_error") < kinds.index("fail_stop")  # recorded, then the stop
    assert p.drivers[RX].stats["local_protocol_errors"] == 1 and TX not in p.fatal


@pytest.mark.interpreted_only
@pytest.mark.timeout(30)
def test_the_core_bug_check_catches_a_driver_that_swallows_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the old driver, which counted a LocalProtocolError as "a race between API calls" and went on."""
    def swallow(self, event, exc) -> None:
        self.stats["local_protocol_errors"] += 1

    monkeypatch.setattr(Driver, "_core_bug", swallow)
    p = Pair()
    rid, handle = _planted_core_bug(p, monkeypatch)
    assert RX not in p.fatal and p.drivers[RX].fatal is None  # what the check above rules out
    assert p.drivers[RX].stats["local_protocol_errors"] == 1 and not handle.retired.is_set()


def _refused_send_with_a_ready_token(p: Pair):
    """A send whose request id is below this rank's watermark: the core refuses it as stale, with its
    (already ready) token's piece inside the refused OpenSend (``ready_pieces``: no input is left over
    for a session that never opened; until 2026-12-03 it was a SourceReady queued behind the open,
    which the driver had to drop)."""
    from kvown.runtime.commands import SetWatermark

    p.drivers[TX].submit(SetWatermark(2))
    p.run(steps=3)
    send = p.tx.send(make_request_id(1, 38), (0, 1))  # ready=None: a token that is ready at once
    p.run(steps=5)
    return send


@pytest.mark.timeout(30)
def test_a_refused_send_is_an_admission_error_not_a_fail_stop() -> None:
    p = Pair()
    send = _refused_send_with_a_ready_token(p)
    assert send.released.is_set() and "stale" in str(send.outcome.exception(0))
    assert not p.fatal and p.drivers[TX].stats["local_protocol_errors"] == 0


def _watermark_over_a_live_session(p: Pair):
    from kvown.runtime.commands import SetWatermark

    rid = make_request_id(1, 39)
    ticket = p.rx.submit_receive(rid, 2, (TX,))
    p.run(ticket.future.done, steps=5)
    p.drivers[RX].submit(SetWatermark(2))  # epoch 1 is still live here: the core would refuse it
    p.run(steps=3)
    return rid, ticket.future.result(0)


@pytest.mark.timeout(30)
def test_a_watermark_over_a_live_session_is_a_counted_no_op() -> None:
    p = Pair()
    rid, handle = _watermark_over_a_live_session(p)
    stats = p.drivers[RX].statistics()
    assert stats.counter("watermark_refused") == 1 and stats.counter("local_protocol_errors") == 0 and not p.fatal
    p.tx.send(rid, (0, 1))  # the session it would have cut off still completes
    p.run(handle.landed.is_set)
    p.rx.release(rid)
    p.run(handle.retired.is_set)
    assert handle.outcome.result(0) is Outcome.COMPLETED and not p.fatal


@pytest.mark.interpreted_only
@pytest.mark.timeout(30)
def test_the_watermark_check_catches_a_driver_that_hands_it_to_the_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the driver asks no core first: the receiver core refuses it, and that is our bug (rule 6a)."""
    from kvown.core.receiver import ReceiverCore

    monkeypatch.setattr(ReceiverCore, "watermark_refusal", lambda self, epoch: "")
    p = Pair()
    _watermark_over_a_live_session(p)
    assert p.fatal[RX].reason is FatalReason.INVARIANT and "WatermarkSet" in p.fatal[RX].detail


@pytest.mark.timeout(30)
def test_a_lend_to_a_rank_that_allocates_is_refused_naming_blocks() -> None:
    """Bad input past the API (a command built by hand): blocks= on a rank whose pool is kvown's own is a
    typed refusal on the ticket, the pool unchanged and the engine alive (the old driver called a
    ``lend`` the pool does not have and died of an AttributeError)."""
    p = Pair()
    free = p.drivers[RX].pool.statistics().free
    ticket = Ticket()
    p.drivers[RX].submit(Receive(make_request_id(1, 1), 2, (TX,), 1, False, ticket, blocks=(0, 1)))
    p.run(ticket.future.done, steps=5)
    error = ticket.future.exception(0)
    assert isinstance(error, LocalProtocolError) and error.field == "blocks"
    assert p.drivers[RX].pool.statistics().free == free and p.drivers[RX].fatal is None
    p.transfer(2)  # the rank still serves the next receive
