"""Several kvown ranks in one process over real NIXL: for tests, examples and embedding projects.

Owns: nothing beyond what it builds. Each rank gets its own NIXL agent, pool, driver and engine
thread, so the single-writer rule holds per rank exactly as in a real world; only the MPI fail-stop
route is replaced: ``kill`` (default: record the FailStop and do nothing) receives what would have
been the world kill, so a test can assert a fail-stop without dying.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvown.cache.layout import KVLayout
from kvown.cache.space import BlockSpace
from kvown.rank import RankRuntime, connect_local
from kvown.runtime.config import TransferConfig
from kvown.testing.faults import fault_wrapper


class KillRecorder:
    """A fail-stop kill route that only records (world, exit code) calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, int]] = []

    def __call__(self, world: object, exit_code: int) -> None:
        self.calls.append((world, int(exit_code)))


def local_world(
    roles: dict[int, set[str]],
    *,
    layout: KVLayout | None = None,
    device: str = "cpu",
    config: TransferConfig | None = None,
    kill: Callable[[object, int], None] | None = None,
    memory: dict[int, tuple[BlockSpace, Callable[[Any, tuple[int, ...]], None]]] | None = None,
    fault: str | None = None,
) -> dict[int, RankRuntime]:
    """``kvown.rank.connect_local`` with a ``KillRecorder`` as the default kill route (tests). ``fault``: a
    fault plan for every rank's transport (``kvown.testing.faults``; ``""``: the wrapper, no fault yet)."""
    return connect_local(roles, layout=layout, device=device, config=config, kill=kill or KillRecorder(),
                         memory=memory, wrap_transport=fault_wrapper(fault))
