"""Runtime configuration: every knob kvown reads, validated before anything starts.

Owns: ``TransferConfig`` (per-world settings). What ranks learn about each other at start-up is
``kvown.adapters.transport.PeerInfo``.

Rules:
  1. Timeouts are seconds in the API and integer nanoseconds in the core; both conversions refuse
     0, negatives, nan and inf with a ``ConfigError`` naming the field.
  2. ``grace_s`` (how long a drain may take before unproven claims fail-stop the world) is its own knob;
     it defaults to ``transfer_timeout_s``, so the worst case from first exposure to fail-stop is
     ``transfer_timeout_s + grace_s``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvown.core.deadline import timeout_ns_from_s
from kvown.core.errors import ConfigError
from kvown.core.machine import CoreConfig


def _port_from_env(name: str) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return 0
    try:
        return int(raw)
    except ValueError:
        raise ConfigError("must be a TCP port number (or empty to disable)", field=name, value=raw) from None


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Settings shared by every rank of a kvown world."""

    transfer_timeout_s: float = 10.0  # request deadline, from first exposure
    grace_s: float | None = None  # drain budget before fail-stop; None means transfer_timeout_s
    progress_thread: bool = False  # NIXL progress thread (keep off on machines with few cores)
    aux_slot_nbytes: int = 64  # bytes of the auxiliary payload (first tokens, counts) per request
    aux_slots: int = 1024  # auxiliary slots per rank
    flight_capacity: int = 4096  # events kept by the flight recorder
    spin_s: float = 0.002  # keep yield-polling this long after the last progress
    idle_sleep_s: float = 200e-6  # then nap this long between polls (0: never nap, only sched_yield)
    # a rank with nothing open naps twice as long each time, up to this (engine rule 3; at least idle_sleep_s)
    idle_sleep_max_s: float = 0.01
    # Prometheus /metrics on 127.0.0.1:(metrics_port + rank); 0 disables.
    metrics_port: int = field(default_factory=lambda: _port_from_env("KVOWN_METRICS_PORT"))
    canary: bool = False  # stamp retired blocks and verify them before reuse (kvown.cache.canary)
    control_retry_s: float = 1.0  # resend a control frame whose send raised for this long, then fail-stop
    # A single-operation stream's report rides on its WRITE as the NIXL notification (sender rule 6).
    carry_results: bool = True
    # A step's carried WRITEs to one peer go as one transfer whose notification carries each report
    # (driver rule 3a): one post, status check and notification for up to MAX_CARRIED sessions.
    coalesce_writes: bool = True
    # kvown's own CPU pool asks for transparent huge pages (kvown.cache.hostmem rule 2); False: base pages.
    huge_pages: bool = True

    def __post_init__(self) -> None:
        timeout_ns_from_s(self.transfer_timeout_s, field="transfer_timeout_s")
        if self.grace_s is not None:
            timeout_ns_from_s(self.grace_s, field="grace_s")
        for name in ("aux_slot_nbytes", "aux_slots", "flight_capacity"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ConfigError("must be a positive integer", field=name, value=value)
        if type(self.metrics_port) is not int or not (0 <= self.metrics_port < 65536):
            raise ConfigError("metrics_port must be 0 (off) or a TCP port", field="metrics_port", value=self.metrics_port)
        for name in ("carry_results", "coalesce_writes", "huge_pages", "canary"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False", field=name, value=getattr(self, name))
        timeout_ns_from_s(self.control_retry_s, field="control_retry_s")
        for name in ("spin_s", "idle_sleep_s", "idle_sleep_max_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 0.1:
                raise ConfigError("must be in [0, 0.1] seconds", field=name, value=value)

    def core_config(self, rank: int, peers: tuple[int, ...]) -> CoreConfig:
        timeout_ns = timeout_ns_from_s(self.transfer_timeout_s, field="transfer_timeout_s")
        grace = self.grace_s if self.grace_s is not None else self.transfer_timeout_s
        return CoreConfig(rank, timeout_ns, timeout_ns_from_s(grace, field="grace_s"), peers)
