"""MPI adapter: the qualified communicator that the fail-stop path aborts.

Owns: the startup checks that make ``comm.Abort`` a safe, world-aligned kill route from a background
thread, the per-rank (host, pid, start time) table used by the same-host SIGKILL sweep, and the
``/proc`` readers behind it (``process_alive``, ``process_start_ticks``, ``process_name``).

Rules:
  1. ``qualify_world`` runs once per process at startup, on every rank (it ends with a collective
     ``allgather``), before any kvown thread starts. Whatever it returns is captured and handed to the
     fail-stop executor; nothing later looks up ``MPI.COMM_WORLD`` again, least of all from a watchdog
     thread (a sub-communicator world would otherwise abort the wrong world).
  2. Each failed condition is a ``ConfigError`` naming the condition (``field``) and the fix.
  3. ``mpi4py`` is imported lazily, so the module (and its fakes-based tests) import without MPI.
     The ``mpi`` argument is the seam: any object with the few ``MPI`` names used here.

Invariants:
  INV-MPI1  A ``QualifiedWorld`` exists only for an initialised, unfinalised, ``THREAD_MULTIPLE``,
            non-null intra-communicator whose rank and size match what the caller expected.
  INV-MPI2  Rank 0 warns at most once per process that an abort takes down the whole MPI job
            (under Open MPI every rank of the job, not only those of this communicator).
  INV-MPI3  ``peers`` has one entry per rank, in rank order.
"""

from __future__ import annotations

import os
import socket
import threading
import warnings
from dataclasses import dataclass
from typing import Any

from kvown.core.errors import ConfigError

JOB_WIDE_ABORT_WARNING = (
    "kvown: a fail-stop calls MPI_Abort on this communicator; under Open MPI that kills every rank of "
    "the MPI job, including ranks of other executors started by the same mpirun"
)

_warn_lock = threading.Lock()
_warned = False


@dataclass(frozen=True, slots=True)
class PeerProcess:
    """One rank's process, for the same-host SIGKILL sweep. ``start_ticks`` guards against PID reuse."""

    rank: int
    host: str
    pid: int
    start_ticks: int | None


@dataclass(frozen=True, slots=True)
class QualifiedWorld:
    """A communicator proven fit for ``Abort`` from any thread. Build it with ``qualify_world``."""

    comm: Any
    rank: int
    size: int
    thread_level: int
    peers: tuple[PeerProcess, ...] = ()

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self.peers)


def _stat_fields(pid: int) -> list[bytes] | None:
    """``/proc/PID/stat`` fields from field 3 (state) on, or None (no /proc, or gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses; fields after the last ")" are plain.
    return stat[stat.rfind(b")") + 2 :].split()


def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22), None if unknown.

    Called: at qualification and before each sweep kill. After error: None (no /proc, or gone).
    """
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields is not None else None  # field 22 overall; fields[0] is field 3
    except (IndexError, ValueError):
        return None


def process_name(pid: int) -> str:
    """The command name of ``pid`` (``/proc/PID/comm``), "" when unknown (no /proc, or gone)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def process_alive(pid: int, start_ticks: int | None = None) -> bool:
    """True while ``pid`` runs and is not a zombie, and, given ``start_ticks``, is the same process: on a
    busy machine a dead rank's PID is reused within seconds. Called: by launchers watching ranks."""
    fields = _stat_fields(pid)
    if not fields or fields[0] == b"Z":
        return False
    return start_ticks is None or (len(fields) > 19 and fields[19].isdigit() and int(fields[19]) == start_ticks)


def _import_mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - the venv always has mpi4py
        raise ConfigError(
            "mpi4py is not importable", field="mpi4py", fix="install mpi4py built against your MPI"
        ) from exc
    return MPI


def qualify_world(
    comm: Any = None,
    *,
    expected_rank: int | None = None,
    expected_size: int | None = None,
    mpi: Any = None,
) -> QualifiedWorld:
    """Check ``comm`` (default ``MPI.COMM_WORLD``) is a safe abort route and capture it.

    Called: once per process at startup, on every rank together (collective), main thread.
    After error: ``ConfigError`` naming the failed condition; nothing was captured and no collective
    was started, so the caller should exit (every rank normally fails the same check).
    """
    MPI = mpi if mpi is not None else _import_mpi()
    if not MPI.Is_initialized():
        raise ConfigError(
            "MPI is not initialised", field="initialized", fix="import mpi4py.MPI (auto-init) before kvown starts"
        )
    if MPI.Is_finalized():
        raise ConfigError("MPI is already finalised", field="finalized", fix="start kvown before MPI_Finalize")
    thread_level = MPI.Query_thread()
    if thread_level != MPI.THREAD_MULTIPLE:
        raise ConfigError(
            "MPI thread level is below MPI_THREAD_MULTIPLE; a watchdog thread cannot call Abort safely",
            field="thread_level",
            provided=thread_level,
            fix="set MPI4PY_RC_THREAD_LEVEL=multiple (and do not set OMPI_MPI_THREAD_LEVEL lower)",
        )
    if comm is None:
        comm = MPI.COMM_WORLD
    if comm is MPI.COMM_NULL or comm == MPI.COMM_NULL:
        raise ConfigError("communicator is COMM_NULL", field="comm", fix="pass this rank's executor communicator")
    if comm.Is_inter():
        raise ConfigError(
            "communicator is an inter-communicator", field="comm", fix="pass an intra-communicator (e.g. Merge it)"
        )
    rank, size = comm.Get_rank(), comm.Get_size()
    if expected_size is not None and size != expected_size:
        raise ConfigError(
            "communicator size differs from kvown's world description",
            field="size",
            size=size,
            expected=expected_size,
            fix="pass the communicator that spans exactly kvown's world",
        )
    if expected_rank is not None and rank != expected_rank:
        raise ConfigError(
            "communicator rank differs from kvown's world description",
            field="rank",
            rank=rank,
            expected=expected_rank,
            fix="pass the communicator whose rank order matches kvown's world",
        )
    me = (socket.gethostname(), os.getpid(), process_start_ticks(os.getpid()))
    table = comm.allgather(me)
    peers = tuple(PeerProcess(r, host, pid, ticks) for r, (host, pid, ticks) in enumerate(table))
    if rank == 0:
        _warn_job_wide_once()
    return QualifiedWorld(comm=comm, rank=rank, size=size, thread_level=thread_level, peers=peers)


def _warn_job_wide_once() -> None:
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    warnings.warn(JOB_WIDE_ABORT_WARNING, RuntimeWarning, stacklevel=3)


def same_host_peers(world: QualifiedWorld) -> list[PeerProcess]:
    """The other ranks' processes on this host. Called: by the SIGKILL sweep, any thread."""
    here = socket.gethostname()
    return [p for p in world.peers if p.host == here and p.pid != os.getpid()]
