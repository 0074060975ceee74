"""``DriverPair``: a sender rank (0) and a receiver rank (1), the production stack of each stepped by the caller.

Owns: nothing beyond what it builds with ``kvown.runtime.stack``. No thread and, by default, no real clock:
``run`` steps both drivers and advances the pair's own integer clock ``now``. The fabric is the fake
library's (``FakeFabric``) unless ``endpoint`` builds real NIXL endpoints. Used by the driver's tests, the
fault-point tests and the cost benchmark. ``views()`` shows each rank to the oracles
(``kvown.testing.oracles``), as the simulator's ranks do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvown.adapters.transport import Role
from kvown.api import Receiver, Sender
from kvown.cache.layout import KVLayout
from kvown.cache.pool import KVPool
from kvown.core.actions import FailStop
from kvown.runtime.config import TransferConfig
from kvown.runtime.driver import Driver
from kvown.runtime.flight import FlightRecorder
from kvown.runtime.stack import Stack, WrapTransport, assemble, build_parts
from kvown.testing.fake_nixl import FakeFabric, FakeNixlEndpoint

TX, RX = 0, 1


class DriverPair:
    """``tx`` / ``rx``: the embedding API of each rank; ``drivers``, ``transports`` (unwrapped), ``stacks``.

    ``clock``: the drivers' and engines' clock (default: ``now``); ``recorder_clock``: the flight recorders'
    (default: ``now``). ``on_fail_stop(rank, action)``: a driver's fail-stop (default: kept in ``fatal``);
    ``engine_fail_stop``: an engine's (default: ignored).
    """

    def __init__(self, config: TransferConfig, *, layout: KVLayout, key: bytes = b"k" * 32,
                 clock: Callable[[], int] | None = None, recorder_clock: Callable[[], int] | None = None,
                 fabric: FakeFabric | None = None, endpoint: Callable[[int], Any] | None = None,
                 wrap_transport: WrapTransport | None = None,
                 on_fail_stop: Callable[[int, FailStop], None] | None = None,
                 engine_fail_stop: Callable[[FailStop], None] | None = None) -> None:
        self.now = 0
        self.clock = clock or (lambda: self.now)
        self.fabric = fabric if fabric is not None or endpoint is not None else FakeFabric()
        endpoint = endpoint or (lambda rank: FakeNixlEndpoint(f"r{rank}", fabric=self.fabric))
        self.fatal: dict[int, FailStop] = {}
        on_fail_stop = on_fail_stop or (lambda rank, action: self.fatal.setdefault(rank, action))  # type: ignore
        self.stacks: dict[int, Stack] = {}
        for rank, role in ((TX, Role.SENDER), (RX, Role.RECEIVER)):
            parts = build_parts(rank, frozenset({role}), endpoint(rank), KVPool(layout), config=config,
                                geometry_digest=layout.geometry_digest())
            recorder = FlightRecorder(rank, clock_ns=recorder_clock or (lambda: self.now))
            self.stacks[rank] = assemble(
                parts, peers=(1 - rank,), key=key, recorder=recorder,
                on_fail_stop=lambda a, r=rank: on_fail_stop(r, a),  # type: ignore[misc]
                clock=self.clock, wrap_transport=wrap_transport, engine_fail_stop=engine_fail_stop or _ignore)
        self.transports = {r: s.parts.transport for r, s in self.stacks.items()}
        self.drivers: dict[int, Driver] = {r: s.driver for r, s in self.stacks.items()}
        for rank, transport in self.transports.items():
            transport.connect({1 - rank: self.transports[1 - rank].info})
            self.drivers[rank].refresh_view()
        self.tx = Sender(self.stacks[TX].engine)
        self.rx = Receiver(self.stacks[RX].engine)

    def run(self, until: Callable[[], bool] = lambda: False, steps: int = 200, dt: int = 10) -> None:
        """Step both drivers, advancing the clock, until ``until()`` or ``steps`` rounds (bounded)."""
        for _ in range(steps):
            for driver in self.drivers.values():
                driver.step(self.now)
            if until():
                return
            self.now += dt

    def views(self) -> dict[int, PairRank]:
        """Each rank as the oracles read it (``oracles.RankView``); ``faulty`` when the wrapper is a fault one."""
        out = {}
        for rank, stack in self.stacks.items():
            wrapped = stack.transport if stack.transport is not stack.parts.transport else None
            out[rank] = PairRank(rank, Role.SENDER if rank == TX else Role.RECEIVER, f"r{rank}", stack.driver,
                                 stack.parts.pool, stack.parts.aux, stack.driver.recorder,
                                 wrapped if hasattr(wrapped, "raised") else None, self.fatal.get(rank))
        return out


@dataclass
class PairRank:
    """One rank of the pair as ``kvown.testing.oracles.RankView``."""

    rank: int
    role: Role
    agent: str
    driver: Driver
    pool: KVPool
    aux: Any
    recorder: FlightRecorder
    faulty: Any
    fatal: FailStop | None


def _ignore(action: FailStop) -> None:
    pass


__all__ = ["RX", "TX", "DriverPair", "PairRank"]
