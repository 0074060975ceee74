"""Start-up: build one rank's engine inside an MPI world, or across separately launched worlds.

Owns: the order of start-up steps, the per-job key, and the handshake.

Rules:
  1. Qualify the fail-stop route first (``qualify_world``): no transfer may start without a kill path.
  2. The per-job key comes from rank 0 over MPI, or from ``KVOWN_JOB_KEY`` (hex) when worlds are
     launched apart; a missing or short key is a ``ConfigError`` before anything is registered.
  3. Every peer is checked (protocol version, capabilities, KV geometry) before any publication; a
     mismatch is refused with a message that names the field and the peer rank.
  4. Within one MPI world, peer information is exchanged by ``allgather``; across worlds through the
     HMAC-authenticated rendezvous (``kvown.adapters.rendezvous``).
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from kvown.adapters.nixl import MemKind, NixlEndpoint
from kvown.adapters.rendezvous import job_key_from_env
from kvown.cache.layout import KVLayout
from kvown.cache.pool import KVPool
from kvown.core.actions import FailStop
from kvown.core.messages import CAPABILITIES, PROTOCOL_VERSION, Hello, check_hello, check_key
from kvown.runtime.config import PeerInfo, TransferConfig
from kvown.runtime.engine import Engine
from kvown.runtime.failstop import FailStopExecutor
from kvown.runtime.flight import FlightRecorder
from kvown.runtime.watchdog import RetirementWatchdog


@dataclass
class RankRuntime:
    """Everything one rank runs. ``sender`` / ``receiver`` are the embedding API (``kvown.api``)."""

    rank: int
    engine: Engine
    watchdog: RetirementWatchdog
    executor: FailStopExecutor
    world: Any  # QualifiedWorld or None

    @property
    def sender(self):  # noqa: ANN201 - avoids an import cycle with kvown.api
        from kvown.api import Sender

        return Sender(self.engine)

    @property
    def receiver(self):  # noqa: ANN201
        from kvown.api import Receiver

        return Receiver(self.engine)

    def crash_guard(self, error_delivered: threading.Event | None = None):  # noqa: ANN201
        """A ``CrashGuard`` for the embedding server's executor loop, wired to this rank's fail-stop.

        Wrap the loop: ``guard.run(loop, cleanup)``; the loop calls ``guard.mark_completed()`` right
        before its one terminating ``break``. Grace from ``KVOWN_RANK_CRASH_GRACE_S`` (default 10 s).
        """
        from kvown.core.actions import FatalReason
        from kvown.runtime.crashguard import CrashGuard

        size = self.world.size if self.world is not None else len(self.engine.peers) + 1
        guard: CrashGuard

        def kill() -> None:
            self.executor.execute(FailStop(FatalReason.RANK_CRASH, None, f"executor loop crashed: {guard.error!r}"))

        guard = CrashGuard(kill, world_size=size, error_delivered=error_delivered)
        return guard

    def hang_detector(self, timeout_s: float, *, c_backstop: bool = True):  # noqa: ANN201
        """A started ``HangDetector``; call ``.heartbeat()`` every loop iteration."""
        from kvown.runtime.hang import HangDetector

        return HangDetector(timeout_s=timeout_s, executor=self.executor, recorder=self.engine.recorder,
                            c_backstop=c_backstop).start()

    def set_watermark(self, epoch: int) -> None:
        """This rank will never admit a request id of an epoch below ``epoch`` again; fences below the
        world-wide minimum are compacted. Called: by the router/server, any thread, non-decreasing."""
        self.engine.submit(("watermark", epoch))

    def exit(self, code: int = 0) -> NoReturn:
        """End this rank's process in order: close, finalize MPI (if in use), flush, ``os._exit``.

        Why not a plain return: at interpreter finalization NIXL/UCX and torch C++ destructors run
        under daemon threads that CPython is tearing down, and now and then that aborts the process
        ("terminate called without an active exception", exit 134) after all the work succeeded.
        ``os._exit`` skips them once everything that matters is closed. Called: once, main thread,
        last statement of a rank's program.
        """
        self.close()
        mpi = sys.modules.get("mpi4py.MPI")  # never import (and so initialise) MPI just to finalise it
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the engine and watchdog. Refused (by the endpoint) while any write handle is live."""
        self.watchdog.stop()
        self.engine.stop(timeout_s)
        self.engine.endpoint.close()


def local_hello(rank: int, layout: KVLayout) -> Hello:
    return Hello(rank, PROTOCOL_VERSION, CAPABILITIES, layout.geometry_digest())


def check_peer(rank: int, layout: KVLayout, peer: PeerInfo) -> None:
    """Rule 3. Raises ``PeerProtocolError`` naming the field (version, capabilities, geometry)."""
    check_hello(local_hello(rank, layout), Hello(peer.rank, peer.protocol_version, peer.capabilities, peer.geometry_digest))


def _make_local(rank: int, layout: KVLayout, config: TransferConfig, device: str, job: str):
    pool = KVPool(layout, device=device)
    aux = torch.zeros(config.aux_slots * config.aux_slot_nbytes, dtype=torch.uint8)
    endpoint = NixlEndpoint(f"kvown-{job}-r{rank}", progress_thread=config.progress_thread)
    endpoint.register_tensor(pool.tensor)
    endpoint.register(aux.data_ptr(), aux.numel(), MemKind.DRAM)
    mem = "VRAM" if pool.device.type == "cuda" else "DRAM"
    info = PeerInfo(rank, endpoint.name, endpoint.metadata(), pool.base_addr, layout.pool_nbytes, aux.data_ptr(),
                    layout.geometry_digest(), PROTOCOL_VERSION, CAPABILITIES, mem)
    return pool, aux, endpoint, info


def _start(rank, peers, endpoint, pool, aux, key, config, roles, world, layout, kill=None) -> RankRuntime:
    for peer in peers.values():
        check_peer(rank, layout, peer)
    for peer in peers.values():
        endpoint.add_peer(peer.agent_metadata)
    recorder = FlightRecorder(rank, capacity=config.flight_capacity)
    executor = FailStopExecutor(world, recorder, kill=kill)

    def fail_stop(action: FailStop) -> None:  # never on the engine thread (DESIGN: watchdog executes)
        threading.Thread(target=executor.execute, args=(action,), name="kvown-failstop", daemon=True).start()

    engine = Engine(rank=rank, peers=peers, endpoint=endpoint, pool=pool, aux=aux, key=key, config=config,
                    sender="sender" in roles, receiver="receiver" in roles, recorder=recorder, fail_stop=fail_stop)
    watchdog = RetirementWatchdog(engine, engine.lock, executor)
    watchdog.start()
    engine.start()
    if config.metrics_port:
        from kvown.runtime.metrics import serve

        serve(engine, config.metrics_port + rank)
    return RankRuntime(rank, engine, watchdog, executor, world)


def connect_mpi(
    comm: Any = None,
    *,
    layout: KVLayout,
    config: TransferConfig | None = None,
    roles: frozenset[str] | set[str] = frozenset({"sender", "receiver"}),
    device: str = "cpu",
    qualify: bool = True,
) -> RankRuntime:
    """Build and start this rank's engine in an MPI world. Collective: every rank calls it.

    Called: once per process, main thread, after ``from mpi4py import MPI``.
    After error: ``ConfigError`` / ``PeerProtocolError`` naming what is wrong; nothing was started.
    """
    from mpi4py import MPI

    from kvown.adapters.mpi import qualify_world

    config = config or TransferConfig()
    comm = comm if comm is not None else MPI.COMM_WORLD
    world = qualify_world(comm) if qualify else None
    rank = comm.Get_rank()
    key = comm.bcast(secrets.token_bytes(32) if rank == 0 else None, root=0)
    job = comm.bcast(secrets.token_hex(4) if rank == 0 else None, root=0)
    pool, aux, endpoint, info = _make_local(rank, layout, config, device, job)
    infos = [PeerInfo.from_wire(w) for w in comm.allgather(info.to_wire())]
    peers = {p.rank: p for p in infos if p.rank != rank}
    runtime = _start(rank, peers, endpoint, pool, aux, check_key(key), config, roles, world, layout)
    comm.Barrier()  # every rank has loaded every peer before anyone sends
    return runtime


def connect_rendezvous(
    address: tuple[str, int],
    *,
    rank: int,
    world_ranks: tuple[int, ...],
    layout: KVLayout,
    config: TransferConfig | None = None,
    roles: frozenset[str] | set[str] = frozenset({"sender", "receiver"}),
    device: str = "cpu",
    world: Any = None,
    job: str = "rv",
    timeout_s: float = 30.0,
) -> RankRuntime:
    """Join separately launched worlds through a rendezvous server (key from ``KVOWN_JOB_KEY``).

    ``world`` is this process's own qualified MPI world (its fail-stop route), or None.
    """
    import msgpack

    from kvown.adapters import rendezvous

    config = config or TransferConfig()
    key = job_key_from_env()  # KVOWN_JOB_KEY, hex; a missing or short key is a ConfigError
    pool, aux, endpoint, info = _make_local(rank, layout, config, device, job)
    rendezvous.publish(address, f"rank{rank}", msgpack.packb(info.to_wire()), key)
    peers = {}
    for other in world_ranks:
        if other != rank:
            blob = rendezvous.lookup(address, f"rank{other}", key, timeout_s)
            peers[other] = PeerInfo.from_wire(msgpack.unpackb(blob))
    return _start(rank, peers, endpoint, pool, aux, key, config, roles, world, layout)
