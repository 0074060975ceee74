"""Rank-crash guard: when the embedding server's executor loop dies on one rank, kill the world.

Owns: the completion sentinel, the kill timer armed on a crash, the grace (``KVOWN_RANK_CRASH_GRACE_S``)
and the handover from that timer to an inline kill after cleanup.

Rules (``CrashGuard.run``):
  1. The completion sentinel is reset at the start of every run and set only by the loop, by calling
     ``guard.mark_completed()`` right before its single loop-terminating ``break``. A raise before that
     is a crash; a raise after it (e.g. from a context manager's ``__exit__``) is teardown: no kill.
  2. Only ``Exception`` counts as a crash. ``SystemExit`` / ``KeyboardInterrupt`` never arm anything.
  3. On a crash the kill timer (``RankCrashWatchdog``) is armed BEFORE cleanup runs, so a cleanup that
     blocks forever cannot stop the kill. A cleanup that raises cannot skip it either.
  4. After cleanup returns, the timer is cancelled and the same thread waits out the ORIGINAL deadline
     inline, then kills: one timer is live at a time, and the kill lands at crash + grace, never
     crash + 2 x grace. If the timer could not be armed, the inline wait uses a fresh full grace.
  5. ``error_delivered`` is checked AFTER the grace: if the error reached a client meanwhile, the rank
     is not stranding anyone and there is no kill.
  6. A single-rank world is exempt (its own death carries the error). A negative grace disables.
  7. Nothing in the guard raises; the loop's own exception propagates unchanged.

Invariants:
  INV-CG1  At most one kill per crashed run, at ``crash + grace`` (or at once if that has passed).
  INV-CG2  No kill for a clean run, a post-completion raise, a BaseException, a delivered error, a
           single rank, or a disabled grace.
"""

from __future__ import annotations

import math
import os
import threading
import time
import warnings
from typing import Callable

GRACE_ENV = "KVOWN_RANK_CRASH_GRACE_S"
DEFAULT_GRACE_S = 10.0

Wait = Callable[[threading.Event, float], bool]


def _event_wait(event: threading.Event, timeout_s: float) -> bool:
    return event.wait(timeout_s)


def parse_grace_s(raw: str | None) -> float | None:
    """Grace in seconds from the env text; None means disabled (a negative value).

    Unset or empty gives the default (10 s). Malformed, nan or +-inf also give the default, with a
    warning: nan would become a zero grace (instant kill) and inf a timer that never fires.
    Called: once per guard, any thread. After error: never raises.
    """
    if raw is None or raw.strip() == "":
        return DEFAULT_GRACE_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        warnings.warn(
            f"{GRACE_ENV}={raw!r} is not a finite number; using the default {DEFAULT_GRACE_S} s",
            RuntimeWarning,
            stacklevel=2,
        )
        return DEFAULT_GRACE_S
    return None if value < 0 else value


def grace_from_env() -> float | None:
    return parse_grace_s(os.environ.get(GRACE_ENV))


def kill_after_grace(
    kill: Callable[[], None],
    *,
    world_size: int,
    grace_s: float | None,
    deadline_s: float | None = None,
    cancelled: threading.Event | None = None,
    error_delivered: threading.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
    wait: Wait = _event_wait,
) -> bool:
    """Wait until ``deadline_s`` (default: now + grace), then ``kill()`` unless exempt. True if killed.

    Called: by ``RankCrashWatchdog`` (its thread) and inline by the guard after cleanup (loop thread).
    After error: never raises; a raising ``kill`` returns False.
    """
    try:
        if world_size <= 1 or grace_s is None:
            return False
        if deadline_s is None:
            deadline_s = clock() + grace_s
        remaining_s = deadline_s - clock()
        gate = cancelled if cancelled is not None else threading.Event()
        if remaining_s > 0:  # load-bearing: a negative wait must never be attempted
            if wait(gate, remaining_s):
                return False
        elif gate.is_set():
            return False
        if error_delivered is not None and error_delivered.is_set():
            return False
        kill()
        return True
    except BaseException:  # noqa: BLE001 - the guard never raises
        return False


class RankCrashWatchdog(threading.Thread):
    """Daemon timer: kills at ``deadline_s = clock() + grace`` (set at construction) unless cancelled."""

    def __init__(
        self,
        kill: Callable[[], None],
        *,
        world_size: int,
        grace_s: float,
        error_delivered: threading.Event | None = None,
        clock: Callable[[], float] = time.monotonic,
        wait: Wait = _event_wait,
    ) -> None:
        super().__init__(name="kvown-rank-crash", daemon=True)
        self._kill = kill
        self._world_size = world_size
        self.grace_s = grace_s
        self._error_delivered = error_delivered
        self._clock = clock
        self._wait = wait
        self.deadline_s = clock() + grace_s
        self.cancelled = threading.Event()
        self.killed = False

    def cancel(self) -> None:
        """Disarm this timer (only this one). Safe to call twice. Called: by the guard, loop thread."""
        self.cancelled.set()

    def run(self) -> None:
        self.killed = kill_after_grace(
            self._kill,
            world_size=self._world_size,
            grace_s=self.grace_s,
            deadline_s=self.deadline_s,
            cancelled=self.cancelled,
            error_delivered=self._error_delivered,
            clock=self._clock,
            wait=self._wait,
        )


def arm_rank_crash_watchdog(
    kill: Callable[[], None],
    *,
    world_size: int,
    grace_s: float | None,
    error_delivered: threading.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
    wait: Wait = _event_wait,
) -> RankCrashWatchdog | None:
    """Start a ``RankCrashWatchdog``; None (never raises) if single rank, disabled, or it cannot start."""
    if world_size <= 1 or grace_s is None:
        return None
    try:
        watchdog = RankCrashWatchdog(
            kill, world_size=world_size, grace_s=grace_s, error_delivered=error_delivered, clock=clock, wait=wait
        )
        watchdog.start()
        return watchdog
    except BaseException:  # noqa: BLE001
        return None


class CrashGuard:
    """Wraps one executor loop (reusable across runs: warmup, then serve)."""

    def __init__(
        self,
        kill: Callable[[], None],
        *,
        world_size: int,
        grace_s: float | None | str = "env",
        error_delivered: threading.Event | None = None,
        clock: Callable[[], float] = time.monotonic,
        wait: Wait = _event_wait,
        arm: Callable[..., RankCrashWatchdog | None] = arm_rank_crash_watchdog,
    ) -> None:
        self._kill = kill
        self.world_size = world_size
        self.grace_s = grace_from_env() if grace_s == "env" else grace_s
        # Set by whoever hands the stashed loop error to a client (the API layer).
        self.error_delivered = error_delivered if error_delivered is not None else threading.Event()
        self._clock = clock
        self._wait = wait
        self._arm = arm
        self._completed = False
        self.error: BaseException | None = None  # the last crash, for rank-local waiters
        self.cleanup_error: BaseException | None = None
        self.watchdog: RankCrashWatchdog | None = None
        self.killed = False

    def mark_completed(self) -> None:
        """The loop is about to leave through its one terminating ``break``.

        Called: by the loop, exactly once per run, immediately before that ``break``, loop thread.
        """
        self._completed = True

    def run(self, loop: Callable[["CrashGuard"], None], cleanup: Callable[[], None]) -> None:
        """Run ``loop(self)`` then ``cleanup()``; on a crash, make sure the world dies after the grace.

        Called: once per loop run, on the executor thread. Ownership: none taken.
        After error: the loop's exception is re-raised unchanged (also kept in ``self.error``); a
        cleanup error after a crash is kept in ``cleanup_error`` and does not mask it.
        """
        self._completed = False  # reset every run: a second run must not inherit the first's sentinel
        crashed = False
        try:
            loop(self)
        except Exception as exc:
            crashed = not self._completed
            if crashed:
                self.error = exc
            raise
        finally:
            self._finish(crashed, cleanup)

    def _finish(self, crashed: bool, cleanup: Callable[[], None]) -> None:
        watchdog = None
        kill_once = _Once(self._kill)  # timer and inline handover share it: one kill per crash
        if crashed:
            try:
                watchdog = self._arm(
                    kill_once,
                    world_size=self.world_size,
                    grace_s=self.grace_s,
                    error_delivered=self.error_delivered,
                    clock=self._clock,
                    wait=self._wait,
                )
            except BaseException:  # noqa: BLE001 - the guard never raises; inline kill still runs
                watchdog = None
            self.watchdog = watchdog
        try:
            cleanup()
        except Exception as exc:
            if not crashed:
                raise
            self.cleanup_error = exc
        finally:
            if crashed:
                deadline_s = None
                if watchdog is not None:
                    deadline_s = watchdog.deadline_s
                    watchdog.cancel()
                kill_after_grace(
                    kill_once,
                    world_size=self.world_size,
                    grace_s=self.grace_s,
                    deadline_s=deadline_s,
                    error_delivered=self.error_delivered,
                    clock=self._clock,
                    wait=self._wait,
                )
                self.killed = kill_once.called


class _Once:
    """Calls ``fn`` at most once, whichever thread asks first."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn
        self._latch = threading.Lock()

    @property
    def called(self) -> bool:
        return self._latch.locked()

    def __call__(self) -> None:
        if self._latch.acquire(blocking=False):
            self._fn()


def run_guarded(
    loop: Callable[[CrashGuard], None],
    cleanup: Callable[[], None],
    *,
    kill: Callable[[], None],
    world_size: int,
    **options: object,
) -> CrashGuard:
    """One-shot form of ``CrashGuard(kill, world_size=..., **options).run(loop, cleanup)``.

    Called: once, executor thread. After error: as ``CrashGuard.run`` (the loop's error propagates).
    """
    guard = CrashGuard(kill, world_size=world_size, **options)  # type: ignore[arg-type]
    guard.run(loop, cleanup)
    return guard
