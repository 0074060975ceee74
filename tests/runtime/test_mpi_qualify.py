"""Qualified communicator: every refusal names its condition and fix; rank 0 warns once.

Runs against a duck-typed fake ``MPI`` module and communicator (the ``mpi=`` seam); the real
mpi4py refusal (thread level below MULTIPLE) is tested under mpirun in tests/multiproc.
"""

from __future__ import annotations

import os
import warnings

import pytest

import kvown.adapters.mpi as mpi_adapter
from kvown.adapters.mpi import process_start_ticks, qualify_world, same_host_peers
from kvown.core.errors import ConfigError


class FakeComm:
    def __init__(self, rank: int = 0, size: int = 2, inter: bool = False) -> None:
        self.rank, self.size, self.inter = rank, size, inter
        self.gathered: list[object] = []

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def Is_inter(self) -> bool:
        return self.inter

    def allgather(self, obj: object) -> list[object]:
        self.gathered.append(obj)
        host, _pid, ticks = obj  # type: ignore[misc]
        return [obj if r == self.rank else (host, 10_000 + r, ticks) for r in range(self.size)]


class FakeMPI:
    THREAD_SERIALIZED = 2
    THREAD_MULTIPLE = 3

    def __init__(self, **overrides: object) -> None:
        self.initialized = True
        self.finalized = False
        self.thread_level = self.THREAD_MULTIPLE
        self.COMM_NULL = object()
        self.COMM_WORLD = FakeComm()
        self.__dict__.update(overrides)

    def Is_initialized(self) -> bool:
        return self.initialized

    def Is_finalized(self) -> bool:
        return self.finalized

    def Query_thread(self) -> int:
        return self.thread_level


@pytest.fixture(autouse=True)
def _fresh_warning_latch(monkeypatch) -> None:
    monkeypatch.setattr(mpi_adapter, "_warned", False)


REFUSALS = [
    ("not_initialised", dict(mpi=dict(initialized=False)), {}, "initialized", "mpi4py"),
    ("finalised", dict(mpi=dict(finalized=True)), {}, "finalized", "before MPI_Finalize"),
    ("thread_level", dict(mpi=dict(thread_level=2)), {}, "thread_level", "MPI4PY_RC_THREAD_LEVEL=multiple"),
    ("comm_null", dict(comm="null"), {}, "comm", "communicator"),
    ("inter", dict(comm=FakeComm(inter=True)), {}, "comm", "intra-communicator"),
    ("size", dict(comm=FakeComm(size=4)), dict(expected_size=2), "size", "spans exactly"),
    ("rank", dict(comm=FakeComm(rank=1)), dict(expected_rank=0), "rank", "rank order"),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("case", "setup", "expected", "field", "fix_part"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_each_unqualified_world_is_refused_by_name(case, setup, expected, field, fix_part) -> None:
    fake = FakeMPI(**setup.get("mpi", {}))
    comm = setup.get("comm")
    if comm == "null":
        comm = fake.COMM_NULL
    with pytest.raises(ConfigError) as info:
        qualify_world(comm, mpi=fake, **expected)
    assert info.value.field == field
    assert fix_part in info.value.fix
    if isinstance(comm, FakeComm):
        assert comm.gathered == []  # refused before the collective


@pytest.mark.timeout(10)
def test_qualified_world_captures_comm_and_peer_table() -> None:
    comm = FakeComm(rank=1, size=3)
    world = qualify_world(comm, expected_rank=1, expected_size=3, mpi=FakeMPI())
    assert world.comm is comm and (world.rank, world.size) == (1, 3)
    assert world.thread_level == FakeMPI.THREAD_MULTIPLE
    assert world.pids == (10_000, os.getpid(), 10_002)
    assert [p.rank for p in world.peers] == [0, 1, 2]
    assert world.peers[1].start_ticks == process_start_ticks(os.getpid())
    assert {p.pid for p in same_host_peers(world)} == {10_000, 10_002}
    with pytest.raises(AttributeError):
        world.rank = 0  # type: ignore[misc]  # frozen


@pytest.mark.timeout(10)
def test_default_communicator_is_comm_world() -> None:
    fake = FakeMPI()
    fake.COMM_WORLD.rank = 1  # rank 1: no warning expected
    assert qualify_world(mpi=fake).comm is fake.COMM_WORLD


@pytest.mark.timeout(10)
def test_rank0_warns_once_that_abort_is_job_wide() -> None:
    with pytest.warns(RuntimeWarning, match="every rank of the MPI job") as record:
        qualify_world(FakeComm(rank=0), mpi=FakeMPI())
        qualify_world(FakeComm(rank=0), mpi=FakeMPI())
    assert len([w for w in record if "MPI job" in str(w.message)]) == 1


@pytest.mark.timeout(10)
def test_other_ranks_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qualify_world(FakeComm(rank=1), mpi=FakeMPI())


@pytest.mark.timeout(10)
def test_process_start_ticks() -> None:
    assert isinstance(process_start_ticks(os.getpid()), int)
    assert process_start_ticks(2**22 + 12345) is None
