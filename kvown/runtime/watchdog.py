"""Retirement watchdog: the thread that turns a core's fatal deadline into a fail-stop.

Owns: the ``kvown-retirement`` thread, its polling cadence, and delivery of the core's ``FailStop``
to the fail-stop executor.

Rules:
  1. It reads the core only through ``check_fatal(now_ns)`` and ``next_deadline_ns()``, both pure,
     and only while holding the engine's lock (the single-writer rule: the engine thread owns the
     core; this thread only looks). It never calls a backend (NIXL, MPI, CUDA).
  2. It evaluates at least every ``period_s`` (<= 10 ms), sooner when the core's next deadline is
     nearer, and at once when ``wake()`` is called.
  3. The ``FailStop`` is delivered OUTSIDE the lock, so the kill never waits for the engine thread,
     and at most once.
  4. After delivery the thread parks for good, holding references to the core, lock, executor and
     action, so nothing the claims point at can be collected even if the kill failed.
     ``stop()`` (for tests) ends it only if nothing fired.
  5. An exception from the core is itself fatal (``FatalReason.ENGINE_CRASH``), never logged and
     ignored.

Invariants:
  INV-WD1  ``executor.execute`` is called at most once per watchdog.
  INV-WD2  The lock is never held while ``executor.execute`` runs.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, ContextManager, Protocol

from kvown.core.actions import FailStop, FatalReason

MAX_PERIOD_S = 0.010
_PARK_S = 3600.0


class FatalSource(Protocol):
    def check_fatal(self, now_ns: int) -> FailStop | None: ...


class FatalSink(Protocol):
    def execute(self, action: FailStop) -> None: ...


class RetirementWatchdog(threading.Thread):
    """Polls ``core.check_fatal`` and hands a fatal to ``executor.execute``, once."""

    def __init__(
        self,
        core: FatalSource,
        lock: ContextManager[Any],
        executor: FatalSink,
        *,
        clock: Callable[[], int] = time.monotonic_ns,
        period_s: float = MAX_PERIOD_S,
    ) -> None:
        super().__init__(name="kvown-retirement", daemon=True)
        self.core = core
        self.lock = lock
        self.executor = executor
        self._clock = clock
        self._period_s = min(period_s, MAX_PERIOD_S)
        self._wake = threading.Event()
        self._stop_requested = threading.Event()
        self.fatal: FailStop | None = None
        self.delivery_error: BaseException | None = None
        self.checks = 0  # evaluations so far (tests and diagnostics)

    def wake(self) -> None:
        """Evaluate now. Called: by the engine thread after a state change, any number of times."""
        self._wake.set()

    def stop(self) -> None:
        """End the thread if it has not fired. Called: by tests / orderly shutdown, once."""
        self._stop_requested.set()
        self._wake.set()

    @property
    def parked(self) -> bool:
        return self.fatal is not None

    def run(self) -> None:
        while not self._stop_requested.is_set():
            action, wait_s = self._evaluate()
            if action is not None:
                self._deliver(action)
                self._park()
                return
            self._wake.wait(timeout=wait_s)
            self._wake.clear()

    def _evaluate(self) -> tuple[FailStop | None, float]:
        try:
            with self.lock:
                now_ns = self._clock()
                action = self.core.check_fatal(now_ns)
                next_ns = self.core.next_deadline_ns() if hasattr(self.core, "next_deadline_ns") else None
        except BaseException as exc:  # noqa: BLE001 - an escaping exception is fatal, not logged
            return FailStop(FatalReason.ENGINE_CRASH, None, f"check_fatal raised {exc!r}"), 0.0
        finally:
            self.checks += 1
        wait_s = self._period_s
        if next_ns is not None and next_ns > now_ns:  # a passed deadline is not a reason to spin
            wait_s = min(wait_s, (next_ns - now_ns) / 1e9)
        return action, wait_s

    def _deliver(self, action: FailStop) -> None:
        self.fatal = action
        try:
            self.executor.execute(action)
        except BaseException as exc:  # noqa: BLE001 - a failed kill reopens nothing; we still park
            self.delivery_error = exc

    def _park(self) -> None:
        # Parked for good: this frame and ``self`` keep core, lock, executor and action reachable.
        roots = (self.core, self.lock, self.executor, self.fatal)
        while roots:
            time.sleep(_PARK_S)
