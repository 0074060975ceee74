"""The retirement clock of one session: request deadline, drain, and fail-stop deadline.

Owns: when a session was first exposed, when its drain started and why, and the two instants that
follow from them.

Rules:
  1. No clock runs before the first exposure (the first publication or the first posted write).
     ``request_deadline = exposed + timeout``; later exposures never move it.
  2. The first drain trigger wins (cancel, failure, in doubt, completion with acks outstanding,
     timeout). Later triggers cannot extend it.
  3. A transfer timeout starts the drain *at the request deadline*, not when it is noticed.
  4. ``fatal_deadline = drain_started + grace`` (or ``request_deadline + grace`` while no drain has
     started, because the timeout would start one then). The boundary is inclusive: at
     ``now >= fatal_deadline`` a claim still open is fatal, and evidence arriving at that instant can
     no longer retire anything.

Invariants:
  INV-D1: ``fatal_deadline_ns`` never increases once set.
  INV-D2: ``drain_started_ns`` is written at most once.
"""

from __future__ import annotations

import math

from kvown.core.errors import ConfigError

MAX_TIMEOUT_NS = 24 * 3600 * 10**9


def timeout_ns_from_s(value: object, *, field: str) -> int:
    """Validate a timeout given in seconds: finite and > 0 (0, negative, nan, inf are refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError("timeout must be a number of seconds", field=field, value=value)
    if not math.isfinite(value) or value <= 0:
        raise ConfigError("timeout must be finite and > 0", field=field, value=value, fix="use e.g. 5.0")
    ns = int(value * 1e9)
    if ns <= 0 or ns > MAX_TIMEOUT_NS:
        raise ConfigError("timeout out of range (1 ns .. 24 h)", field=field, value=value)
    return ns


class RetirementClock:
    __slots__ = ("timeout_ns", "grace_ns", "exposed_ns", "drain_started_ns", "drain_reason")

    def __init__(self, timeout_ns: int, grace_ns: int) -> None:
        self.timeout_ns = timeout_ns
        self.grace_ns = grace_ns
        self.exposed_ns: int | None = None
        self.drain_started_ns: int | None = None
        self.drain_reason = ""

    def expose(self, now_ns: int) -> None:
        if self.exposed_ns is None:
            self.exposed_ns = now_ns

    @property
    def request_deadline_ns(self) -> int | None:
        return None if self.exposed_ns is None else self.exposed_ns + self.timeout_ns

    @property
    def draining(self) -> bool:
        return self.drain_started_ns is not None

    def start_drain(self, now_ns: int, reason: str) -> bool:
        """First trigger wins (rule 2). Returns True if this call started the drain."""
        if self.drain_started_ns is not None:
            return False
        deadline = self.request_deadline_ns
        if deadline is not None and now_ns >= deadline:
            now_ns, reason = deadline, "transfer timeout"  # rule 3: anchored at the request deadline
        self.drain_started_ns = now_ns
        self.drain_reason = reason
        return True

    def timed_out(self, now_ns: int) -> bool:
        deadline = self.request_deadline_ns
        return deadline is not None and now_ns >= deadline

    @property
    def fatal_deadline_ns(self) -> int | None:
        if self.drain_started_ns is not None:
            return self.drain_started_ns + self.grace_ns
        deadline = self.request_deadline_ns
        return None if deadline is None else deadline + self.grace_ns
