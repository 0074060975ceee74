"""Prometheus export of one rank's ownership state (``prometheus-client``), read at scrape time.

Owns: the mapping from ``Engine.statistics()`` to metric families. No background thread: the
collector takes a snapshot under the engine lock when Prometheus scrapes.

Metrics (all labelled with ``rank``):
  kvown_sessions{role,state}            live sessions by state
  kvown_pool_blocks{state}              free / owned / held (held = awaiting proof)
  kvown_fences{role}                    fenced request ids
  kvown_acks_pending                    published writers not yet settled, over committed sessions
  kvown_writes_in_flight / _in_doubt    WRITE handles not yet DONE / reported ERROR
  kvown_fail_stop_deadline_seconds      seconds until the nearest fail-stop deadline (absent if none)
  kvown_fatal                           1 once this rank latched a fail-stop
  kvown_events_total{name}              engine counters (frames rejected, bytes written, outcomes...)
  kvown_engine_busy_seconds_total       wall time of engine steps that moved something (its work)
  kvown_engine_cpu_seconds_total        CPU the engine thread used, polling included (absent if not running)
"""

from __future__ import annotations

import time
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class EngineCollector:
    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        stats = self.engine.statistics()
        rank = str(stats.rank)
        sessions = GaugeMetricFamily("kvown_sessions", "Live sessions by state", labels=["rank", "role", "state"])
        fences = GaugeMetricFamily("kvown_fences", "Fenced request ids", labels=["rank", "role"])
        deadline = GaugeMetricFamily("kvown_fail_stop_deadline_seconds", "Seconds to the nearest fail-stop deadline",
                                     labels=["rank", "role"])
        for role, part in (("sender", stats.sender), ("receiver", stats.receiver)):
            if part is None:
                continue
            for state, n in part.sessions_by_state.items():
                sessions.add_metric([rank, role, state], n)
            fences.add_metric([rank, role], part.fences)
            if part.oldest_fail_stop_deadline_ns:
                deadline.add_metric([rank, role], (part.oldest_fail_stop_deadline_ns - time.monotonic_ns()) / 1e9)
        yield sessions
        yield fences
        yield deadline
        blocks = GaugeMetricFamily("kvown_pool_blocks", "Pool blocks by state", labels=["rank", "state"])
        for state in ("free", "owned", "held"):
            blocks.add_metric([rank, state], getattr(stats.pool, state))
        yield blocks
        acks = sum(len(w) for w in stats.receiver.acks_pending.values()) if stats.receiver is not None else 0
        yield _gauge("kvown_acks_pending", "Unsettled published writers of committed sessions", rank, acks)
        yield _gauge("kvown_writes_in_flight", "WRITE handles not yet DONE", rank, stats.writes_in_flight)
        yield _gauge("kvown_writes_in_doubt", "WRITE handles that reported ERROR", rank, stats.writes_in_doubt)
        yield _gauge("kvown_fatal", "1 once this rank latched a fail-stop", rank, 0 if stats.fatal is None else 1)
        events = CounterMetricFamily("kvown_events", "Engine counters", labels=["rank", "name"])
        for name, n in sorted(stats.counters.items()):
            events.add_metric([rank, name], n)
        yield events
        busy = CounterMetricFamily("kvown_engine_busy_seconds", "Wall time of engine steps that moved",
                                   labels=["rank"])
        busy.add_metric([rank], stats.engine_busy_ns / 1e9)
        yield busy
        if stats.engine_cpu_ns is not None:
            cpu = CounterMetricFamily("kvown_engine_cpu_seconds", "CPU the engine thread used",
                                      labels=["rank"])
            cpu.add_metric([rank], stats.engine_cpu_ns / 1e9)
            yield cpu


def _gauge(name: str, doc: str, rank: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["rank"])
    family.add_metric([rank], value)
    return family


def register(engine: Any, registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """Register a collector for ``engine``; returns the registry (a new one unless given)."""
    registry = registry if registry is not None else CollectorRegistry()
    registry.register(EngineCollector(engine))
    return registry


def serve(engine: Any, port: int, addr: str = "127.0.0.1") -> Any:
    """Expose ``/metrics`` on ``addr:port`` (loopback by default); returns the HTTP server (``shutdown()``).

    ``engine`` is anything with ``statistics()``; it is read only when Prometheus scrapes.
    Called: once per rank, at start-up. After error: ``ConfigError`` naming the port (busy, refused).
    """
    from kvown.core.errors import ConfigError

    try:
        server, _thread = start_http_server(port, addr=addr, registry=register(engine))
    except OSError as exc:
        raise ConfigError("cannot serve metrics on this port", field="metrics_port", port=port,
                          error=str(exc), fix="pick a free KVOWN_METRICS_PORT (rank r serves port + r)") from exc
    return server
