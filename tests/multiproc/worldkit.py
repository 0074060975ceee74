"""Helpers for tests that launch real worlds: the venv's mpirun, hard timeouts, captured output, and what a
run left in the temp dir."""

from __future__ import annotations

import contextlib
import glob
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from kvown.adapters.mpirun import kill_session, mpirun_command

ROOT = Path(__file__).resolve().parents[2]
WORLDS = Path(__file__).resolve().parent / "worlds"


mpirun = mpirun_command  # the tests' short name for kvown's own launcher command


def run(cmd: list[str], timeout_s: float, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", NIXL_LOG_LEVEL="WARN", **(env or {}))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, cwd=ROOT,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)  # mpirun and every rank (each rank sits in a process group of its own)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"world did not finish in {timeout_s} s: {cmd}\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@contextlib.contextmanager
def left_in_tmp(prefix: str):
    """Yield a list that, once the block ends, names the ``prefix*`` entries it added to the temp dir."""
    pattern = os.path.join(tempfile.gettempdir(), f"{prefix}*")
    before, left = set(glob.glob(pattern)), []
    yield left
    left.extend(sorted(set(glob.glob(pattern)) - before))
