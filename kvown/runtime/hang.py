"""Hang detector: a heartbeat the engine loop calls; when it lapses, dump every stack and kill the world.

Owns: the heartbeat deadline, the ``kvown-hang`` watcher thread, and the process-wide
``faulthandler`` backstop timer.

Two tiers (docs/design.md section 14): the Python watcher (stacks into the flight recorder, then
``FatalReason.HANG``; needs the GIL) and the C backstop ``faulthandler.dump_traceback_later(timeout +
margin, exit=True)``, which needs no GIL but can only print tracebacks and ``_exit(1)``.

Rules:
  1. ``heartbeat`` is cheap: one clock read and one attribute store, plus, at most every
     ``rearm_interval_s``, one ``faulthandler`` re-arm (a re-arm restarts a C thread timer; doing it
     on every iteration would cost more than the loop).
  2. Detection is disarmed until the first heartbeat and inside ``pause()`` (which does not nest).
  3. The margin exceeds the re-arm interval, so the C tier never fires before the Python tier could
     have (it fires at ``last heartbeat + timeout + margin - rearm_interval`` at the earliest).
  4. ``faulthandler``'s timer is process-global: one detector with ``c_backstop=True`` per process.
  5. The watcher survives a failing report; each armed deadline is reported at most once.

Invariants:
  INV-HD1  No report while disarmed (before the first heartbeat, or inside ``pause()``).
  INV-HD2  At most one report per heartbeat deadline.
"""

from __future__ import annotations

import contextlib
import faulthandler
import sys
import threading
import time
from typing import Any, Callable, Iterator, TextIO

from kvown.core.actions import FailStop, FatalReason
from kvown.core.errors import ConfigError
from kvown.runtime.flight import FlightRecorder, thread_stacks

DEFAULT_TIMEOUT_S = 300.0


class HangDetector:
    """Heartbeat-driven hang detection with a Python watcher and a ``faulthandler`` backstop."""

    def __init__(
        self,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        executor: Any = None,
        recorder: FlightRecorder | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        poll_s: float | None = None,
        c_backstop: bool = True,
        margin_s: float | None = None,
        rearm_interval_s: float | None = None,
        backstop_file: TextIO | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ConfigError("hang timeout must be positive", field="timeout_s", timeout_s=timeout_s)
        self.timeout_s = timeout_s
        self._timeout_ns = int(timeout_s * 1e9)
        self._executor = executor
        self._recorder = recorder
        self._clock = clock
        self._poll_s = poll_s if poll_s is not None else min(1.0, timeout_s / 10)
        self._c_backstop = c_backstop
        self.rearm_interval_s = rearm_interval_s if rearm_interval_s is not None else min(1.0, timeout_s / 4)
        self.margin_s = margin_s if margin_s is not None else max(1.0, 2 * self.rearm_interval_s)
        self._rearm_ns = int(self.rearm_interval_s * 1e9)
        self._backstop_file = backstop_file
        self._deadline_ns: int | None = None  # None = disarmed
        self._last_rearm_ns: int | None = None
        self._reported_deadline_ns: int | None = None
        self._stop = threading.Event()
        self.reports = 0
        self.report_errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._watch, name="kvown-hang", daemon=True)

    def start(self) -> "HangDetector":
        """Start the watcher. Called: once, at engine start, any thread. After error: RuntimeError."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching and cancel the C timer. Called: at orderly shutdown / in tests, once."""
        self._deadline_ns = None
        self._stop.set()
        if self._c_backstop:
            faulthandler.cancel_dump_traceback_later()
        if self._thread.is_alive():
            self._thread.join(timeout=self._poll_s + 1.0)

    def heartbeat(self) -> None:
        """The loop is alive. Called: every engine iteration (several times is fine), engine thread.

        After error: cannot fail.
        """
        now_ns = self._clock()
        self._deadline_ns = now_ns + self._timeout_ns
        if self._c_backstop and (self._last_rearm_ns is None or now_ns - self._last_rearm_ns >= self._rearm_ns):
            self._rearm_backstop(now_ns)

    def _rearm_backstop(self, now_ns: int) -> None:
        self._last_rearm_ns = now_ns
        faulthandler.dump_traceback_later(
            self.timeout_s + self.margin_s, repeat=False, file=self._backstop_file or sys.stderr, exit=True
        )

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Disarm both tiers for a known long wait (e.g. idle with no requests); re-arm on exit.

        Called: by the engine thread; does not nest.
        """
        self._deadline_ns = None
        if self._c_backstop:
            faulthandler.cancel_dump_traceback_later()
            self._last_rearm_ns = None
        try:
            yield
        finally:
            self.heartbeat()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            deadline_ns = self._deadline_ns
            if deadline_ns is None or deadline_ns == self._reported_deadline_ns:
                continue
            if self._clock() > deadline_ns:
                self._reported_deadline_ns = deadline_ns
                self._report(deadline_ns)

    def _report(self, deadline_ns: int) -> None:
        self.reports += 1
        detail = f"no heartbeat for {self.timeout_s} s"
        try:
            if self._recorder is not None:
                stacks = {s["thread_name"]: s["frames"] for s in thread_stacks()}
                self._recorder.record("hang", None, deadline_ns=deadline_ns, timeout_s=self.timeout_s, stacks=stacks)
        except BaseException as exc:  # noqa: BLE001 - the kill must still happen
            self.report_errors.append(exc)
        try:
            if self._executor is not None:
                self._executor.execute(FailStop(FatalReason.HANG, None, detail))
        except BaseException as exc:  # noqa: BLE001 - the watcher survives
            self.report_errors.append(exc)
