"""Helpers for tests that launch real worlds: the venv's mpirun, hard timeouts, captured output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORLDS = Path(__file__).resolve().parent / "worlds"


def mpirun(n: int) -> list[str]:
    launcher = Path(sys.executable).parent / "mpirun"
    cmd = [str(launcher) if launcher.exists() else "mpirun", "--oversubscribe", "-n", str(n)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    return cmd


def run(cmd: list[str], timeout_s: float, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", NIXL_LOG_LEVEL="WARN", **(env or {}))
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=full_env, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"world did not finish in {timeout_s} s: {cmd}\n{exc.stdout}\n{exc.stderr}")
