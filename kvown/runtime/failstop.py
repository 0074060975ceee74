"""Fail-stop executor: carries out the core's ``FailStop`` action and kills the world.

Owns: the exit codes, the order of the fatal path, the kill route (``Abort`` on the captured
communicator, then a same-host SIGKILL sweep, then SIGKILL of self), and the launcher-SIGTERM dump.

Rules:
  0. ``request(action)`` wakes the executor's pre-started ``kvown-failstop`` thread and waits, bounded,
     for the kill to be dispatched, else executes it itself; the ``RankRuntime``'s exit hook does the
     same from the main thread, so no daemon thread is ever the only road to the kill.
  1. The fatal path runs on a kvown thread, never inside a core call, and blocks on nothing it does
     not bound: diagnostics (flight dump + one stderr line) run on a daemon thread started with the
     executor and are waited for at most ``dump_join_s`` (0.5 s); then the kill goes out regardless.
  2. The kill path never takes the logging lock nor flushes Python streams: its one diagnostic is an
     ``os.write`` to fd 2, on the bounded dump thread (a full stderr pipe blocks ``write``).
  3. ``Abort`` is called on the communicator captured by ``qualify_world``; ``MPI.COMM_WORLD`` is
     never looked up here (from a new thread it may be the wrong world).
  4. It fires at most once per executor. A kill that fails (``Abort`` raised, SIGKILL refused)
     changes nothing: ``fired`` stays True, nothing is retried, the core stays fatal, every
     resource stays held.

Invariants:
  INV-FS1  ``execute`` dispatches the kill exactly once, at most ``dump_join_s`` after it is called.
  INV-FS2  ``execute`` never raises (it runs on a thread where a raise would go nowhere).
  INV-FS3  Exit codes are distinct per ``FatalReason`` (see ``ExitCode``).
"""

from __future__ import annotations

import enum
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable

from kvown.adapters.mpi import QualifiedWorld, process_start_ticks, same_host_peers
from kvown.core.actions import FailStop, FatalReason
from kvown.runtime.flight import FlightRecorder

DUMP_JOIN_S = 0.5
_SIGWAIT_TIDS: set[int] = set()  # native ids of install_sigterm_dump's threads


class ExitCode(enum.IntEnum):
    """Process / ``mpirun`` exit code of a fail-stop, one per reason.

    75..78 sit in the BSD sysexits gap (64..78 are used, 75 is EX_TEMPFAIL, no collision with shells'
    126/127/128+N). RANK_CRASH keeps 137 (128 + SIGKILL), what operators already read as "killed".
    ``mpirun`` exits with the aborting rank's code. Two paths cannot choose their code: the SIGKILL
    fallback (the launcher reports signal 9 / 137) and the hang detector's C backstop
    (``faulthandler`` exits with 1).
    """

    DEADLINE = 75  # a claim was still unproven at its drain deadline
    INVARIANT = 76  # an INV-* check failed
    ENGINE_CRASH = 77  # an exception escaped a kvown thread
    HANG = 78  # the heartbeat lapsed (Python watcher)
    RANK_CRASH = 137  # the embedding server's executor loop died, or a rank left its program early
    CONTROL_LOST = 79  # a control frame could not be sent within the resend budget


def exit_code_for(reason: FatalReason) -> ExitCode:
    return ExitCode[reason.name]


KillRoute = Callable[[QualifiedWorld | None, ExitCode], None]


def propagate_hard_kill(
    world: QualifiedWorld | None,
    exit_code: ExitCode | int,
    *,
    os_kill: Callable[[int, int], None] = os.kill,
) -> None:
    """Kill the world: ``Abort(exit_code)`` on the captured communicator, else sweep and SIGKILL self.

    Called: once, from the fail-stop executor (or crash guard) on a background thread.
    After error: never raises. With real MPI and a real ``os_kill`` it does not return.
    Ownership: everything stays held; the process is expected to die.
    """
    if world is not None:
        try:
            world.comm.Abort(int(exit_code))
        except BaseException:  # noqa: BLE001 - any failure means: fall back to SIGKILL
            pass
        # Abort returned or raised: MPI could not do it. Kill what we know on this host.
        try:
            peers = same_host_peers(world)
        except BaseException:  # noqa: BLE001
            peers = []
        for peer in peers:
            try:
                # Skip a PID that now belongs to a different process (reused after the peer died).
                if peer.start_ticks is None or process_start_ticks(peer.pid) == peer.start_ticks:
                    os_kill(peer.pid, signal.SIGKILL)
            except BaseException:  # noqa: BLE001
                pass
    try:
        os_kill(os.getpid(), signal.SIGKILL)
    except BaseException:  # noqa: BLE001
        pass


class FailStopExecutor:
    """Executes a ``FailStop`` once: bounded diagnostics, then an unconditional kill."""

    def __init__(
        self,
        world: QualifiedWorld | None,
        recorder: FlightRecorder | None,
        *,
        kill: KillRoute | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        dump_dir: str | os.PathLike[str] | None = None,
        dump_join_s: float = DUMP_JOIN_S,
        diag_fd: int = 2,
    ) -> None:
        self.world = world
        self.recorder = recorder
        self._kill: KillRoute = kill if kill is not None else propagate_hard_kill
        self._clock = clock
        self._dump_dir = dump_dir
        self._dump_join_s = dump_join_s
        self._diag_fd = diag_fd
        self._latch = threading.Lock()  # acquired once, never released: the "fired" latch
        self.action: FailStop | None = None
        self.exit_code: ExitCode | None = None
        self.fired_at_ns: int | None = None
        self.kill_dispatched_at_ns: int | None = None
        self.dump_path: Path | None = None
        self.dump_error: BaseException | None = None
        self.kill_error: BaseException | None = None
        # The dump thread is started NOW, not on the fatal path: ``Thread.start`` waits, without a
        # bound, for the new thread to be scheduled, and on a starved machine that took 14 s once.
        self._go = threading.Event()
        self._dumped = threading.Event()
        self._dump_thread: threading.Thread | None = threading.Thread(
            target=self._dump_when_told, name="kvown-failstop-dump", daemon=True
        )
        try:
            self._dump_thread.start()
        except RuntimeError:  # cannot start threads: the fatal path will skip diagnostics and kill
            self._dump_thread = None
        self._requested: FailStop | None = None
        self._request_event = threading.Event()
        self._dispatched = threading.Event()
        self._worker: threading.Thread | None = threading.Thread(
            target=self._execute_when_requested, name="kvown-failstop", daemon=True
        )
        try:
            self._worker.start()
        except RuntimeError:
            self._worker = None

    @property
    def requested(self) -> FailStop | None:
        """The kill asked for by ``request`` (or executed), if any. Called: any thread."""
        return self._requested or self.action

    def request(self, action: FailStop, *, backstop_s: float | None = None) -> None:
        """Rule 0: have the world killed for ``action``; returns once the kill was dispatched or, if the
        worker did not dispatch it within ``backstop_s`` (default: dump bound + 1 s), after executing it
        on the calling thread. Called: by the engine and watchdog threads, and the exit hook.
        After error: never raises.
        """
        if self._requested is None:
            self._requested = action
        self._request_event.set()
        bound = self._dump_join_s + 1.0 if backstop_s is None else backstop_s
        if self._worker is None or not self._dispatched.wait(bound):
            self.execute(self._requested)

    def _execute_when_requested(self) -> None:
        while not self._request_event.wait(timeout=3600.0):  # parked until asked (daemon: never joined)
            pass
        if self._requested is not None:
            self.execute(self._requested)

    @property
    def fired(self) -> bool:
        return self._latch.locked()

    def execute(self, action: FailStop) -> None:
        """Fail-stop the world for ``action``. A second call (any thread) is a no-op.

        Called: at most once effectively, from a kvown watchdog thread (never the engine thread).
        Ownership: nothing is released, ever; the process is expected to die inside this call.
        After error: never raises; if the kill route fails, ``kill_error`` is set and ``fired`` stays
        True (nothing reopens, nothing is retried).
        """
        if not self._latch.acquire(blocking=False):
            return
        try:
            self.action = action
            self.exit_code = exit_code_for(action.reason)
            self.fired_at_ns = self._clock()
            self._run_bounded_diagnostics(action)
        except BaseException:  # noqa: BLE001 - diagnostics must never stand between us and the kill
            pass
        try:
            self.kill_dispatched_at_ns = self._clock()
            self._dispatched.set()
            self._kill(self.world, self.exit_code if self.exit_code is not None else ExitCode.ENGINE_CRASH)
        except BaseException as exc:  # noqa: BLE001
            self.kill_error = exc

    def _run_bounded_diagnostics(self, action: FailStop) -> None:
        if self._dump_thread is None:
            return
        self._go.set()
        self._dumped.wait(timeout=self._dump_join_s)

    def _dump_when_told(self) -> None:
        while not self._go.wait(timeout=3600.0):  # parked until the fatal path (daemon: never joined)
            pass
        try:
            if self.action is not None:
                self._diagnose(self.action)
        finally:
            self._dumped.set()

    def _diagnose(self, action: FailStop) -> None:
        rank = self.world.rank if self.world is not None else (self.recorder.rank if self.recorder else -1)
        if self.recorder is not None:
            try:
                self.dump_path = self.recorder.dump(
                    self._dump_dir, action.reason, True, request_id=action.request_id, detail=action.detail
                )
            except BaseException as exc:  # noqa: BLE001
                self.dump_error = exc
        line = (
            f"kvown FAIL-STOP rank={rank} pid={os.getpid()} reason={action.reason.value} "
            f"request_id={action.request_id} exit_code={int(exit_code_for(action.reason))} "
            f"flight={self.dump_path} detail={action.detail}\n"
        )
        os.write(self._diag_fd, line.encode("utf-8", "replace"))


def install_sigterm_dump(
    recorder: FlightRecorder,
    *,
    dump_dir: str | os.PathLike[str] | None = None,
    join_s: float = DUMP_JOIN_S,
    os_kill: Callable[[int, int], None] = os.kill,
) -> threading.Thread:
    """Dump ``recorder`` when the launcher sends SIGTERM (a peer's abort), then SIGKILL self.

    Why: a peer's ``MPI_Abort`` reaches this rank as SIGTERM from the launcher (then SIGKILL), often
    while its main thread sits in a C call (a barrier) where a Python signal handler never runs. Here
    SIGTERM is blocked and a dedicated thread waits for it with ``sigwait``, so the dump happens
    whatever the main thread is doing; the reason is written as ``"terminated"``.

    Called: once, from the main thread, with SIGTERM already blocked in every thread of the process.
    Threads inherit the mask from their creator, and importing ``kvown`` itself starts native threads
    (torch, MPI), so the entry point must run
    ``signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})`` as its first statement, before
    importing kvown. If some thread still has SIGTERM unblocked, the kernel may hand SIGTERM to it and
    the process dies at once with no dump: safe, only less informative. ``sigterm_blocked_everywhere``
    tells which case you are in.
    After error: the dump is bounded by ``join_s``; the process always SIGKILLs itself afterwards.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    go, done = threading.Event(), threading.Event()

    def dump_when_told() -> None:
        while not go.wait(timeout=3600.0):  # pre-started: no thread start after SIGTERM arrives
            pass
        try:
            recorder.dump(dump_dir, "terminated")
        finally:
            done.set()

    def wait_for_term() -> None:
        signal.sigwait({signal.SIGTERM})
        try:
            recorder.record("sigterm", None)
            go.set()
            done.wait(timeout=join_s)
        finally:
            os_kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=dump_when_told, name="kvown-sigterm-dump", daemon=True).start()

    thread = threading.Thread(target=wait_for_term, name="kvown-sigterm", daemon=True)
    thread.start()
    if thread.native_id is not None:
        _SIGWAIT_TIDS.add(thread.native_id)
    return thread


def sigterm_blocked_everywhere() -> bool | None:
    """True if every thread of this process blocks SIGTERM (so only a ``sigwait`` thread can take it).

    Reads each thread's ``SigBlk`` mask from ``/proc/self/task/*/status``, skipping the sigwait
    threads (while a thread waits in ``sigwait`` the kernel shows the waited signals unblocked there).
    None where /proc is missing.
    Called: after ``install_sigterm_dump``, to report whether the dump on SIGTERM is reliable.
    """
    bit = 1 << (signal.SIGTERM - 1)
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        if int(tid) in _SIGWAIT_TIDS:
            continue
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                mask = next((line.split()[1] for line in f if line.startswith("SigBlk:")), None)
        except OSError:
            continue  # the thread exited meanwhile
        if mask is not None and not int(mask, 16) & bit:
            return False
    return True
