"""Statistics: one frozen, typed snapshot of a rank's ownership state (``RankRuntime.statistics()``).

Owns: the snapshot types. The driver fills them under its lock (``Driver.statistics``) and the engine
adds its own two clocks (``Engine.statistics``); nothing in a snapshot changes after it was taken, so
any thread may keep and compare them.

Rules:
  1. Every figure a dashboard, a benchmark or a check reads is a named, typed field; ``counters``
     keeps the rest of the engine's event counters (name -> count, read-only).
  2. ``to_dict()`` is the JSON form (nested dicts of plain values), for files and Prometheus.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from types import MappingProxyType
from typing import Any

_EMPTY: Mapping[Any, Any] = MappingProxyType({})


class _Plain:
    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: nested dicts and lists of plain values (rule 2)."""
        return _plain(self)  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class PoolCounts(_Plain):
    """Blocks by state; ``total == free + owned + held`` always holds (held: awaiting proof)."""

    total: int
    free: int
    owned: int
    held: int


@dataclass(frozen=True, slots=True)
class RoleStatistics(_Plain):
    """One role's core: its live sessions, fences and nearest fail-stop deadline."""

    sessions: int
    sessions_by_state: Mapping[str, int]
    fences: int
    oldest_fail_stop_deadline_ns: int | None
    counters: Mapping[str, int] = field(default_factory=lambda: _EMPTY)


@dataclass(frozen=True, slots=True)
class ReceiverStatistics(RoleStatistics):
    """The receive side, plus what retirement still waits for."""

    blocks_awaiting_proof: int = 0
    quarantined: str = ""
    acks_pending: Mapping[int, tuple[int, ...]] = field(default_factory=lambda: _EMPTY)  # request id -> writers not yet settled


@dataclass(frozen=True, slots=True)
class Audit(_Plain):
    """``RankRuntime.audit()``: what a quiet rank must hold (nothing), taken on the engine thread.

    ``tables``: the size of every table of the driver and its cores that must be empty once every
    session of the world ended (a leak otherwise); ``canary_broken``: free blocks whose retirement
    canary no longer holds (a write landed after retirement), each ``(block, epoch, offset)``.
    """

    tables: Mapping[str, int]
    fences: int
    fence_nbytes: int
    fences_compacted: int
    free_blocks: int
    canary_broken: tuple[tuple[int, int, int], ...] = ()

    @property
    def leaks(self) -> dict[str, int]:
        return {name: n for name, n in self.tables.items() if n}


@dataclass(frozen=True, slots=True)
class Statistics(_Plain):
    """A rank's snapshot. The well-known counters are fields; every counter is in ``counters``."""

    rank: int
    pool: PoolCounts
    writes_in_flight: int
    writes_in_doubt: int
    control_unsent: int
    fatal: str | None
    counters: Mapping[str, int]
    sender: RoleStatistics | None = None
    receiver: ReceiverStatistics | None = None
    faults: Mapping[str, int] = field(default_factory=lambda: _EMPTY)  # injected faults (tests and the demo's --fault)
    engine_cpu_ns: int | None = None  # the engine thread's CPU so far (None: not running / no thread clock)
    engine_busy_ns: int = 0  # wall time in engine steps that moved something: its work, not its polling

    @property
    def bytes_written(self) -> int:
        return self.counters.get("bytes_written", 0)

    @property
    def control_sent(self) -> int:
        return self.counters.get("control_sent", 0)

    @property
    def rejected_frames(self) -> int:
        return self.counters.get("rejected_frames", 0)

    @property
    def duplicate_frames(self) -> int:
        return self.counters.get("duplicate_frames", 0)

    def counter(self, name: str) -> int:
        """Any engine counter by name (0 if it never moved)."""
        return self.counters.get(name, 0)


def _plain(value: Any) -> Any:
    if is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def frozen(mapping: Mapping[Any, Any]) -> Mapping[Any, Any]:
    """A read-only copy (the snapshot must not see later changes of the engine's tables)."""
    return MappingProxyType(dict(mapping))


__all__ = ["Audit", "PoolCounts", "ReceiverStatistics", "RoleStatistics", "Statistics", "frozen"]
