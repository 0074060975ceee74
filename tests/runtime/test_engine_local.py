"""Engines in one process over real NIXL: write gating by ready tokens, statistics, fail-stop wiring."""

from __future__ import annotations

import time

import pytest
import torch

from kvown import KVLayout, Outcome, TransferConfig, WriteTracker, make_request_id
from kvown.kernels.nvfp4 import fill_pattern
from kvown.testing.local import KillRecorder, local_world

LAYOUT = KVLayout.standard(num_layers=2, num_blocks=32, tokens_per_block=16, num_kv_heads=2, head_dim=64,
                           dtype="bfloat16")


@pytest.fixture
def pair():
    kill = KillRecorder()
    world = local_world({0: {"sender"}, 1: {"receiver"}}, layout=LAYOUT,
                        config=TransferConfig(transfer_timeout_s=0.5, grace_s=0.5), kill=kill, fault="")
    yield world[0], world[1], kill
    for rt in world.values():
        rt.watchdog.stop()
        rt.engine.stop()


def expected_block(rid: int, j: int) -> torch.Tensor:
    t = torch.empty(LAYOUT.block_nbytes, dtype=torch.uint8)
    fill_pattern(t, rid, 0, j)
    return t


@pytest.mark.timeout(60)
def test_no_write_is_posted_before_the_producer_signals(pair):
    tx, rx, _ = pair
    rid = make_request_id(9, 1)
    token = WriteTracker("cpu").pending()
    h = rx.receiver.receive(rid, 2, (0,))
    hs = tx.sender.send(rid, (3, 4), ready=token)
    time.sleep(0.2)  # plenty of engine iterations: REQUEST_DATA arrived, the session is open
    assert tx.engine.statistics().counter("bytes_written") == 0
    assert tx.engine.call(lambda d: len(d._writes)) == 0
    assert not h.landed.is_set()
    for j, b in enumerate((3, 4)):  # the "KV write" happens now, then the producer signals
        fill_pattern(tx.engine.pool.block_view(b), rid, 0, j)
    token.signal()
    assert h.landed.wait(5)
    assert all(torch.equal(rx.engine.pool.block_view(b), expected_block(rid, j)) for j, b in enumerate(h.blocks))
    rx.receiver.release(rid)
    assert h.retired.wait(5) and hs.released.wait(5)
    assert hs.outcome.result(1) is Outcome.COMPLETED


@pytest.mark.timeout(60)
@pytest.mark.interpreted_only
def test_gating_mutant_is_caught(pair, monkeypatch):
    """If the sender ignored the ready token, the stale bytes would land: the check above has teeth."""
    from kvown.core import sender

    monkeypatch.setattr(sender.SenderCore, "_source_ready", lambda self, s, op: True)
    tx, rx, _ = pair
    rid = make_request_id(9, 2)
    token = WriteTracker("cpu").pending()
    h = rx.receiver.receive(rid, 1, (0,))
    tx.sender.send(rid, (7,), ready=token)
    assert h.landed.wait(5)  # landed before the producer wrote anything
    assert not torch.equal(rx.engine.pool.block_view(h.blocks[0]), expected_block(rid, 0))
    token.signal()
    rx.receiver.release(rid)
    assert h.retired.wait(5)


@pytest.mark.timeout(60)
def test_statistics_show_blocks_held_awaiting_proof(pair):
    tx, rx, _ = pair
    rid = make_request_id(9, 3)
    tx.engine.inject_fault("slow-writer:nth=1:ms=400")
    h = rx.receiver.receive(rid, 3, (0,))
    tx.sender.send(rid, (1, 2, 5))
    deadline = time.monotonic() + 5
    while tx.engine.statistics().writes_in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.002)
    rx.receiver.cancel(rid)
    time.sleep(0.05)
    stats = rx.engine.statistics()
    assert stats.receiver is not None and stats.receiver.sessions == 1
    assert stats.receiver.acks_pending == {rid: (0,)}
    assert stats.receiver.blocks_awaiting_proof == 3
    assert stats.receiver.oldest_fail_stop_deadline_ns is not None
    assert h.retired.wait(5)
    assert rx.engine.statistics().receiver.blocks_awaiting_proof == 0


@pytest.mark.timeout(60)
def test_a_stuck_writer_fail_stops_through_the_kill_route(pair):
    tx, rx, kill = pair
    rid = make_request_id(9, 4)
    tx.engine.inject_fault("stuck-writer:nth=1")
    h = rx.receiver.receive(rid, 1, (0,))
    tx.sender.send(rid, (9,))
    deadline = time.monotonic() + 5
    while not kill.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kill.calls and kill.calls[0][1] == 75  # ExitCode.DEADLINE
    assert not h.retired.is_set()  # never freed
    assert rx.engine.pool.statistics().free == LAYOUT.num_blocks - 1
    assert rx.executor.fired or tx.executor.fired
    from kvown import AdmissionError

    fatal_rank = rx if rx.engine.fail_stopping() is not None else tx
    assert fatal_rank.engine.fail_stopping() is not None
    with pytest.raises(AdmissionError):  # a fail-stopping rank admits nothing, at once
        (fatal_rank.receiver.receive(make_request_id(9, 8), 1, (0,)) if fatal_rank is rx
         else fatal_rank.sender.send(make_request_id(9, 8), (3,)))


@pytest.mark.timeout(60)
def test_prometheus_export_reads_the_live_state(pair):
    from prometheus_client import generate_latest

    from kvown.runtime.metrics import register

    tx, rx, _ = pair
    registry = register(rx.engine)
    rid = make_request_id(9, 5)
    tx.engine.inject_fault("slow-writer:nth=1:ms=300")
    h = rx.receiver.receive(rid, 2, (0,))
    tx.sender.send(rid, (1, 2))
    deadline = time.monotonic() + 5
    while tx.engine.statistics().writes_in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.002)
    rx.receiver.cancel(rid)
    time.sleep(0.05)
    text = generate_latest(registry).decode()
    assert 'kvown_pool_blocks{rank="1",state="held"} 2.0' in text
    assert 'kvown_acks_pending{rank="1"} 1.0' in text
    assert 'kvown_sessions{rank="1",role="receiver",state="draining"} 1.0' in text
    assert "kvown_fail_stop_deadline_seconds" in text
    assert h.retired.wait(5)
    text = generate_latest(registry).decode()
    assert 'kvown_pool_blocks{rank="1",state="held"} 0.0' in text


@pytest.mark.timeout(60)
def test_engine_cpu_is_the_engine_threads_own_clock(pair):
    """``engine_cpu_ns`` counts the engine thread alone: CPU burnt on another thread of the process is
    not in it (a process clock would be), work the engine does is, and a stopped engine reports None."""
    from prometheus_client import generate_latest

    from kvown.runtime.metrics import register

    tx, rx, _ = pair
    h = rx.receiver.receive(make_request_id(9, 11), 2, (0,))
    tx.sender.send(make_request_id(9, 11), (1, 2))
    assert h.landed.wait(5)
    time.sleep(0.05)  # past spin_s: the engine naps
    before = tx.statistics().engine_cpu_ns
    assert before is not None and before > 0
    process_before_ns = time.process_time_ns()
    burn_end_ns = time.thread_time_ns() + 300_000_000
    while time.thread_time_ns() < burn_end_ns:  # bounded: 0.3 s of this thread's CPU
        pass
    assert time.process_time_ns() - process_before_ns >= 300_000_000  # the mutant: a process clock sees it
    assert tx.statistics().engine_cpu_ns - before < 150_000_000
    text = generate_latest(register(tx)).decode()
    assert 'kvown_engine_cpu_seconds_total{rank="0"}' in text
    assert 'kvown_engine_busy_seconds_total{rank="0"}' in text
    tx.engine.stop()
    assert tx.statistics().engine_cpu_ns is None


@pytest.mark.timeout(60)
def test_engine_busy_counts_the_work_not_the_polling():
    """``engine_busy_ns`` grows with a session and stays put while the engine only polls (spin_s=0.1 keeps
    it polling, on a CPU, for 0.1 s after the session: counting every step would count that)."""
    world = local_world({0: {"sender"}, 1: {"receiver"}}, layout=LAYOUT, config=TransferConfig(spin_s=0.1))
    try:
        tx, rx = world[0], world[1]
        rid = make_request_id(9, 12)
        busy0 = tx.statistics().engine_busy_ns
        h = rx.receiver.receive(rid, 2, (0,))
        tx.sender.send(rid, (1, 2))
        assert h.landed.wait(5)
        rx.receiver.release(rid)
        assert h.retired.wait(5)
        idle = tx.statistics()
        assert idle.engine_busy_ns > busy0
        time.sleep(0.1)
        later = tx.statistics()
        polled_ns = later.engine_cpu_ns - idle.engine_cpu_ns
        assert polled_ns > 10_000_000  # it polled on a CPU meanwhile (what counting every step would count)
        assert later.engine_busy_ns - idle.engine_busy_ns < polled_ns // 4
    finally:
        for rt in world.values():
            rt.watchdog.stop()
            rt.engine.stop()


@pytest.mark.timeout(60)
def test_a_pending_local_copy_blocks_retirement_until_its_event(pair):
    tx, rx, _ = pair
    rid = make_request_id(9, 6)
    h = rx.receiver.receive(rid, 1, (0,))
    tx.sender.send(rid, (4,))
    assert h.landed.wait(5)
    copy_done = WriteTracker("cpu").pending()  # e.g. a scatter kernel from staging into the blocks
    rx.receiver.local_copy(rid, copy_done)
    rx.receiver.release(rid)
    time.sleep(0.1)
    assert not h.retired.is_set()  # the writer settled, the consumer released: the copy still blocks
    copy_done.signal()
    assert h.retired.wait(5)


@pytest.mark.timeout(60)
def test_a_block_id_beyond_the_peer_pool_is_refused_not_posted(pair):
    """A forged or buggy REQUEST_DATA naming blocks the peer does not have: nothing is written."""
    from kvown.core.events import MessageReceived
    from kvown.core.messages import Envelope, RequestData

    tx, _rx, _ = pair
    rid = make_request_id(9, 7)
    hs = tx.sender.send(rid, (1, 2))
    forged = RequestData(rid, 1, (5, LAYOUT.num_blocks + 3), 0, 1, -1)
    tx.engine.call(lambda e: (e._events.append((e.sender, MessageReceived(Envelope(1, 0, 10**6, forged)))), e._pump()))
    assert hs.released.wait(5)
    assert hs.outcome.result(1) is Outcome.FAILED
    assert tx.engine.statistics().counter("bytes_written") == 0


@pytest.mark.timeout(60)
def test_metrics_port_serves_prometheus_text():
    import socket
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    world = local_world({0: {"sender"}, 1: {"receiver"}}, layout=LAYOUT, config=TransferConfig(metrics_port=port))
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port + 1}/metrics", timeout=5).read().decode()
        assert 'kvown_pool_blocks{rank="1",state="free"}' in body
    finally:
        for rt in world.values():
            rt.watchdog.stop()
            rt.engine.stop()


def test_bad_metrics_port_is_a_config_error():
    from kvown import ConfigError

    with pytest.raises(ConfigError, match="metrics_port"):
        TransferConfig(metrics_port=70000)
