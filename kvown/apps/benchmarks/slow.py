"""Slow sessions: a benchmark counts and reports a session that outruns its wait; it never crashes its world.

Rules:
  1. A wait for a handle's event (landed, retired, released) that takes longer than ``slow_s`` makes
     its session *slow*: recorded with its workload, request id, what it waited for and how long,
     then the wait goes on (a callback loop, which waits for no one session, ``note``s each lifetime). Slow sessions are left out of every latency percentile and reported on
     their own (``SlowSessions.report``); throughput figures include them (they are wall-clock).
  2. A wait for ``landed`` also ends when the session retired without landing (kvown's own deadline
     timed it out and it retired with proof): that session is slow, not an error.
  3. Only a wait longer than ``give_up_s`` raises. Callers set it past kvown's deadline + grace, by
     which time the runtime has retired the session or fail-stopped the world itself: a wait that
     outlives it is a broken kvown guarantee, not a slow session.
"""

from __future__ import annotations

import time
from typing import Any, Callable


class SlowSessionError(RuntimeError):
    """A wait outlived ``give_up_s`` (rule 3). Fields: workload, request_id, what, waited_s."""

    def __init__(self, workload: str, request_id: int, what: str, waited_s: float) -> None:
        super().__init__(f"{workload}: request {request_id:#x}: {what} did not happen in {waited_s:.1f} s "
                         f"(past kvown's deadline + grace: the runtime owed a retirement or a fail-stop)")
        self.workload, self.request_id, self.what, self.waited_s = workload, request_id, what, waited_s


class SlowSessions:
    """The slow sessions of one rank. Called: from the benchmark's main thread only."""

    def __init__(self, slow_s: float, give_up_s: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < slow_s < give_up_s:
            raise ValueError(f"need 0 < slow_s < give_up_s, got slow_s={slow_s} give_up_s={give_up_s}")
        self.slow_s, self.give_up_s = slow_s, give_up_s
        self.clock = clock
        self.waits: list[dict[str, Any]] = []
        self.ids: set[int] = set()

    def wait(self, workload: str, request_id: int, what: str, event: Any, instead: Any = None) -> bool:
        """Wait for ``event`` (or for ``instead`` to be set first, rule 2). True if ``event`` is set.
        Records the session when the wait passed ``slow_s`` (rule 1); raises only past ``give_up_s``."""
        t0 = self.clock()
        if _wait_any(event, instead, self.slow_s, self.clock):
            return event.is_set()
        done = _wait_any(event, instead, self.give_up_s - (self.clock() - t0), self.clock)
        waited_s = self.clock() - t0
        self.waits.append({"workload": workload, "request_id": request_id, "waited_for": what,
                              "waited_s": round(waited_s, 3), "happened": bool(event.is_set())})
        self.ids.add(request_id)
        if not done:
            raise SlowSessionError(workload, request_id, what, waited_s)
        return event.is_set()

    def note(self, workload: str, request_id: int, what: str, took_s: float) -> None:
        """A loop that waits for no single session (callbacks) reports each session's lifetime here after
        the fact: one longer than ``slow_s`` makes it slow (rule 1)."""
        if took_s > self.slow_s:
            self.waits.append({"workload": workload, "request_id": request_id, "waited_for": what,
                               "waited_s": round(took_s, 3), "happened": True})
            self.ids.add(request_id)

    def is_slow(self, request_id: int) -> bool:
        return request_id in self.ids

    def count(self, workload: str | None = None) -> int:
        """Slow sessions (each counted once, however many of its waits were slow)."""
        return len({s["request_id"] for s in self.waits if workload is None or s["workload"] == workload})

    def report(self, others: list[list[dict[str, Any]]] | None = None) -> dict[str, Any]:
        """The JSON record: this rank's slow waits plus ``others`` (the other ranks', gathered)."""
        waits = list(self.waits) + [s for rank in others or [] for s in rank]
        return {"count": len({s["request_id"] for s in waits}), "slow_s": self.slow_s,
                "give_up_s": self.give_up_s, "excluded_from_percentiles": True, "waits": waits}


def _wait_any(event: Any, instead: Any, timeout_s: float, clock: Callable[[], float]) -> bool:
    """Bounded: True once ``event`` or ``instead`` is set, False after ``timeout_s``."""
    if instead is None:
        return bool(event.wait(max(0.0, timeout_s)))
    end = clock() + timeout_s
    while not (event.is_set() or instead.is_set()):
        left = end - clock()
        if left <= 0:
            return False
        event.wait(min(left, 0.005))
    return True


__all__ = ["SlowSessionError", "SlowSessions"]
