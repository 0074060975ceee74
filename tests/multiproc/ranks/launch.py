"""Launch ``failstop_rank.py`` under real mpirun and watch every rank's PID die.

Used by tests/multiproc/test_failstop_world.py and benchmarks/bench_failstop.py. Every wait is
bounded; on a timeout the launcher's process group and every known rank PID are SIGKILLed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvown.adapters.mpi import process_alive
from kvown.adapters.mpirun import mpirun_command

RANK_SCRIPT = Path(__file__).with_name("failstop_rank.py")
REPO_ROOT = Path(__file__).resolve().parents[3]


@dataclass
class WorldRun:
    returncode: int | None
    infos: dict[int, dict] = field(default_factory=dict)
    all_gone_ns: int | None = None  # monotonic ns when the last rank PID was seen gone
    launcher_exit_ns: int | None = None
    timed_out: bool = False
    out_dir: Path = Path()

    @property
    def stderr(self) -> str:
        return (self.out_dir / "mpirun.stderr").read_text(errors="replace")

    @property
    def stdout(self) -> str:
        return (self.out_dir / "mpirun.stdout").read_text(errors="replace")

    def alive_pids(self) -> list[int]:
        return [i["pid"] for i in self.infos.values() if process_alive(i["pid"], i["start_ticks"])]


def run_world(
    n: int,
    scenario: str,
    out_dir: Path,
    *,
    extra_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    timeout_s: float = 60.0,
) -> WorldRun:
    """Run one job to its end; poll (2 ms) until the launcher exited and every rank PID is gone."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [*mpirun_command(n), sys.executable, str(RANK_SCRIPT), scenario, str(out_dir), *extra_args]
    full_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
    result = WorldRun(returncode=None, out_dir=out_dir)
    with open(out_dir / "mpirun.stdout", "wb") as so, open(out_dir / "mpirun.stderr", "wb") as se:
        proc = subprocess.Popen(cmd, stdout=so, stderr=se, env=full_env, start_new_session=True)
        end = time.monotonic() + timeout_s
        try:
            while time.monotonic() < end:
                for rank in range(n):
                    path = out_dir / f"rank{rank}.json"
                    if rank not in result.infos and path.exists():
                        result.infos[rank] = json.loads(path.read_text())
                now_ns = time.monotonic_ns()
                if result.launcher_exit_ns is None and proc.poll() is not None:
                    result.launcher_exit_ns = now_ns
                if result.all_gone_ns is None and result.infos and not result.alive_pids():
                    if len(result.infos) == n or result.launcher_exit_ns is not None:
                        result.all_gone_ns = now_ns
                if result.launcher_exit_ns is not None and (result.all_gone_ns is not None or not result.infos):
                    break
                time.sleep(0.002)
            else:
                result.timed_out = True
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            for pid in result.alive_pids():
                os.kill(pid, signal.SIGKILL)
            proc.wait(10)
    result.returncode = proc.returncode
    return result
