"""Launching worlds across test hosts and watching their ranks die: bounded waits, PIDs with start times.

Every rank of a world in tests/multihost/worlds writes OUT/rank{R}.json ({rank, host, pid,
start_ticks}); all test hosts share this machine's PID namespace, so the test can watch every rank
of every host from here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvown.adapters.mpi import process_alive
from kvown.testing.hosts import TestHosts

ROOT = Path(__file__).resolve().parents[2]
WORLDS = Path(__file__).resolve().parent / "worlds"


@dataclass
class World:
    proc: subprocess.Popen
    out: Path
    ranks: int

    def infos(self) -> dict[int, dict]:
        found = {}
        for r in range(self.ranks):
            path = self.out / f"rank{r}.json"
            if path.exists():
                found[r] = json.loads(path.read_text())
        return found

    def alive(self, ranks: list[int] | None = None) -> list[int]:
        infos = self.infos()
        return [
            r
            for r, i in infos.items()
            if (ranks is None or r in ranks) and process_alive(i["pid"], i["start_ticks"])
        ]

    def wait_file(self, name: str, timeout_s: float) -> dict | None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            path = self.out / name
            if path.exists():
                return json.loads(path.read_text())
            if self.proc.poll() is not None and not (self.out / name).exists():
                return None
            time.sleep(0.005)
        return None

    def wait_started(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and len(self.infos()) < self.ranks:
            if self.proc.poll() is not None:
                return False
            time.sleep(0.01)
        return len(self.infos()) == self.ranks

    def wait_gone(self, ranks: list[int] | None, timeout_s: float) -> int | None:
        """Monotonic ns at which every listed rank (default all) was seen gone (2 ms polls), or None."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if not self.alive(ranks):
                return time.monotonic_ns()
            time.sleep(0.002)
        return None

    def wait_exit(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """End what we started: the launcher's process group, then any rank still alive, by PID."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for info in self.infos().values():
            if process_alive(info["pid"], info["start_ticks"]):
                os.kill(info["pid"], signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    @property
    def stderr(self) -> str:
        return (self.out / "mpirun.stderr").read_text(errors="replace")

    @property
    def stdout(self) -> str:
        return (self.out / "mpirun.stdout").read_text(errors="replace")


def start_world(
    hosts: TestHosts,
    ranks: int,
    args: list[str],
    out: Path,
    env: dict[str, str] | None = None,
    script: str = "netfault_world.py",
) -> World:
    """Start ``script ARGS`` on ``ranks`` ranks across ``hosts`` (rank r on host r % n)."""
    out.mkdir(parents=True, exist_ok=True)
    full = hosts.env()
    full.update(
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
        NIXL_LOG_LEVEL="WARN",
        KVOWN_FLIGHT_DIR=str(out),
        **(env or {}),
    )
    cmd = hosts.mpirun_command(ranks) + ["-x", "PYTHONPATH", "-x", "KVOWN_FLIGHT_DIR"]
    for name in env or {}:
        cmd += ["-x", name]
    cmd += [sys.executable, str(WORLDS / script), *args]
    so = open(out / "mpirun.stdout", "wb")
    se = open(out / "mpirun.stderr", "wb")
    proc = subprocess.Popen(cmd, stdout=so, stderr=se, env=full, cwd=ROOT, start_new_session=True)
    so.close()
    se.close()
    return World(proc, out, ranks)
