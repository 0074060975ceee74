"""The engine: the one thread per rank that runs the rank's ``Driver``.

Owns: the ``kvown-engine-r{rank}`` thread, its spin-then-nap cadence, and the turn of an escaping
exception into a fail-stop. All protocol work lives in ``kvown.runtime.driver``; the simulator runs
the same driver without this thread.

Rules:
  1. Single writer: only this thread calls ``driver.step``. API threads ``submit`` commands (which
     also wakes a napping engine) and read the driver's immutable ``view``; the retirement watchdog
     reads the driver's pure state under ``driver.lock``.
  2. Nothing escapes the loop: an exception in ``step`` becomes FailStop(ENGINE_CRASH) whose detail
     and flight-recorder entry carry the full traceback, handed to the fail-stop executor at once.
     After any fail-stop the thread parks, keeping every root alive and touching nothing.
  3. Without a NIXL progress thread nothing wakes us for an incoming notification, so after progress
     the loop keeps polling (``os.sched_yield`` between steps) for ``spin_s``, then naps
     ``idle_sleep_s`` at a time until a command arrives or something moves. Each nap wakes the thread and
     takes the GIL from the code beside it, so a quiet rank (``Driver.quiet``: nothing open) naps twice
     as long each time, up to ``idle_sleep_max_s``; a command still wakes it at once.
  4. ``busy_ns`` adds up the steps that moved something (their work, not the polling: a spinning engine
     is always on a CPU); it reuses the clock reads the loop makes anyway.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, Callable

from kvown.core.actions import FailStop, FatalReason
from kvown.runtime.commands import Call, Command, LiveRequests, ReceiveHandle
from kvown.runtime.driver import Driver
from kvown.runtime.statistics import Statistics
from kvown.runtime.view import RankView


STALL_NS = 20_000_000  # a turn of the loop longer than its nap by this much is recorded as a stall


class Engine:
    """The thread around one ``Driver``. Build it with ``kvown.rank``; start it with ``start()``."""

    def __init__(
        self,
        driver: Driver,
        *,
        fail_stop: Callable[[FailStop], None],
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.driver = driver
        self.live = LiveRequests()  # the API's duplicate-id check (kvown.api); never read by the loop
        self.clock = clock
        self._fail_stop = fail_stop
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.busy_ns = 0  # wall time inside steps that moved something (engine thread writes, others read)
        self.thread = threading.Thread(target=self._run, name=f"kvown-engine-r{driver.rank}", daemon=True)

    # ---- any thread ---------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.driver.rank

    @property
    def pool(self) -> Any:
        return self.driver.pool

    @property
    def view(self) -> RankView:
        """The rank's immutable view (peers, geometry, aux): what API threads validate against."""
        return self.driver.view

    def wait_view(self, predicate: Callable[[RankView], bool], timeout_s: float) -> tuple[bool, RankView]:
        """Wait (bounded) for a view that satisfies ``predicate``. Called: any thread but the engine's."""
        return self.driver.views.wait_until(predicate, timeout_s)

    def read_aux(self, handle: ReceiveHandle) -> bytes:
        """The aux payload of a landed receive (its slot is not reused before retirement)."""
        return self.driver.read_aux(handle)

    @property
    def fatal(self) -> FailStop | None:
        return self.driver.fatal

    def on_engine_thread(self) -> bool:
        """True when called from this engine's thread (a handle callback): it must not wait for itself."""
        return threading.get_ident() == self.thread.ident

    def start(self) -> None:
        self.thread.start()

    def submit(self, command: Command) -> None:
        """Queue a command and wake the loop. Called: by API facades, any thread."""
        self.driver.submit(command)
        if not self._wake.is_set():  # a spinning engine leaves it set: no Condition round per command
            self._wake.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop (orderly shutdown). Called: once, any thread but the engine's."""
        self._stop.set()
        self._wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout_s)

    def call(self, fn: Callable[[Driver], Any], timeout_s: float = 10.0) -> Any:
        """Run ``fn(driver)`` on the engine thread and return its result (tests, diagnostics, faults)."""
        if self.on_engine_thread():
            return fn(self.driver)  # already there: waiting for our own next step would never end
        future: Future = Future()
        self.submit(Call(fn, future))
        return future.result(timeout_s)

    def inject_fault(self, plan: str) -> None:
        """Replace the fault plan of this rank's ``FaultyTransport`` (tests). Needs a ``wrap_transport`` one."""

        def apply(driver: Driver) -> None:
            if not hasattr(driver.transport, "set_plan"):
                raise RuntimeError("no fault injection on this rank: start it with wrap_transport=fault_wrapper('')")
            driver.transport.set_plan(plan)

        self.call(apply)

    def fail_stopping(self) -> FailStop | None:
        """The fail-stop this rank latched or is due to latch now, if any. Called: any thread."""
        driver = self.driver
        if driver.fatal is not None:
            return driver.fatal
        if self.clock() < driver.earliest_deadline_ns:  # nothing can be due yet (driver rule 7): no lock
            return None
        with driver.lock:
            return driver.check_fatal(self.clock())

    def statistics(self) -> Statistics:
        return replace(self.driver.statistics(), engine_cpu_ns=self.cpu_ns(), engine_busy_ns=self.busy_ns)

    def cpu_ns(self) -> int | None:
        """CPU time the engine thread has used so far (its own clock, not the process's), or None while it
        is not running or where the OS has no per-thread clock. Called: any thread; one system call."""
        ident = self.thread.ident
        if ident is None or not self.thread.is_alive():
            return None
        try:
            return time.clock_gettime_ns(time.pthread_getcpuclockid(ident))
        except (AttributeError, OSError):  # no pthread_getcpuclockid here, or the thread just ended
            return None

    # ---- the loop (engine thread) ---------------------------------------------------------------

    def _run(self) -> None:
        driver = self.driver
        try:
            spin_ns = int(driver.config.spin_s * 1e9)
            first_nap_s = driver.config.idle_sleep_s
            max_nap_s = max(first_nap_s, driver.config.idle_sleep_max_s)
            nap_s, slept_ns = first_nap_s, 0
            last_progress_ns = step_ns = self.clock()
            while not self._stop.is_set():
                now_ns = self.clock()
                if now_ns - step_ns > STALL_NS + slept_ns:  # post-mortem evidence: starved, not napping
                    driver.recorder.record("engine_stall", None, gap_us=(now_ns - step_ns) // 1000)
                moved = driver.step(now_ns, slept_ns > 0)  # after a nap its frames are older than a command
                step_ns, slept_ns = now_ns, 0
                if driver.fatal is not None:
                    return self._park()
                if moved:
                    last_progress_ns = self.clock()
                    self.busy_ns += last_progress_ns - now_ns
                    nap_s = first_nap_s
                elif not first_nap_s or self.clock() - last_progress_ns < spin_ns:
                    os.sched_yield()
                else:
                    self._wake.wait(nap_s)
                    self._wake.clear()
                    slept_ns = int(nap_s * 1e9)
                    nap_s = min(2 * nap_s, max_nap_s) if driver.quiet() else first_nap_s  # rule 3
        except BaseException as exc:  # rule 2: nothing escapes as log-and-continue
            text = traceback.format_exc()
            driver.recorder.record("engine_crash", None, error=repr(exc), traceback=text)
            action = FailStop(FatalReason.ENGINE_CRASH, None, f"engine thread raised {exc!r}\n{text}")
            driver.fatal = driver.fatal or action
            self._fail_stop(action)
            self._park()

    def _park(self) -> None:
        roots = (self.driver,)
        while roots and not self._stop.is_set():
            self._stop.wait(0.05)


__all__ = ["Engine"]
