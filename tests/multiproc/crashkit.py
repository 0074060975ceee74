"""The harness of the crash matrix and the lost-frame worlds: launch tests/multiproc/worlds/crash_world.py,
watch every rank's PID, collect the flight recorders, and check the receiver's retirements."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from worldkit import ROOT, WORLDS, mpirun

from kvown.adapters.mpi import process_alive
from kvown.adapters.mpirun import kill_session
from kvown.runtime.flight import read_flight_file

WORLD = WORLDS / "crash_world.py"
MODES = ("gen-first", "ctx-first", "fan-in", "broadcast")
GRACE_S = 1.0  # KVOWN_RANK_CRASH_GRACE_S of every world
BOUND_S = 90.0  # a whole world, start-up included; only a hang gets near it
PROOF = ("KV_RESULT", "SESSION_QUIESCED")


def run_cell(
    tmp_path: Path, mode: str, point: str, role: str, kind: str, mutant: str = "", **extra_env: str
) -> dict:
    """Launch one world, watch its PIDs, and return the figures and what the checks need. With point
    "none" the watch ends when the world does (no crash instant)."""
    ranks = 2 if mode in ("gen-first", "ctx-first") else 3
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "NIXL_LOG_LEVEL": "WARN",
        "KVOWN_FLIGHT_DIR": str(tmp_path),
        "KVOWN_RANK_CRASH_GRACE_S": str(GRACE_S),
        "PYTHONUNBUFFERED": "1",
        **extra_env,
    }
    argv = [sys.executable, str(WORLD), mode, point, role, kind, str(tmp_path), *([mutant] if mutant else [])]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        mpirun(ranks) + argv,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = t0 + BOUND_S
    pids: dict[int, tuple[int, int | None]] = {}  # rank -> (pid, start ticks)
    crash: dict | None = None
    gone_ns = None
    while time.monotonic() < deadline and proc.poll() is None:
        if len(pids) < ranks:
            pids = {
                r: (info["pid"], info.get("start_ticks"))
                for r in range(ranks)
                if (p := tmp_path / f"rank{r}.json").exists() and (info := json.loads(p.read_text()))
            }
        if crash is None and (tmp_path / "crash.json").exists():
            crash = json.loads((tmp_path / "crash.json").read_text())
        if crash is not None and len(pids) == ranks and not any(process_alive(*p) for p in pids.values()):
            gone_ns = time.monotonic_ns()
            break
        time.sleep(0.002)
    try:
        output = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)  # the launcher and its ranks (each in a process group of its own)
        output = proc.communicate()[0]
    if crash is None and (tmp_path / "crash.json").exists():
        crash = json.loads((tmp_path / "crash.json").read_text())
    if gone_ns is None and crash is not None and pids and not any(process_alive(*p) for p in pids.values()):
        gone_ns = time.monotonic_ns()  # the launcher exited first: an upper bound
    flights = {}
    dumps = [p for where in ("", "term/", "end/") for p in tmp_path.glob(f"{where}kvown-flight-rank*.jsonl")]
    for path in dumps:
        records = read_flight_file(path)
        if records:
            flights.setdefault(records[0]["rank"], []).append(records)
    return {
        "ranks": ranks,
        "rc": proc.returncode,
        "output": output or "",
        "crash": crash,
        "pids": pids,
        "gone_s": None if gone_ns is None or crash is None else (gone_ns - crash["t_ns"]) / 1e9,
        "wall_s": time.monotonic() - t0,
        "flights": flights,
        "victim": 0 if role == "sender" else ranks - 1,
        "receiver": ranks - 1,
        "out": tmp_path,
    }


def retirements_without_proof(events: list[dict]) -> list[str]:
    """Check 5 on one receiver recorder: each retire of a request after proof from each of its writers."""
    writers: dict[int, list[int]] = {}
    proven: dict[int, set[int]] = {}
    problems = []
    for e in events:
        rid, kind, detail = e["request_id"], e["kind"], e["detail"]
        if kind == "open_receive":
            writers[rid] = list(detail["writers"])
            proven[rid] = set()
        elif kind in ("recv", "recv_carried") and detail.get("msg") in PROOF and rid in proven:
            proven[rid].add(detail["src"])
        elif kind == "retire" and rid in writers:
            missing = [w for w in writers[rid] if w not in proven[rid]]
            if missing:
                problems.append(f"request {rid} retired without proof from writer(s) {missing}")
    return problems
