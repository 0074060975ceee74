"""A rank's runtime: start-up inside an MPI world or across separately launched worlds, and the way out.

Owns: start-up order, the per-job key, the collective start-up verdict, ``RankRuntime`` (driver,
engine, watchdog, fail-stop executor, the embedding API) and the rank's exit paths.

Rules:
  1. Qualify the fail-stop route first (``qualify_world``): no transfer may start without a kill path.
  2. The per-job key comes from rank 0 over MPI, or from ``KVOWN_JOB_KEY`` (hex) when worlds are
     launched apart; a missing or short key is a ``ConfigError`` before anything is registered.
  3. Start-up is collective and all-or-nothing: each step that can fail on one rank (pool and NIXL
     agent, metrics port, every peer's version, capabilities, geometry and block regions) ends in an
     ``allgather`` of verdicts; a failure anywhere raises ``ConfigError`` on every rank naming the rank
     and the cause. No thread starts before every rank passed every check (none waits in a barrier).
  4. No rank leaves its program while its peers may still need it. ``exit()`` (and, when the
     program ends without it, an interpreter-exit hook) first meets every rank in an exit barrier on
     a private communicator, bounded by the rank-crash grace; when all arrive the world finalizes
     together, otherwise this rank fail-stops the world (RANK_CRASH). An uncaught exception in the
     main thread fail-stops the world at once; a pending fail-stop at program end is carried out by
     the exit hook on the main thread (the executor's worker is a daemon thread).

Invariants:
  INV-RK1  A rank's engine thread starts only after every rank's start-up verdict was "ok".
  INV-RK2  A rank of a multi-rank MPI world never returns from interpreter shutdown into
           ``MPI_Finalize`` unless every rank reached the exit barrier.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NoReturn

import msgpack
import torch

from kvown.adapters.mpi import QualifiedWorld
from kvown.adapters.nixl import NixlEndpoint
from kvown.adapters.rendezvous import job_key_from_env
from kvown.adapters.transport import KVTransport, PeerInfo, Role
from kvown.cache.layout import KVLayout
from kvown.cache.lent import LentBlocks
from kvown.cache.pool import KVPool
from kvown.cache.space import BlockSpace
from kvown.core.actions import FailStop, FatalReason
from kvown.core.errors import AdapterError, ConfigError, KvownError, PeerProtocolError
from kvown.core.messages import MAX_RANK, check_key
from kvown.runtime.config import TransferConfig
from kvown.runtime.crashguard import grace_from_env
from kvown.runtime.driver import Driver
from kvown.runtime.engine import Engine
from kvown.runtime.failstop import FailStopExecutor
from kvown.runtime.flight import FlightRecorder
from kvown.runtime.hooks import TestHooks
from kvown.runtime.stack import Parts, WrapTransport, assemble, build_parts
from kvown.runtime.statistics import Audit, Statistics
from kvown.runtime.view import RankView
from kvown.runtime.watchdog import RetirementWatchdog

EXIT_POLL_S = 0.001


def _roles(roles: Any) -> frozenset[Role]:
    try:
        out = frozenset(Role(r) if not isinstance(r, Role) else r for r in roles)
    except (TypeError, ValueError):
        raise ConfigError("roles must be 'sender' and/or 'receiver'", field="roles", value=roles) from None
    if not out:
        raise ConfigError("a rank needs at least one role", field="roles", value=roles)
    return out


@dataclass
class LocalRank:
    """What one rank builds before it talks to anyone (rule 3's first step)."""

    rank: int
    config: TransferConfig
    roles: frozenset[Role]
    pool: KVPool | LentBlocks
    aux: torch.Tensor
    transport: KVTransport
    stats_source: Any = None  # what the metrics server reads; the engine, once built
    metrics_server: Any = None

    @classmethod
    def build(cls, rank: int, config: TransferConfig, roles: frozenset[Role], *, job: str,
              layout: KVLayout | None = None, device: str = "cpu", memory: BlockSpace | None = None,
              on_returned: Callable[[Any, tuple[int, ...]], None] | None = None,
              defer_unknown: bool = False) -> LocalRank:
        """kvown's own pool of ``layout`` on ``device``, or the server's own ``memory`` (bring your own:
        kvown keeps only ownership state and descriptors; lent blocks go back through ``on_returned``)."""
        pool: KVPool | LentBlocks
        if (layout is None) == (memory is None):
            raise ConfigError("give either layout= (kvown's own pool) or memory= (the server's)", field="memory")
        if memory is not None:
            if config.canary:
                raise ConfigError("canaries need kvown's own pool: retired blocks of server memory are the "
                                  "server's at once", field="canary")
            pool = LentBlocks(memory, on_returned or (lambda owner, blocks: None))
            digest = memory.shape_digest()
        else:
            assert layout is not None
            pool = KVPool(layout, device=device, huge_pages=config.huge_pages)
            digest = layout.geometry_digest()
        endpoint = NixlEndpoint(f"kvown-{job}-r{rank}", progress_thread=config.progress_thread)
        parts = build_parts(rank, roles, endpoint, pool, config=config, geometry_digest=digest,
                            defer_unknown=defer_unknown)
        return cls(rank, config, roles, pool, parts.aux, parts.transport)

    def parts(self) -> Parts:
        return Parts(self.rank, self.roles, self.config, self.pool, self.aux, self.transport)

    def bind_metrics(self) -> None:
        """Bind the Prometheus port now (a busy port is a start-up failure, rule 3)."""
        if self.config.metrics_port:
            from kvown.runtime.metrics import serve

            self.metrics_server = serve(self, self.config.metrics_port + self.rank)

    def statistics(self) -> Statistics:
        """What /metrics shows: the engine's statistics once it exists."""
        if self.stats_source is None:
            raise RuntimeError("kvown is still starting")
        return self.stats_source.statistics()

    def close(self) -> None:
        """Undo ``build`` after a failed start-up (rule 3). Idempotent."""
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server = None
        try:
            self.transport.close()
        except KvownError:
            pass


@dataclass
class RankRuntime:
    """Everything one rank runs. ``sender`` / ``receiver`` are the embedding API (``kvown.api``)."""

    rank: int
    driver: Driver
    engine: Engine
    watchdog: RetirementWatchdog
    executor: FailStopExecutor
    world: QualifiedWorld | None
    exit_comm: Any = None  # a private duplicate of the world's communicator for the exit barrier
    closed: bool = False
    _api: dict[str, Any] = field(default_factory=dict)
    _stops: list[Callable[[], None]] = field(default_factory=list)  # what ``close`` also shuts down

    @property
    def sender(self):  # noqa: ANN201
        facade = self._api.get("sender")  # built once: callers reach it once per session
        if facade is None:
            from kvown.api import Sender

            facade = self._api.setdefault("sender", Sender(self.engine))
        return facade

    @property
    def receiver(self):  # noqa: ANN201
        facade = self._api.get("receiver")
        if facade is None:
            from kvown.api import Receiver

            facade = self._api.setdefault("receiver", Receiver(self.engine))
        return facade

    @property
    def view(self) -> RankView:
        """This rank as callers see it: roles, loaded peers, KV geometry, aux size (immutable; a new one
        is swapped in whenever a peer is loaded). Called: any thread."""
        return self.engine.view

    @property
    def pool(self) -> KVPool | LentBlocks:
        """The rank's KV memory: kvown's own ``KVPool`` (its ``tensor`` and ``block_view`` are what a
        producer fills and a consumer reads) or the ledger over the server's lent memory. Read-only
        use from other threads; blocks change hands only through the API."""
        return self.engine.pool  # type: ignore[no-any-return]

    def statistics(self) -> Statistics:
        """A frozen snapshot of the rank's ownership state (pool, sessions, fences, counters).
        Called: any thread; takes the engine's lock briefly."""
        return self.engine.statistics()

    def audit(self, *, check_canaries: bool = True, restamp: bool = False, timeout_s: float = 10.0) -> Audit:
        """On a quiet rank: every table that must be empty, fence figures, and the canary of every free
        block (``restamp`` stamps broken ones again so a long run counts each once). Runs on the engine
        thread. Called: by soaks, demos and tests once their sessions ended."""
        return self.engine.call(lambda d: d.audit(check_canaries=check_canaries, restamp=restamp), timeout_s)  # type: ignore[no-any-return]

    @property
    def testing(self) -> TestHooks:
        """Planted bugs and raw frames for qualification and self-checks (``kvown.runtime.hooks``)."""
        return self._api.setdefault("testing", TestHooks(self.engine))  # type: ignore[no-any-return]

    def wait_for_peers(self, ranks: Any, timeout_s: float = 10.0) -> RankView:
        """Wait until every rank in ``ranks`` is loaded (a world whose members join over time).

        Returns the view that has them. After error: ``ConfigError(field="ranks")`` for a bad list;
        ``AdapterError(field="ranks", missing=...)`` when they are not all loaded within ``timeout_s``.
        Called: any thread but the engine's.
        """
        try:
            want = frozenset(ranks)
        except TypeError:
            raise ConfigError("ranks must be a collection of rank numbers", field="ranks") from None
        if any(type(r) is not int or not 0 <= r <= MAX_RANK for r in want):
            raise ConfigError("ranks must be rank numbers", field="ranks", value=sorted(want, key=str))
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s >= 0:
            raise ConfigError("timeout_s must be a number >= 0", field="timeout_s", value=timeout_s)
        ok, view = self.engine.wait_view(lambda v: want <= v.peers.keys(), float(timeout_s))
        if not ok:
            raise AdapterError("peers were not loaded in time", field="ranks",
                               missing=sorted(want - view.peers.keys()), timeout_s=timeout_s)
        return view

    def flight_dump(self, path_or_dir: str | None = None, reason: str = "requested") -> str:
        """Write this rank's flight recorder now (e.g. for ``kvown inspect``); returns the file's path.
        Called: any thread; the rank keeps running."""
        return str(self.driver.recorder.dump(path_or_dir, reason, include_stacks=False))

    def add_peers(self, peers: dict[int, PeerInfo], timeout_s: float = 10.0) -> None:
        """Load ranks that joined after start-up (worlds whose members come and go: the registry).

        Called: any thread but the engine's. After error: ``PeerProtocolError`` naming the field of an
        incompatible peer (nothing of it was loaded).
        """
        self.engine.call(lambda driver: driver.connect_peers(peers), timeout_s)

    def inject_fault(self, plan: str) -> None:
        """Tests: replace this rank's fault plan (needs ``wrap_transport=kvown.testing.faults.fault_wrapper("")``)."""
        self.engine.inject_fault(plan)

    def crash_guard(self, error_delivered: threading.Event | None = None):  # noqa: ANN201
        """A ``CrashGuard`` for the embedding server's executor loop, wired to this rank's fail-stop.

        Wrap the loop: ``guard.run(loop, cleanup)``; the loop calls ``guard.mark_completed()`` right
        before its one terminating ``break``. Grace from ``KVOWN_RANK_CRASH_GRACE_S`` (default 10 s).
        """
        from kvown.runtime.crashguard import CrashGuard

        size = self.world.size if self.world is not None else len(self.view.peers) + 1
        guard: CrashGuard

        def kill() -> None:
            self.executor.request(FailStop(FatalReason.RANK_CRASH, None, f"executor loop crashed: {guard.error!r}"))

        guard = CrashGuard(kill, world_size=size, error_delivered=error_delivered)
        return guard

    def hang_detector(self, timeout_s: float, *, c_backstop: bool = True, executor: Any = None):  # noqa: ANN201
        """A started ``HangDetector``; call ``.heartbeat()`` every loop iteration. ``executor``: where a
        hang goes (default: this rank's fail-stop; a soak passes one that only counts)."""
        from kvown.runtime.hang import HangDetector

        return HangDetector(timeout_s=timeout_s, executor=executor or self.executor, recorder=self.driver.recorder,
                            c_backstop=c_backstop).start()

    def set_watermark(self, epoch: int) -> None:
        """This rank will never admit a request id of an epoch below ``epoch`` again; fences below the
        world-wide minimum are compacted. Called: by the router/server, any thread, non-decreasing."""
        from kvown.runtime.commands import SetWatermark

        self.engine.submit(SetWatermark(epoch))

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the engine and watchdog and close the transport. Idempotent.

        After error: the transport refuses to close while a write handle is live (its memory may still
        be written); the runtime is then marked closed anyway and the memory stays registered.
        """
        if self.closed:
            return
        self.closed = True
        for stop in self._stops:  # registry watchers and leases, metrics server
            stop()
        self.watchdog.stop()
        self.engine.stop(timeout_s)
        try:
            self.driver.transport.close()
        except KvownError:
            pass

    def exit(self, code: int = 0) -> NoReturn:
        """End this rank's process in order (rule 4): exit barrier, close, finalize MPI, ``os._exit``.

        Why ``os._exit``: at interpreter finalization NIXL/UCX and torch C++ destructors run beside
        daemon threads CPython is tearing down, and now and then that aborts the process ("terminate
        called without an active exception", exit 134) after all the work succeeded. Called: once,
        main thread, last statement of a rank's program.
        """
        self._leave()
        mpi = sys.modules.get("mpi4py.MPI")  # never import (and so initialise) MPI just to finalise it
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    # ---- exit paths (rule 4) --------------------------------------------------------------------

    def _leave(self) -> None:
        """Meet every rank at the exit barrier (bounded), then close; fail-stop the world if they don't come."""
        if self.closed:
            return
        pending = self.executor.requested or self.driver.fatal
        if pending is not None:  # a kill is under way: make sure it happens, from this (main) thread
            self.executor.request(pending)
            return
        if self.exit_comm is not None and not self._exit_barrier():
            self.executor.request(FailStop(
                FatalReason.RANK_CRASH, None,
                f"rank {self.rank} is leaving its program, but not every rank reached the exit barrier within "
                "the rank-crash grace: the world is taken down rather than left waiting"))
            return
        self.close()

    def _exit_barrier(self) -> bool:
        grace_s = grace_from_env()
        request = self.exit_comm.Ibarrier()
        deadline = time.monotonic() + (grace_s if grace_s is not None else 10.0)
        while time.monotonic() < deadline:
            if request.Test():
                return True
            time.sleep(EXIT_POLL_S)
        return False

    def _install_exit_hooks(self, *, excepthook: bool) -> None:
        """Interpreter exit and (with a qualified world) uncaught main-thread exceptions go through rule 4."""
        threading._register_atexit(self._leave)  # type: ignore[attr-defined]  # before non-daemon joins
        if not excepthook:
            return
        previous = sys.excepthook

        def crash_world(kind: type[BaseException], value: BaseException, tb: Any) -> None:
            previous(kind, value, tb)
            if not self.closed:  # a fail-stop the engine latched first is the cause: report that one
                self.executor.request(self.executor.requested or self.driver.fatal or FailStop(
                    FatalReason.RANK_CRASH, None, f"uncaught exception in rank {self.rank}'s main thread: {value!r}"))

        sys.excepthook = crash_world


def _start(local: LocalRank, peers: dict[int, PeerInfo], key: bytes, world: QualifiedWorld | None,
           kill: Callable[..., None] | None = None, wrap_transport: WrapTransport | None = None) -> RankRuntime:
    """Build the driver, engine and watchdogs (no thread started yet). Peers were checked already.
    ``wrap_transport``: tests' and the demo's fault injection (``kvown.testing.faults.fault_wrapper``): a
    wrapper around the transport, never code in the loop."""
    config = local.config
    recorder = FlightRecorder(local.rank, capacity=config.flight_capacity)
    executor = FailStopExecutor(world, recorder, kill=kill)
    lock = threading.Lock()
    stack = assemble(local.parts(), peers=tuple(sorted(peers)), key=key, recorder=recorder,
                     on_fail_stop=executor.request, clock=time.monotonic_ns, lock=lock, wrap_transport=wrap_transport)
    driver, engine = stack.driver, stack.engine
    recorder.state_source = driver.open_sessions  # the post-mortem's "what was open" (flight rule 3)
    watchdog = RetirementWatchdog(driver, lock, executor)
    local.stats_source = engine
    rt = RankRuntime(local.rank, driver, engine, watchdog, executor, world)
    if local.metrics_server is not None:
        rt._stops.append(local.metrics_server.shutdown)
    return rt


def _launch(rt: RankRuntime) -> RankRuntime:
    rt.watchdog.start()
    rt.engine.start()
    return rt


def _verdict(comm: Any, rank: int, step: str, error: BaseException | None) -> None:
    """Rule 3: every rank learns every rank's verdict for ``step``; any failure raises everywhere."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    failures = {r: text for r, text in enumerate(comm.allgather(mine)) if text is not None}
    if failures:
        first = min(failures)
        raise ConfigError(f"start-up failed at '{step}' on rank {first}: {failures[first]}", field=step,
                          ranks=sorted(failures), this_rank=rank) from error


def connect_mpi(
    comm: Any = None,
    *,
    layout: KVLayout | None = None,
    config: TransferConfig | None = None,
    roles: Any = frozenset({"sender", "receiver"}),
    device: str = "cpu",
    qualify: bool = True,
    memory: BlockSpace | None = None,
    on_returned: Callable[[Any, tuple[int, ...]], None] | None = None,
    wrap_transport: WrapTransport | None = None,
) -> RankRuntime:
    """Build and start this rank's runtime in an MPI world. Collective: every rank calls it.

    ``layout=``: kvown allocates and owns a pool of that geometry on ``device``. ``memory=``: the KV
    memory is the server's own (a ``BlockSpace`` over its tensors); kvown keeps only ownership state,
    and lent blocks go back through ``on_returned(request_id, blocks)`` at retirement.

    Called: once per process, main thread, after ``from mpi4py import MPI``.
    After error: ``ConfigError`` on every rank, naming the failing rank and step (rule 3); nothing
    was started on any rank.
    """
    from mpi4py import MPI

    from kvown.adapters.mpi import qualify_world

    config = config or TransferConfig()
    comm = comm if comm is not None else MPI.COMM_WORLD
    world = qualify_world(comm) if qualify else None
    rank = comm.Get_rank()
    key = comm.bcast(secrets.token_bytes(32) if rank == 0 else None, root=0)
    job = comm.bcast(secrets.token_hex(4) if rank == 0 else None, root=0)
    local: LocalRank | None = None
    error: BaseException | None = None
    try:
        local = LocalRank.build(rank, config, _roles(roles), job=job, layout=layout, device=device, memory=memory,
                                on_returned=on_returned)
        local.bind_metrics()
    except Exception as exc:  # noqa: BLE001 - reported to every rank (rule 3)
        error = exc
    infos = comm.allgather(None if local is None else local.transport.info.to_wire())
    peers = {}
    try:
        _verdict(comm, rank, "build", error)
        assert local is not None
        try:
            peers = {r: PeerInfo.from_wire(w) for r, w in enumerate(infos) if r != rank}
            local.transport.connect(peers)
        except Exception as exc:  # noqa: BLE001
            error = exc
        _verdict(comm, rank, "connect", error)
    except ConfigError:
        if local is not None:
            local.close()
        raise
    rt = _start(local, peers, check_key(key), world, wrap_transport=wrap_transport)
    rt.exit_comm = comm.Dup() if comm.Get_size() > 1 else None
    rt._install_exit_hooks(excepthook=world is not None)
    _launch(rt)
    comm.Barrier()  # every rank has loaded every peer before anyone sends
    return rt


def connect_rendezvous(
    address: tuple[str, int],
    *,
    rank: int,
    world_ranks: tuple[int, ...],
    layout: KVLayout | None = None,
    config: TransferConfig | None = None,
    roles: Any = frozenset({"sender", "receiver"}),
    device: str = "cpu",
    world: QualifiedWorld | None = None,
    job: str = "rv",
    timeout_s: float = 30.0,
    memory: BlockSpace | None = None,
    on_returned: Callable[[Any, tuple[int, ...]], None] | None = None,
    wrap_transport: WrapTransport | None = None,
) -> RankRuntime:
    """Join separately launched worlds through kvown's small rendezvous server (key from
    ``KVOWN_JOB_KEY``): the fallback where no etcd runs. ``connect_registry`` is the preferred way.

    ``world`` is this process's own qualified MPI world (its fail-stop route), or None.
    After error: ``ConfigError`` / ``PeerProtocolError`` naming the field; ``AdapterError`` when a peer
    never published.
    """
    import msgpack

    from kvown.adapters import rendezvous

    config = config or TransferConfig()
    key = job_key_from_env()  # KVOWN_JOB_KEY, hex; a missing or short key is a ConfigError
    local = LocalRank.build(rank, config, _roles(roles), job=job, layout=layout, device=device, memory=memory,
                            on_returned=on_returned)
    local.bind_metrics()
    rendezvous.publish(address, f"rank{rank}", msgpack.packb(local.transport.info.to_wire()), key)
    peers = {}
    for other in world_ranks:
        if other != rank:
            peers[other] = PeerInfo.from_blob(rendezvous.lookup(address, f"rank{other}", key, timeout_s))
    local.transport.connect(peers)
    rt = _start(local, peers, key, world, wrap_transport=wrap_transport)
    rt._install_exit_hooks(excepthook=world is not None)
    return _launch(rt)


def connect_registry(
    endpoint: str,
    *,
    job: str,
    rank: int,
    layout: KVLayout | None = None,
    memory: BlockSpace | None = None,
    on_returned: Callable[[Any, tuple[int, ...]], None] | None = None,
    config: TransferConfig | None = None,
    roles: Any = frozenset({"sender", "receiver"}),
    device: str = "cpu",
    world: QualifiedWorld | None = None,
    ttl_s: int = 5,
    wait_for: tuple[int, ...] = (),
    timeout_s: float = 30.0,
    wrap_transport: WrapTransport | None = None,
) -> RankRuntime:
    """Join a world whose members are launched apart and come and go, through etcd at ``endpoint``.

    This rank's record (``PeerInfo``: agent, metadata, block regions, roles) is published under
    ``kvown/<job>/peers/<rank>`` with a lease of ``ttl_s`` that a thread keeps alive; a watcher loads
    every compatible rank that appears (before or after us). Frames from a rank that published to us
    before our watcher loaded it wait, bounded, until it is loaded. A lease that expires proves only
    that the rank stopped renewing it - never that its WRITEs stopped (docs/embedding.md): its claims
    are still settled by its own evidence, or by this rank's fail-stop at the deadline. ``wait_for``:
    ranks that must be loaded before this returns (bounded by ``timeout_s``).
    Called: once per process, main thread. The job key comes from ``KVOWN_JOB_KEY`` (hex).
    After error: ``ConfigError`` / ``AdapterError`` (etcd unreachable, a ``wait_for`` rank missing).
    """
    from kvown.adapters.registry import LeasedKey, PrefixWatcher

    config = config or TransferConfig()
    key = job_key_from_env()
    if type(rank) is not int or not 0 <= rank <= MAX_RANK:
        raise ConfigError("rank out of range", field="rank", value=rank)
    prefix = f"kvown/{job}/peers/"
    local = LocalRank.build(rank, config, _roles(roles), job=job, layout=layout, device=device, memory=memory,
                            on_returned=on_returned, defer_unknown=True)
    local.bind_metrics()
    rt = _launch(_start(local, {}, check_key(key), world, wrap_transport=wrap_transport))
    rt._install_exit_hooks(excepthook=world is not None)
    loaded = threading.Event()

    def load(info: PeerInfo) -> None:  # watcher thread: never raise into it (it would re-snapshot forever)
        try:
            rt.add_peers({info.rank: info})
        except KvownError as exc:
            rt.driver.recorder.record("peer_refused", None, peer=info.rank, error=str(exc))
        if all(r in rt.view.peers for r in wait_for):
            loaded.set()

    watcher = PrefixWatcher(endpoint, prefix, parse=_parse_peer_record,
                            on_put=lambda info: info.rank == rank or load(info))
    lease = LeasedKey(endpoint, f"{prefix}{rank}", msgpack.packb(local.transport.info.to_wire()), ttl_s=ttl_s)
    try:
        lease.start()
        watcher.start(timeout_s=timeout_s)
        if wait_for and not all(r in rt.view.peers for r in wait_for) and not loaded.wait(timeout_s):
            missing = sorted(set(wait_for) - set(rt.view.peers))
            raise AdapterError("ranks did not join in time", field="wait_for", missing=missing, timeout_s=timeout_s)
    except BaseException:
        with contextlib.suppress(RuntimeError):  # never started: nothing to stop
            watcher.stop()
        lease.close()
        rt.close()
        raise
    rt._stops += [watcher.stop, lease.close]
    return rt


def _parse_peer_record(name: str, raw: bytes) -> PeerInfo:
    """A registry record under ``.../peers/<name>``; one naming another rank than its key is refused."""
    info = PeerInfo.from_blob(raw)
    if str(info.rank) != name:
        raise PeerProtocolError("peer record names another rank than its key", field="rank", key=name)
    return info


def connect_local(
    roles: dict[int, Any],
    *,
    layout: KVLayout | None = None,
    device: str = "cpu",
    config: TransferConfig | None = None,
    kill: Callable[[object, int], None] | None = None,
    memory: dict[int, tuple[BlockSpace, Callable[[Any, tuple[int, ...]], None]]] | None = None,
    wrap_transport: WrapTransport | None = None,
) -> dict[int, RankRuntime]:
    """Several ranks in ONE process, each with its own NIXL agent, pool, driver and engine thread (so
    the single-writer rule holds per rank as in a real world): for tests, examples and embedders
    trying kvown out. ``roles``: e.g. ``{0: {"sender"}, 1: {"receiver"}}``; each rank gets kvown's own
    pool of ``layout`` on ``device``, or the server memory ``memory[rank] = (space, on_returned)``.
    There is no MPI world: a fail-stop calls ``kill(world=None, exit_code)`` (default: nothing), so a
    test can assert a fail-stop without dying.

    Called: once per test or trial, main thread; stop each runtime with ``rt.close()``.
    After error: ``ConfigError`` / ``PeerProtocolError`` naming the field; nothing was started.
    """
    config = config or TransferConfig()
    key = secrets.token_bytes(32)
    job = secrets.token_hex(4)
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
        out[rank] = _start(local, peers, key, None, kill=kill or (lambda world, code: None),
                           wrap_transport=wrap_transport)
    for rt in out.values():
        _launch(rt)
    return out


__all__ = ["LocalRank", "RankRuntime", "connect_local", "connect_mpi", "connect_registry", "connect_rendezvous"]
