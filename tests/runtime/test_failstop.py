"""Fail-stop executor, kill route and retirement watchdog, with injected kill functions.

Real process deaths (SIGKILL of self, launcher SIGTERM dump) run in child processes.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import pytest

from kvown.adapters.mpi import PeerProcess, QualifiedWorld, process_start_ticks
from kvown.core.actions import FailStop, FatalReason
from kvown.runtime.failstop import ExitCode, FailStopExecutor, exit_code_for, propagate_hard_kill
from kvown.runtime.flight import FlightRecorder, read_flight_file
from kvown.runtime.watchdog import MAX_PERIOD_S, RetirementWatchdog

ROOT = Path(__file__).resolve().parents[2]
DEADLINE = FailStop(FatalReason.DEADLINE, 7, "claim unproven at deadline")


class FakeComm:
    def __init__(self, raises: BaseException | None = None) -> None:
        self.aborts: list[tuple[int, str]] = []
        self.raises = raises

    def Abort(self, code: int) -> None:
        self.aborts.append((code, threading.current_thread().name))
        if self.raises is not None:
            raise self.raises


def world(comm: FakeComm, peers: tuple[PeerProcess, ...] = ()) -> QualifiedWorld:
    return QualifiedWorld(comm=comm, rank=0, size=2, thread_level=3, peers=peers)


class KillLog:
    def __init__(self, raises: BaseException | None = None) -> None:
        self.calls: list[tuple[QualifiedWorld | None, ExitCode, float]] = []
        self.raises = raises

    def __call__(self, w: QualifiedWorld | None, code: ExitCode) -> None:
        self.calls.append((w, code, time.monotonic()))
        if self.raises is not None:
            raise self.raises


@pytest.fixture
def devnull_fd():
    fd = os.open(os.devnull, os.O_WRONLY)
    yield fd
    os.close(fd)


# --------------------------------------------------------------------------- exit codes


@pytest.mark.timeout(5)
def test_every_reason_has_a_distinct_exit_code() -> None:
    codes = {reason: exit_code_for(reason) for reason in FatalReason}
    assert len(set(codes.values())) == len(FatalReason)
    assert codes[FatalReason.DEADLINE] == 75 and codes[FatalReason.RANK_CRASH] == 137
    assert all(0 < int(c) < 256 for c in codes.values())


# --------------------------------------------------------------------------- executor


@pytest.mark.timeout(10)
def test_execute_dumps_then_kills_once_with_the_reason_code(tmp_path, devnull_fd) -> None:
    rec = FlightRecorder(rank=0)
    rec.record("publish", 7, dst_rank=1)
    kill = KillLog()
    w = world(FakeComm())
    ex = FailStopExecutor(w, rec, kill=kill, dump_dir=tmp_path, diag_fd=devnull_fd)
    ex.execute(DEADLINE)
    ex.execute(FailStop(FatalReason.HANG, None, "second"))  # latched: no-op
    assert ex.fired and len(kill.calls) == 1
    assert kill.calls[0][0] is w and kill.calls[0][1] is ExitCode.DEADLINE
    assert ex.action is DEADLINE
    header = read_flight_file(ex.dump_path)[0]
    assert (header["reason"], header["request_id"]) == ("deadline", 7)


@pytest.mark.timeout(10)
def test_diagnostic_line_goes_to_fd_not_logging(tmp_path) -> None:
    read_fd, write_fd = os.pipe()
    ex = FailStopExecutor(None, FlightRecorder(rank=0), kill=KillLog(), dump_dir=tmp_path, diag_fd=write_fd)
    ex.execute(DEADLINE)
    os.close(write_fd)
    line = os.read(read_fd, 4096).decode()
    os.close(read_fd)
    assert "FAIL-STOP" in line and "reason=deadline" in line and "request_id=7" in line
    assert "exit_code=75" in line and str(ex.dump_path) in line


@pytest.mark.timeout(10)
@pytest.mark.interpreted_only("subclasses FlightRecorder, a native class in the compiled build")
def test_blocked_dump_delays_kill_by_at_most_the_join_bound() -> None:
    release = threading.Event()

    class StuckRecorder(FlightRecorder):
        def dump(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            release.wait(5)
            raise OSError("disk gone")

    kill = KillLog()
    ex = FailStopExecutor(None, StuckRecorder(rank=0), kill=kill)
    t0 = time.monotonic()
    ex.execute(DEADLINE)
    elapsed = kill.calls[0][2] - t0
    release.set()
    assert 0.45 <= elapsed < 4.5  # the join bound (0.5 s) was kept; the stuck dump (5 s) was not waited for


@pytest.mark.timeout(10)
@pytest.mark.interpreted_only("subclasses FlightRecorder, a native class in the compiled build")
def test_failing_dump_still_kills(tmp_path, devnull_fd) -> None:
    class BrokenRecorder(FlightRecorder):
        def dump(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise OSError("read-only file system")

    kill = KillLog()
    ex = FailStopExecutor(None, BrokenRecorder(rank=0), kill=kill, diag_fd=devnull_fd)
    ex.execute(DEADLINE)
    assert len(kill.calls) == 1 and isinstance(ex.dump_error, OSError)


@pytest.mark.timeout(10)
def test_dump_thread_that_cannot_start_still_kills(monkeypatch) -> None:
    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    kill = KillLog()
    monkeypatch.setattr(threading.Thread, "start", refuse)
    ex = FailStopExecutor(None, FlightRecorder(rank=0), kill=kill, dump_join_s=30.0)  # constructing does not raise
    monkeypatch.undo()
    t0 = time.monotonic()
    ex.execute(DEADLINE)
    assert len(kill.calls) == 1 and kill.calls[0][1] is ExitCode.DEADLINE
    assert kill.calls[0][2] - t0 < 5 and ex.dump_path is None  # no diagnostics, no 30 s wait for them


@pytest.mark.timeout(10)
def test_fatal_path_starts_no_thread(tmp_path, devnull_fd, monkeypatch) -> None:
    """Thread.start waits unboundedly for the new thread to run; the fatal path must not need it."""
    kill = KillLog()
    ex = FailStopExecutor(None, FlightRecorder(rank=0), kill=kill, dump_dir=tmp_path, diag_fd=devnull_fd)

    def refuse(self: threading.Thread) -> None:
        raise AssertionError("thread started on the fatal path")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    ex.execute(DEADLINE)
    assert len(kill.calls) == 1 and ex.dump_path is not None and ex.dump_path.exists()


@pytest.mark.timeout(10)
def test_logger_blocked_forever_does_not_delay_the_kill(tmp_path, devnull_fd) -> None:
    """A handler wedged inside emit holds its lock; another thread holds logging's module lock."""
    entered, release = threading.Event(), threading.Event()

    class WedgedHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            entered.set()
            release.wait(30)

    log = logging.getLogger("kvown.test.wedged")
    handler = WedgedHandler()
    log.addHandler(handler)
    logger_thread = threading.Thread(target=log.error, args=("stuck",), daemon=True)
    logger_thread.start()
    assert entered.wait(2)
    logging._acquireLock()  # type: ignore[attr-defined]
    try:
        kill = KillLog()
        ex = FailStopExecutor(None, FlightRecorder(rank=0), kill=kill, dump_dir=tmp_path,
                              diag_fd=devnull_fd, dump_join_s=30.0)
        t0 = time.monotonic()
        ex.execute(DEADLINE)
        assert kill.calls and kill.calls[0][2] - t0 < 5  # neither the wedged logger (30 s) nor the join bound
        assert ex.dump_path is not None and ex.dump_path.exists()
    finally:
        logging._releaseLock()  # type: ignore[attr-defined]
        release.set()
        log.removeHandler(handler)
        logger_thread.join(2)


@pytest.mark.timeout(10)
def test_failed_kill_reopens_nothing_and_is_not_retried(devnull_fd) -> None:
    kill = KillLog(raises=RuntimeError("Abort failed"))
    ex = FailStopExecutor(None, None, kill=kill, diag_fd=devnull_fd)
    ex.execute(DEADLINE)  # never raises
    assert ex.fired and isinstance(ex.kill_error, RuntimeError)
    ex.execute(DEADLINE)
    assert ex.fired and len(kill.calls) == 1


@pytest.mark.timeout(10)
def test_captured_world_is_aborted_from_a_background_thread(monkeypatch, devnull_fd) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # any global MPI lookup would now fail
    kills: list[tuple[int, int]] = []
    comm = FakeComm()
    ex = FailStopExecutor(
        world(comm), None, kill=functools.partial(propagate_hard_kill, os_kill=lambda p, s: kills.append((p, s))),
        diag_fd=devnull_fd,
    )
    t = threading.Thread(target=ex.execute, args=(FailStop(FatalReason.INVARIANT, None, "INV"),), name="bg")
    t.start()
    t.join(5)
    assert comm.aborts == [(76, "bg")]
    # the fake Abort returned, which real MPI never does: the self-SIGKILL fallback still follows
    assert kills == [(os.getpid(), signal.SIGKILL)]


# --------------------------------------------------------------------------- kill route


@pytest.mark.timeout(10)
def test_abort_failure_sweeps_same_host_peers_then_self() -> None:
    import socket

    here = socket.gethostname()
    me = PeerProcess(0, here, os.getpid(), process_start_ticks(os.getpid()))
    live_peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        peers = (
            me,
            PeerProcess(1, here, live_peer.pid, process_start_ticks(live_peer.pid)),
            PeerProcess(2, here, live_peer.pid, -1),  # same PID, other start time: a reused PID, skip
            PeerProcess(3, "other-host", 4242, None),  # another host: not ours to kill
        )
        kills: list[tuple[int, int]] = []
        comm = FakeComm(raises=RuntimeError("MPI_ERR_OTHER"))
        propagate_hard_kill(world(comm, peers), ExitCode.DEADLINE, os_kill=lambda p, s: kills.append((p, s)))
        assert comm.aborts[0][0] == 75
        assert kills == [(live_peer.pid, signal.SIGKILL), (os.getpid(), signal.SIGKILL)]
    finally:
        live_peer.kill()
        live_peer.wait(5)


@pytest.mark.timeout(10)
def test_no_world_kills_only_self_and_never_raises() -> None:
    kills: list[tuple[int, int]] = []

    def failing_kill(pid: int, sig: int) -> None:
        kills.append((pid, sig))
        raise PermissionError

    propagate_hard_kill(None, ExitCode.HANG, os_kill=failing_kill)
    assert kills == [(os.getpid(), signal.SIGKILL)]


@pytest.mark.timeout(30)
def test_real_self_sigkill_without_mpi() -> None:
    code = textwrap.dedent(
        """
        from kvown.core.actions import FailStop, FatalReason
        from kvown.runtime.failstop import FailStopExecutor
        FailStopExecutor(None, None).execute(FailStop(FatalReason.DEADLINE, 1, "x"))
        print("still alive")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -signal.SIGKILL
    assert "still alive" not in proc.stdout
    assert "FAIL-STOP" in proc.stderr and "reason=deadline" in proc.stderr


@pytest.mark.timeout(30)
def test_sigterm_dump_runs_while_main_thread_is_stuck_in_c(tmp_path) -> None:
    code = textwrap.dedent(
        f"""
        import signal, sys
        signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGTERM}})  # before kvown starts any thread
        from kvown.runtime.failstop import install_sigterm_dump, sigterm_blocked_everywhere
        from kvown.runtime.flight import FlightRecorder
        rec = FlightRecorder(rank=5)
        install_sigterm_dump(rec, dump_dir={str(tmp_path)!r})
        rec.record("publish", 11, dst_rank=0)
        assert sigterm_blocked_everywhere() is True
        print("ready", flush=True)
        sys.stdin.read()  # blocked in a C read, as a rank is in a barrier
        print("not killed")
        """
    )
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}) as proc:
        try:
            assert proc.stdout.readline().strip() == "ready"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) == -signal.SIGKILL
        finally:
            proc.kill()
            proc.wait(5)
    dump = tmp_path / f"kvown-flight-rank5-pid{proc.pid}.jsonl"
    records = read_flight_file(dump)
    assert records[0]["reason"] == "terminated"
    assert [r["request_id"] for r in records if r["type"] == "event"][:1] == [11]


@pytest.mark.timeout(30)
def test_sigterm_coverage_check_sees_an_unblocked_thread() -> None:
    code = textwrap.dedent(
        """
        import signal, threading
        from kvown.runtime.failstop import sigterm_blocked_everywhere
        started = threading.Event()
        t = threading.Thread(target=lambda: (started.set(), threading.Event().wait(5)), daemon=True)
        t.start(); started.wait(5)  # created while SIGTERM is still deliverable
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        print(sigterm_blocked_everywhere())
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.strip() == "False", proc.stderr


# --------------------------------------------------------------------------- retirement watchdog


class StandInCore:
    """check_fatal says DEADLINE once ``now_ns`` reaches ``deadline_ns``; pure, as the real core."""

    def __init__(self, deadline_ns: int, request_id: int = 7) -> None:
        self.deadline_ns = deadline_ns
        self.request_id = request_id
        self.raises: BaseException | None = None
        self.seen: list[int] = []

    def check_fatal(self, now_ns: int) -> FailStop | None:
        self.seen.append(now_ns)
        if self.raises is not None:
            raise self.raises
        if now_ns >= self.deadline_ns:
            return FailStop(FatalReason.DEADLINE, self.request_id, "never settled")
        return None

    def next_deadline_ns(self) -> int | None:
        return self.deadline_ns


class RecordingExecutor:
    def __init__(self, lock: threading.Lock, raises: BaseException | None = None) -> None:
        self.lock = lock
        self.actions: list[FailStop] = []
        self.lock_held_during_execute: list[bool] = []
        self.delivered = threading.Event()
        self.raises = raises

    def execute(self, action: FailStop) -> None:
        self.lock_held_during_execute.append(self.lock.locked())
        self.actions.append(action)
        self.delivered.set()
        if self.raises is not None:
            raise self.raises


class FakeClock:
    def __init__(self) -> None:
        self.now_ns = 0

    def __call__(self) -> int:
        return self.now_ns


@pytest.mark.timeout(10)
def test_watchdog_delivers_outside_the_lock_once_then_parks() -> None:
    clock, lock = FakeClock(), threading.Lock()
    core, ex = StandInCore(deadline_ns=10**9), RecordingExecutor(lock)
    wd = RetirementWatchdog(core, lock, ex, clock=clock)
    assert wd.name == "kvown-retirement" and wd.daemon
    wd.start()
    time.sleep(0.05)
    assert ex.actions == [] and core.seen and all(t == 0 for t in core.seen)
    clock.now_ns = 10**9
    wd.wake()
    assert ex.delivered.wait(2)
    time.sleep(0.05)
    assert [a.request_id for a in ex.actions] == [7]
    assert ex.lock_held_during_execute == [False]
    assert wd.parked and wd.is_alive()
    wd.stop()  # ignored once fired: it stays parked
    wd.join(0.1)
    assert wd.is_alive() and len(ex.actions) == 1


@pytest.mark.timeout(10)
def test_watchdog_polls_at_least_every_10ms() -> None:
    lock = threading.Lock()
    # deadline far in the future: the wait is capped by the period, never by next_deadline_ns
    core = StandInCore(deadline_ns=time.monotonic_ns() + 10**12)
    wd = RetirementWatchdog(core, lock, RecordingExecutor(lock), period_s=1.0)
    wd.start()
    time.sleep(0.3)
    wd.stop()
    wd.join(1)
    assert MAX_PERIOD_S <= 0.010
    assert wd.checks >= 10  # 30 at the nominal cadence; loose for a loaded 2-core machine
    assert not wd.is_alive()


@pytest.mark.timeout(10)
def test_watchdog_fires_close_to_a_real_deadline() -> None:
    lock = threading.Lock()
    deadline_ns = time.monotonic_ns() + 100_000_000
    ex = RecordingExecutor(lock)
    RetirementWatchdog(StandInCore(deadline_ns), lock, ex).start()
    assert ex.delivered.wait(2)
    late_ms = (time.monotonic_ns() - deadline_ns) / 1e6
    assert 0 <= late_ms < 100


@pytest.mark.timeout(10)
def test_core_exception_is_an_engine_crash_fatal() -> None:
    lock = threading.Lock()
    core = StandInCore(deadline_ns=10**18)
    core.raises = KeyError("table")
    ex = RecordingExecutor(lock)
    RetirementWatchdog(core, lock, ex).start()
    assert ex.delivered.wait(2)
    assert ex.actions[0].reason is FatalReason.ENGINE_CRASH and "KeyError" in ex.actions[0].detail


@pytest.mark.timeout(10)
def test_failed_delivery_still_parks_and_keeps_roots_alive() -> None:
    lock = threading.Lock()
    core = StandInCore(deadline_ns=0)
    ex = RecordingExecutor(lock, raises=RuntimeError("kill failed"))
    wd = RetirementWatchdog(core, lock, ex)
    refs = [weakref.ref(core), weakref.ref(ex)]
    wd.start()
    assert ex.delivered.wait(2)
    del core, ex, wd
    gc.collect()
    time.sleep(0.05)
    assert all(r() is not None for r in refs)
    parked = [t for t in threading.enumerate() if isinstance(t, RetirementWatchdog) and t.core is refs[0]()]
    assert parked and isinstance(parked[0].delivery_error, RuntimeError)


@pytest.mark.timeout(10)
def test_watchdog_stop_without_fatal_ends_thread() -> None:
    lock = threading.Lock()
    wd = RetirementWatchdog(StandInCore(deadline_ns=10**18), lock, RecordingExecutor(lock))
    wd.start()
    wd.stop()
    wd.join(1)
    assert not wd.is_alive() and wd.fatal is None
