"""Open MPI's session files per launch (kvown/adapters/mpirun.py rule 5), with real mpirun.

The hazard is reproduced, not assumed: two launchers that get the same pid (each in a fresh pid
namespace, where the first fork is pid 2) over one session base. The first is killed, which leaves its
PMIx rendezvous socket behind, and the second dies with "listener thread failed to start": the CI flake
that rule 4 retried. kvown's launches each get a fresh base, so the second one runs.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvown.adapters import mpirun
from kvown.adapters.mpirun import LAUNCH_DIR_PREFIX, LAUNCHER_START_FAILURES, find_mpirun, mpirun_command

ROOT = Path(__file__).resolve().parents[2]

needs_pid_namespaces = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or find_mpirun() is None,
    reason="needs root, unshare and mpirun: each launcher runs in a fresh pid namespace",
)


def _in_fresh_pid_namespace(script: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """``script`` as pid 1 of a new pid namespace; the first process it starts is pid 2 there."""
    return subprocess.run(["unshare", "--fork", "--pid", "--mount-proc", "--kill-child", "sh", "-c", script],
                          capture_output=True, text=True, timeout=timeout_s)


def _killed_then_relaunched(first: list[str], second: list[str], started: Path
                            ) -> subprocess.CompletedProcess:
    """Launch ``first`` (pid 2), SIGKILL it once its rank runs, then launch ``second`` (pid 2 again)."""
    rank = f"touch {shlex.quote(str(started))}; sleep 30"
    killed = _in_fresh_pid_namespace(
        f"{shlex.join(first)} -n 1 sh -c {shlex.quote(rank)} & launcher=$!; "
        f"i=0; while [ ! -e {shlex.quote(str(started))} ] && [ $i -lt 300 ]; "
        "do sleep 0.05; i=$((i+1)); done; "
        "echo launcher=$launcher; kill -KILL $launcher")
    assert "launcher=2" in killed.stdout and started.exists(), killed
    return _in_fresh_pid_namespace(f"{shlex.join(second)} -n 1 true & launcher=$!; echo launcher=$launcher; "
                                   "wait $launcher")


def _base(cmd: list[str]) -> str:
    return cmd[cmd.index("prte_tmpdir_base") + 1]


def _without_ranks(cmd: list[str]) -> list[str]:
    return cmd[: cmd.index("-n")]


@needs_pid_namespaces
@pytest.mark.timeout(120)
def test_a_killed_launchers_session_files_kill_the_next_launcher_with_its_pid(tmp_path):
    shared = _without_ranks(mpirun_command(1))
    shared[shared.index("prte_tmpdir_base") + 1] = str(tmp_path)  # one base for both: Open MPI's default
    second = _killed_then_relaunched(shared, shared, tmp_path / "started")
    assert "launcher=2" in second.stdout, second
    assert second.returncode != 0 and any(m in second.stderr for m in LAUNCHER_START_FAILURES), second


@needs_pid_namespaces
@pytest.mark.timeout(120)
def test_kvowns_launches_outlive_a_killed_launcher_with_the_same_pid(tmp_path):
    first, second = _without_ranks(mpirun_command(1)), _without_ranks(mpirun_command(1))
    assert _base(first) != _base(second)
    result = _killed_then_relaunched(first, second, tmp_path / "started")
    assert "launcher=2" in result.stdout and result.returncode == 0, result


@needs_pid_namespaces
@pytest.mark.timeout(120)
def test_mutant_one_base_for_every_launch_is_caught(tmp_path, monkeypatch):
    fixed = tempfile.mkdtemp(prefix="kvown-test-base-")
    try:
        monkeypatch.setattr(mpirun, "launch_dir", lambda: fixed)
        first, second = _without_ranks(mpirun_command(1)), _without_ranks(mpirun_command(1))
        result = _killed_then_relaunched(first, second, tmp_path / "started")
        assert result.returncode != 0 and any(m in result.stderr for m in LAUNCHER_START_FAILURES), result
    finally:
        shutil.rmtree(fixed, ignore_errors=True)


CREATOR = """
import atexit, os, sys, time
from kvown.adapters import mpirun
if sys.argv[1] == "mutant":
    atexit.unregister(mpirun.remove_own_launch_dirs)
path = mpirun.launch_dir()
print(path, os.path.isdir(path), flush=True)
if sys.argv[1] == "hang":
    time.sleep(60)
"""


def _creator(mode: str) -> tuple[subprocess.Popen, str]:
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=pythonpath)
    proc = subprocess.Popen([sys.executable, "-c", CREATOR, mode], stdout=subprocess.PIPE, text=True, env=env)
    with proc.stdout:
        path, made = proc.stdout.readline().split()
    assert made == "True" and Path(path).name.startswith(f"{LAUNCH_DIR_PREFIX}{proc.pid}-"), path
    return proc, path


def test_a_creators_launch_dirs_go_when_it_exits():
    proc, path = _creator("exit")
    assert proc.wait(timeout=30) == 0
    assert not Path(path).exists()


def test_mutant_without_the_exit_cleanup_is_caught():
    proc, path = _creator("mutant")
    try:
        assert proc.wait(timeout=30) == 0
        assert Path(path).exists()  # what the exit cleanup is there to remove
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_killed_creators_launch_dirs_go_at_the_next_sweep_and_a_live_ones_stay():
    proc, path = _creator("hang")
    mine = mpirun.launch_dir()
    assert path not in mpirun.sweep_launch_dirs() and Path(path).exists()  # its creator is alive
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    for _ in range(100):  # bounded: the kernel reaps it at once, this only absorbs a slow /proc
        if not mpirun.process_alive(proc.pid):
            break
        time.sleep(0.01)
    assert path in mpirun.sweep_launch_dirs() and not Path(path).exists()
    assert Path(mine).exists()  # this process is alive: its own directory stays


def test_mutant_a_sweep_that_thinks_every_creator_alive_is_caught(monkeypatch):
    proc, path = _creator("hang")
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        monkeypatch.setattr(mpirun, "process_alive", lambda pid, start_ticks=None: True)
        assert path not in mpirun.sweep_launch_dirs() and Path(path).exists()
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    return child.pid


@pytest.mark.skipif(find_mpirun() is None, reason="needs mpirun")
@pytest.mark.timeout(120)
def test_stale_session_dirs_names_the_dead_and_the_reused_pids_not_a_running_launch(tmp_path):
    cmd = mpirun_command(1)
    base = Path(_base(cmd))
    launch = subprocess.Popen([*cmd, "sleep", "30"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        for _ in range(300):  # bounded: the launcher makes its session directory at start-up
            if (base / f"ompi.{launch.pid}").is_dir():
                break
            time.sleep(0.05)
        assert (base / f"ompi.{launch.pid}").is_dir()
        dead, reused = base / f"ompi.{_dead_pid()}", base / f"prted.{os.getpid()}"  # this pid runs python
        dead.mkdir()
        reused.mkdir()
        (base / "ompi.vm.0").mkdir()  # not a per-launch name
        assert mpirun.stale_session_dirs(str(base)) == sorted([str(dead), str(reused)])
    finally:
        mpirun.kill_group(launch)


def test_mutant_a_finder_that_trusts_any_live_pid_misses_the_reused_one(tmp_path, monkeypatch):
    reused = tmp_path / f"ompi.{os.getpid()}"
    reused.mkdir()
    assert mpirun.stale_session_dirs(str(tmp_path)) == [str(reused)]
    # the mutant: any live pid is taken for the launcher that made the directory
    monkeypatch.setattr(mpirun, "process_name", lambda pid: "mpirun" if mpirun.process_alive(pid) else "")
    assert mpirun.stale_session_dirs(str(tmp_path)) == []  # missed: the reuse is what the name check catches
