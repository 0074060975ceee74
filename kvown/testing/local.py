"""Several kvown ranks in one process over real NIXL: for tests, examples and embedding projects.

Owns: nothing beyond what it builds. Each rank gets its own NIXL agent, pool, driver and engine
thread, so the single-writer rule holds per rank exactly as in a real world; only the MPI fail-stop
route is replaced: ``kill`` (default: record the FailStop and do nothing) receives what would have
been the world kill, so a test can assert a fail-stop without dying.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from kvown.cache.layout import KVLayout
from kvown.cache.space import BlockSpace
from kvown.rank import LocalRank, RankRuntime, _launch, _roles, _start
from kvown.runtime.config import TransferConfig


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
) -> dict[int, RankRuntime]:
    """Start one runtime per rank in ``roles`` (e.g. ``{0: {"sender"}, 1: {"receiver"}}``), each with
    kvown's own pool of ``layout`` on ``device``, or with the server memory ``memory[rank] = (space, on_returned)``.

    Called: once per test. Stop each with ``rt.close()``.
    """
    config = config or TransferConfig()
    key = secrets.token_bytes(32)
    job = secrets.token_hex(4)
    kill = kill if kill is not None else KillRecorder()
    memory = memory or {}
    built = {}
    for rank, r in roles.items():
        space, on_returned = memory.get(rank, (None, None))
        built[rank] = LocalRank.build(rank, config, _roles(r), job=job, layout=None if space else layout,
                                      device=device, memory=space, on_returned=on_returned)
    for local in built.values():
        local.bind_metrics()
    out = {}
    for rank, local in built.items():
        peers = {r: other.transport.info for r, other in built.items() if r != rank}
        local.transport.connect(peers)
        out[rank] = _start(local, peers, key, None, kill=kill)
    for rt in out.values():
        _launch(rt)
    return out
