"""One rank's stack, assembled in one place: aux slots and transport over a pool, then driver and engine.

Owns: the wiring order and nothing else. Every rank is built here: start-up (``kvown.rank``), the
simulator's ranks (``kvown.testing.sim``) and the stepped driver pairs of tests and the cost benchmark
(``kvown.testing.pair``). What differs between them comes in as arguments: the endpoint (real NIXL or the
fake library), the clocks, the fail-stop routes and an optional transport wrapper (fault injection lives
in ``kvown.testing``; this module never imports it).

Rules:
  1. Two steps, because a rank registers its memory before it meets its peers: ``build_parts`` (pool,
     aux slots, transport: what the peers must learn) and, once the peers are known, ``assemble``.
  2. A wrapper returned by ``wrap_transport`` is what the driver talks to; when it has a ``probe`` the
     driver's retirement probe points at it (driver rule 9), the only test hook inside the loop.
  3. Nothing here starts a thread: the caller starts the engine (or steps the driver itself).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ContextManager

import torch

from kvown.adapters.transport import KVTransport, Role
from kvown.cache.lent import LentBlocks
from kvown.cache.pool import KVPool
from kvown.core.actions import FailStop
from kvown.runtime.config import TransferConfig
from kvown.runtime.driver import Driver
from kvown.runtime.engine import Engine
from kvown.runtime.flight import FlightRecorder

WrapTransport = Callable[[Any, int], Any]  # (transport, rank) -> the transport the driver uses


@dataclass
class Parts:
    """What a rank registers before it talks to anyone (rule 1's first step)."""

    rank: int
    roles: frozenset[Role]
    config: TransferConfig
    pool: KVPool | LentBlocks
    aux: torch.Tensor
    transport: KVTransport


@dataclass
class Stack:
    """A rank's assembled stack. ``transport`` is what the driver talks to (``parts.transport`` or its wrapper)."""

    parts: Parts
    transport: Any
    driver: Driver
    engine: Engine


def build_parts(rank: int, roles: frozenset[Role], endpoint: Any, pool: KVPool | LentBlocks, *,
                config: TransferConfig, geometry_digest: str, defer_unknown: bool = False) -> Parts:
    """Aux slots and the transport over ``pool``'s blocks on ``endpoint`` (registers the memory).

    Called: once per rank at start-up, on the thread that will own the endpoint.
    """
    aux = torch.zeros(config.aux_slots * config.aux_slot_nbytes, dtype=torch.uint8)
    transport = KVTransport(endpoint, rank, pool.space(), aux, aux_slot_nbytes=config.aux_slot_nbytes,
                            roles=roles, geometry_digest=geometry_digest, defer_unknown=defer_unknown)
    return Parts(rank, roles, config, pool, aux, transport)


def assemble(parts: Parts, *, peers: tuple[int, ...], key: bytes, recorder: FlightRecorder,
             on_fail_stop: Callable[[FailStop], None], clock: Callable[[], int],
             lock: ContextManager[Any] | None = None, wrap_transport: WrapTransport | None = None,
             engine_fail_stop: Callable[[FailStop], None] | None = None) -> Stack:
    """The driver and engine of ``parts`` (no thread started: rule 3).

    ``engine_fail_stop``: where the engine's own fail-stops go (default ``on_fail_stop``).
    """
    transport: Any = parts.transport if wrap_transport is None else wrap_transport(parts.transport, parts.rank)
    driver = Driver(rank=parts.rank, peers=peers, roles=parts.roles, transport=transport, pool=parts.pool,
                    aux=parts.aux, key=key, config=parts.config, recorder=recorder, on_fail_stop=on_fail_stop,
                    clock=clock, lock=lock)
    if wrap_transport is not None and callable(getattr(transport, "probe", None)):
        driver.probe = transport.probe  # rule 2
    engine = Engine(driver, fail_stop=engine_fail_stop or on_fail_stop, clock=clock)
    return Stack(parts, transport, driver, engine)


__all__ = ["Parts", "Stack", "WrapTransport", "assemble", "build_parts"]
