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
from typing import Any

import msgpack

from kvown.core.deadline import timeout_ns_from_s
from kvown.core.errors import ConfigError, PeerProtocolError
from kvown.core.machine import CoreConfig
from kvown.core.messages import MAX_NBYTES, _digest, _int_in, _names, _rank, _short


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
    def from_wire(cls, obj: Any) -> PeerInfo:
        """Validate a peer's start-up record (the list ``to_wire`` made).

        Called: once per peer at start-up, main thread. A peer's bytes are untrusted even inside one
        job (another release, a bug), so every field is checked as a control frame's would be.
        After error: ``PeerProtocolError`` naming the field; nothing was built.
        """
        if not isinstance(obj, (list, tuple)) or len(obj) != 10:
            raise PeerProtocolError("peer info must be a list of 10 fields", field="peer_info")
        rank, name, md, pool_addr, pool_nbytes, aux_addr, digest, version, caps, mem = obj
        rank = _rank("rank", rank)  # fields in wire order, so the error names the first bad one
        if type(name) is not str or not 0 < len(name) <= 256:
            raise PeerProtocolError("agent name must be 1..256 characters", field="agent_name", value=_short(name))
        # bytes(md) of an int would allocate md zero bytes: only real bytes pass.
        if not isinstance(md, (bytes, bytearray)) or len(md) > _MAX_METADATA_NBYTES:
            raise PeerProtocolError("agent metadata must be at most 1 MiB of bytes", field="agent_metadata")
        pool_addr, aux_addr = _addr("pool_addr", pool_addr), _addr("aux_addr", aux_addr)
        pool_nbytes = _int_in(1, MAX_NBYTES)("pool_nbytes", pool_nbytes)
        digest, caps = _digest("geometry_digest", digest), _names("capabilities", caps)
        if type(mem) is not str or mem not in ("DRAM", "VRAM"):
            raise PeerProtocolError("memory kind must be DRAM or VRAM", field="mem_kind", value=_short(mem))
        version = _int_in(0, 1 << 16)("protocol_version", version)
        return cls(rank, name, bytes(md), pool_addr, pool_nbytes, aux_addr, digest, version, caps, mem)

    @classmethod
    def from_blob(cls, blob: bytes) -> PeerInfo:
        """Decode the msgpack blob a peer published (``msgpack.packb(info.to_wire())``) and validate it.

        Called: once per peer by ``connect_rendezvous``. After error: ``PeerProtocolError(field=...)``.
        """
        try:
            obj = msgpack.unpackb(blob, raw=False, strict_map_key=True, max_str_len=1024,
                                  max_bin_len=_MAX_METADATA_NBYTES, max_array_len=64, max_map_len=0, max_ext_len=0)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            raise PeerProtocolError("peer info is not valid msgpack", field="peer_info") from None
        return cls.from_wire(obj)


_MAX_METADATA_NBYTES = 1 << 20  # NIXL metadata is ~0.5 KiB plus a few dozen bytes per registration
_addr = _int_in(0, (1 << 64) - 1)
