"""Thread stress over real NIXL in one process: API threads on every rank, the engine and watchdog threads,
short deadlines and many cancels. An honest world must end with 0 engine crashes, 0 fail-stops, 0
missed deadlines (a fatal that check_fatal reports but nobody executes), and every block back.

The 60-second run is ``slow``; CI runs a few seconds of the same load."""

from __future__ import annotations

import queue
import random
import threading
import time

import pytest

from kvown import KVLayout, TransferConfig, make_request_id
from kvown.cache.pool import PoolExhausted
from kvown.testing.local import KillRecorder, local_world

LAYOUT = KVLayout.standard(num_layers=1, num_blocks=64, tokens_per_block=4, num_kv_heads=2, head_dim=8,
                           dtype="bfloat16")
SENDERS, RECEIVERS = (0, 1), (2, 3)
# Short transfer timeouts, so sessions time out and drain all the time. The grace is what a writer has to
# answer a cancel after its receiver noticed the timeout; the timeout is anchored at the request deadline,
# so a receiver starved for 0.5 s (10 Python threads on 2 loaded cores) leaves the writer the rest. A
# world that truly lost an answer still fail-stops, 2 s later.
GRACE_S = 2.0


def stress(duration_s: float, seed: int = 0) -> dict[str, int]:
    kill = KillRecorder()
    world = local_world({**{r: {"sender"} for r in SENDERS}, **{r: {"receiver"} for r in RECEIVERS}},
                        layout=LAYOUT, config=TransferConfig(transfer_timeout_s=0.5, grace_s=GRACE_S), kill=kill)
    work: dict[int, queue.SimpleQueue] = {w: queue.SimpleQueue() for w in SENDERS}
    counts: dict[str, int] = {"received": 0, "cancelled_rx": 0, "cancelled_tx": 0, "missed_deadlines": 0,
                              "errors": 0}
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []
    seq = iter(range(1 << 30))

    def bump(name: str) -> None:
        with lock:
            counts[name] += 1

    def receiver_loop(rank: int, rng: random.Random) -> None:
        rx = world[rank].receiver
        live = []
        while not stop.is_set():
            writer = rng.choice(SENDERS)
            with lock:
                rid = make_request_id(1, next(seq))
            try:
                h = rx.receive(rid, rng.randint(1, 4), (writer,))
            except PoolExhausted:
                time.sleep(0.001)
                continue
            work[writer].put(rid)
            live.append(h)
            if rng.random() < 0.3:
                time.sleep(rng.uniform(0, 0.002))
                rx.cancel(rid)
                bump("cancelled_rx")
            for h in [h for h in live if h.landed.is_set() and not h.closing]:
                rx.release(h.request_id)
            live = [h for h in live if not h.retired.wait(0)]
            bump("received")
        for h in live:  # the end: cancel what is still open, so every block comes back
            rx.cancel(h.request_id)

    def sender_loop(rank: int, rng: random.Random) -> None:
        tx = world[rank].sender
        while not stop.is_set():
            try:
                rid = work[rank].get(timeout=0.01)
            except queue.Empty:
                continue
            h = tx.send(rid, tuple(rng.sample(range(LAYOUT.num_blocks), 1)))
            if rng.random() < 0.2:
                tx.cancel(rid)
                bump("cancelled_tx")
            h.released.wait(0)

    def monitor() -> None:
        """A fatal that check_fatal reports must have been handed to the kill route within 0.2 s."""
        seen: dict[int, float] = {}
        while not stop.is_set():
            for rank, rt in world.items():
                with rt.driver.lock:
                    fatal = rt.driver.check_fatal(time.monotonic_ns())
                if fatal is not None and rank not in seen:
                    seen[rank] = time.monotonic()
                if rank in seen and not kill.calls and time.monotonic() - seen[rank] > 0.2:
                    bump("missed_deadlines")
                    seen[rank] = float("inf")
            time.sleep(0.01)

    def guarded(fn, *args) -> None:  # type: ignore[no-untyped-def]
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(receiver_loop, r, random.Random(seed * 100 + r)))
               for r in RECEIVERS for _ in range(2)]
    threads += [threading.Thread(target=guarded, args=(sender_loop, w, random.Random(seed * 100 + w)))
                for w in SENDERS]
    threads.append(threading.Thread(target=guarded, args=(monitor,)))
    for t in threads:
        t.start()
    time.sleep(duration_s)
    stop.set()
    for t in threads:
        t.join(30)
    deadline = time.monotonic() + 10  # let the last cancels drain: every block must come back
    while time.monotonic() < deadline:
        if all(rt.engine.statistics().pool.free == LAYOUT.num_blocks for r, rt in world.items()
               if r in RECEIVERS):
            break
        time.sleep(0.05)
    stats = {r: rt.engine.statistics() for r, rt in world.items()}
    for rt in world.values():
        rt.close()
    fatal = [f"rank {r}: {s.fatal}" for r, s in stats.items() if s.fatal is not None]
    assert not errors, (errors[:3], fatal)
    counts["fail_stops"] = len(kill.calls)
    counts["engine_crashes"] = sum(s.counter("engine_crash") for s in stats.values())
    counts["fatal"] = sum(1 for s in stats.values() if s.fatal is not None)
    counts["blocks_not_free"] = sum(s.pool.total - s.pool.free for r, s in stats.items() if r in RECEIVERS)
    return counts


def _assert_clean(counts: dict[str, int]) -> None:
    assert counts["received"] > 50, counts
    assert counts["cancelled_rx"] > 0 and counts["cancelled_tx"] > 0, counts
    assert counts["fail_stops"] == 0 and counts["fatal"] == 0 and counts["engine_crashes"] == 0, counts
    assert counts["missed_deadlines"] == 0, counts
    assert counts["blocks_not_free"] == 0, counts


@pytest.mark.timeout(120)
def test_thread_stress_short() -> None:
    _assert_clean(stress(4.0))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_thread_stress_sixty_seconds() -> None:
    counts = stress(60.0, seed=1)
    print("thread stress, 60 s:", counts)  # the figures for the record (pytest -s)
    _assert_clean(counts)
