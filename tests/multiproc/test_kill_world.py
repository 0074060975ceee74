"""Ending a world we launched ends all of it (``kvown.adapters.mpirun`` rule 3).

Open MPI's launcher gives every rank a process group of its own, so SIGKILL to the launcher's group
leaves the ranks running; a CI run lost most of its CPU to two such orphans, busy-polling a barrier
for 50 minutes after their test had finished. ``kill_session`` / ``kill_group`` signal the launcher's
whole session. The mutant is the old group-only kill: the ranks must survive it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvown.adapters import mpirun
from kvown.adapters.mpi import process_alive

RANK = "import os, sys, time; print(os.getpid(), flush=True); time.sleep(60)"


@contextlib.contextmanager
def world(ranks: int = 2) -> Iterator[tuple[subprocess.Popen, list[int]]]:
    """A real mpirun world whose ranks sleep: it and the ranks' pids. Whatever the test did, the
    session is killed and reaped at the end."""
    proc = subprocess.Popen(mpirun.mpirun_command(ranks) + [sys.executable, "-c", RANK], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    assert proc.stdout is not None
    try:
        yield proc, [int(proc.stdout.readline()) for _ in range(ranks)]  # each rank prints its pid at once
    finally:
        mpirun.kill_session(proc.pid)
        proc.wait(timeout=30)
        proc.stdout.close()


def gone_within(pids: list[int], limit_s: float) -> bool:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if not any(process_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_kill_session_ends_the_launcher_and_every_rank() -> None:
    with world() as (proc, pids):
        assert all(os.getpgid(p) != proc.pid for p in pids)  # why the group kill is not enough
        assert set(pids) <= set(mpirun.session_pids(proc.pid))
        assert mpirun.kill_session(proc.pid) >= len(pids) + 1
        proc.wait(timeout=30)
        assert gone_within(pids, 10.0)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_kill_group_leaves_no_rank_behind() -> None:
    with world() as (proc, pids):
        mpirun.kill_group(proc, wait_s=5.0)
        assert proc.poll() is not None and gone_within(pids, 10.0)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_mutant_killing_only_the_launchers_group_leaves_the_ranks_running() -> None:
    with world() as (proc, pids):
        os.killpg(proc.pid, signal.SIGKILL)  # the old kill
        proc.wait(timeout=30)
        assert not gone_within(pids, 2.0), "the ranks died with their launcher's group: the rule's premise is gone"
    assert gone_within(pids, 10.0)  # and kill_session ended them
