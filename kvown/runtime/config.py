"""Runtime configuration: every knob kvown reads, validated before anything starts.

Owns: ``TransferConfig`` (per-world settings) and ``PeerInfo`` (what each rank learns about another at
start-up).

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
    fault: str = field(default_factory=lambda: os.environ.get("KVOWN_FAULT", ""))  # fault injection
    # Prometheus /metrics on 127.0.0.1:(metrics_port + rank); 0 disables.
    metrics_port: int = field(default_factory=lambda: int(os.environ.get("KVOWN_METRICS_PORT", "0") or 0))

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
        for name in ("spin_s", "idle_sleep_s"):
            if not (0 <= getattr(self, name) <= 0.1):
                raise ConfigError("must be in [0, 0.1] seconds", field=name, value=getattr(self, name))

    def core_config(self, rank: int, peers: tuple[int, ...]) -> CoreConfig:
        timeout_ns = timeout_ns_from_s(self.transfer_timeout_s, field="transfer_timeout_s")
        grace = self.grace_s if self.grace_s is not None else self.transfer_timeout_s
        return CoreConfig(rank, timeout_ns, timeout_ns_from_s(grace, field="grace_s"), peers)


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """What one rank publishes about itself at start-up (exchanged by allgather or rendezvous)."""

    rank: int
    agent_name: str
    agent_metadata: bytes
    pool_addr: int
    pool_nbytes: int
    aux_addr: int
    geometry_digest: str
    protocol_version: int
    capabilities: tuple[str, ...]
    mem_kind: str  # "DRAM" or "VRAM"

    def to_wire(self) -> list:
        return [self.rank, self.agent_name, self.agent_metadata, self.pool_addr, self.pool_nbytes,
                self.aux_addr, self.geometry_digest, self.protocol_version, list(self.capabilities), self.mem_kind]

    @classmethod
    def from_wire(cls, obj: list) -> PeerInfo:
        rank, name, md, pool_addr, pool_nbytes, aux_addr, digest, version, caps, mem = obj
        return cls(rank, name, bytes(md), pool_addr, pool_nbytes, aux_addr, digest, version, tuple(caps), mem)
