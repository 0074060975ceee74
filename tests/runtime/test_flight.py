"""Flight recorder: bounded ring, dump format, default location, and ``kvown inspect``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from kvown.core.actions import FatalReason
from kvown.apps.inspect import inspect_main
from kvown.runtime.flight import FLIGHT_DIR_ENV, FlightRecorder, read_flight_file


@pytest.mark.timeout(10)
def test_ring_is_bounded_and_counts_dropped_events() -> None:
    rec = FlightRecorder(rank=0, capacity=3)
    for i in range(5):
        rec.record("publish", i, dst_rank=1)
    events = rec.events()
    assert [e[2] for e in events] == [2, 3, 4]
    assert rec.dropped == 2
    assert events[0][1] == "publish" and events[0][3] == {"dst_rank": 1}


@pytest.mark.timeout(10)
def test_record_uses_injected_ns_clock() -> None:
    ticks = iter([100, 250])
    rec = FlightRecorder(rank=0, clock_ns=lambda: next(ticks))
    rec.record("a", None)
    rec.record("b", 1)
    assert [e[0] for e in rec.events()] == [100, 250]


@pytest.mark.timeout(20)
def test_concurrent_records_keep_the_bound() -> None:
    rec = FlightRecorder(rank=0, capacity=1000)

    def writer(base: int) -> None:
        for i in range(2000):
            rec.record("ev", base + i)

    threads = [threading.Thread(target=writer, args=(k * 10_000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(rec.events()) == 1000
    assert rec.dropped == 7000


@pytest.mark.timeout(10)
def test_dump_to_dir_names_rank_pid_reason_request_and_stacks(tmp_path) -> None:
    rec = FlightRecorder(rank=3)
    rec.record("publish", 42, dst_rank=1, deadline_ns=123)
    rec.record("odd", 42, obj=object())  # not JSON: written with repr, never raises
    path = rec.dump(tmp_path, FatalReason.DEADLINE, request_id=42, detail="claim unproven")
    assert path.name == f"kvown-flight-rank3-pid{os.getpid()}.jsonl"
    records = read_flight_file(path)
    header = records[0]
    assert header["type"] == "header"
    assert (header["rank"], header["pid"], header["reason"], header["request_id"]) == (
        3,
        os.getpid(),
        "deadline",
        42,
    )
    events = [r for r in records if r["type"] == "event"]
    assert events[0]["detail"] == {"dst_rank": 1, "deadline_ns": 123}
    assert events[1]["detail"]["obj"].startswith("<object object")
    stacks = [r for r in records if r["type"] == "stack"]
    names = {s["thread_name"] for s in stacks}
    assert threading.current_thread().name in names
    assert any("test_dump_to_dir" in f for s in stacks for f in s["frames"])


# A process primed so that the next tracked allocation starts a garbage collection, with cyclic garbage
# holding a ``threading.local`` (its cleanup takes the runtime's thread-list lock) and threads whose
# frames have no frame object yet (reading them allocates one while that lock is held).
PRIMED_FOR_A_COLLECTION = r"""
import gc, sys, threading, time
from kvown.runtime.flight import current_frames
read = current_frames if sys.argv[1] == "guarded" else sys._current_frames
target = int(sys.argv[2])
gc.disable()
stop = threading.Event()
for _ in range(3):
    threading.Thread(target=stop.wait, daemon=True).start()
time.sleep(0.1)
gc.set_threshold(100, 10, 10)
gc.collect()
cycle = []; cycle.append(cycle); cycle.append(threading.local()); del cycle
keep = []
gc.enable()
while gc.get_count()[0] < target:
    keep.append([])
sys.stdout.write(f"{len(read())} threads\n")
"""


def _read_frames_primed(mode: str, count: int) -> str:
    try:
        r = subprocess.run([sys.executable, "-c", PRIMED_FOR_A_COLLECTION, mode, str(count)],
                           capture_output=True, text=True, timeout=5)
    except subprocess.TimeoutExpired:
        return "hung"
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.timeout(120)
def test_reading_every_stack_never_deadlocks_in_a_garbage_collection() -> None:
    """cpython gh-106883: on 3.11 a collection inside ``sys._current_frames`` deadlocks with the GIL held,
    which once froze a test process with two fail-stop dumps under way. ``current_frames`` pauses the
    collector; the bare call, primed the same way, is the mutant and must hang."""
    counts = range(94, 101)  # the collection starts inside the read for some of these
    assert all(_read_frames_primed("guarded", n) == "4 threads" for n in counts)
    if sys.version_info < (3, 12):
        assert any(_read_frames_primed("bare", n) == "hung" for n in counts)


@pytest.mark.timeout(10)
def test_dump_without_stacks_to_explicit_file(tmp_path) -> None:
    rec = FlightRecorder(rank=0)
    target = tmp_path / "x.jsonl"
    assert rec.dump(target, "terminated", include_stacks=False) == target
    types = [r["type"] for r in read_flight_file(target)]
    assert types == ["header"]


@pytest.mark.timeout(10)
def test_default_dump_dir_comes_from_env(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(FLIGHT_DIR_ENV, str(tmp_path))
    path = FlightRecorder(rank=1).dump(None, FatalReason.HANG)
    assert path.parent == tmp_path and path.exists()


@pytest.mark.timeout(10)
def test_inspect_prints_readably(tmp_path, capsys) -> None:
    rec = FlightRecorder(rank=2)
    rec.record("publish", 9, dst_rank=0)
    path = rec.dump(tmp_path, FatalReason.DEADLINE, request_id=9, detail="never settled")
    assert inspect_main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "rank 2" in out and "reason: deadline" in out and "request: 9" in out
    assert "publish" in out and "dst_rank=0" in out and "never settled" in out
    assert "thread MainThread" in out


@pytest.mark.timeout(10)
def test_inspect_tolerates_a_dump_cut_short_and_rejects_junk(tmp_path, capsys) -> None:
    rec = FlightRecorder(rank=0)
    rec.record("publish", 1)
    path = rec.dump(tmp_path, FatalReason.INVARIANT, include_stacks=False)
    with open(path, "a") as f:
        f.write('{"type": "event", "t_n')  # the kill landed mid-line
    assert inspect_main([str(path)]) == 0
    junk = tmp_path / "junk.jsonl"
    junk.write_text(json.dumps({"type": "event"}) + "\n")
    assert inspect_main([str(junk)]) == 2
    assert inspect_main([str(tmp_path / "missing.jsonl")]) == 2
    assert inspect_main([]) == 2
    assert "not a readable flight recorder dump" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_inspect_of_a_stalled_writer_reads_as_a_post_mortem(tmp_path, capsys) -> None:
    """A real rank pair whose WRITE never completes, cancelled, then dumped: the report opens with the
    open session, its writer and the missing proof, then lists the events oldest first."""
    import time

    from kvown import KVLayout, TransferConfig, make_request_id
    from kvown.testing.local import KillRecorder, local_world

    layout = KVLayout.standard(num_layers=1, num_blocks=8, tokens_per_block=2, num_kv_heads=2, head_dim=8,
                               dtype="uint8")
    world = local_world({0: {"sender"}, 1: {"receiver"}}, layout=layout, kill=KillRecorder(),
                        config=TransferConfig(transfer_timeout_s=30.0), fault="")
    try:
        tx, rx = world[0], world[1]
        rid = make_request_id(2, 7)
        tx.inject_fault("stuck-writer:nth=1")
        h = rx.receiver.receive(rid, 1, (0,))
        tx.sender.send(rid, (3,))
        deadline = time.monotonic() + 10
        while tx.statistics().writes_in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        rx.receiver.cancel(rid)
        time.sleep(0.2)
        assert not h.retired.is_set()  # the stuck WRITE holds it
        path = rx.flight_dump(str(tmp_path), reason="operator")
    finally:
        for rt in world.values():
            rt.close()
    assert inspect_main([path]) == 0
    out = capsys.readouterr().out
    summary, _, events = out.partition("\nevents: ")
    assert "open at the dump: 1 session(s)" in summary and f"req {rid}" in summary
    assert "outcome cancelled" in summary and "missing proof: writer 0" in summary
    assert "rank 0 (cancel sent)" in summary and "last event" in summary and "draining" in summary
    ages = [float(line.split(" ms ")[0].replace("-", "")) for line in events.splitlines()[1:] if " ms  req " in line]
    assert len(ages) >= 4 and ages == sorted(ages, reverse=True)  # oldest first: ages shrink down the list
    assert inspect_main(["--json", path]) == 0
    report = json.loads(capsys.readouterr().out)[0]
    assert report["open_sessions_from"] == "cores" and report["open_sessions"][0]["missing"] == ["writer 0"]
