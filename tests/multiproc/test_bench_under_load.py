"""``kvown bench world`` beside a CPU hog (issue 19 item 1): the world finishes, counts its slow
sessions instead of crashing, and every rank leaves its flight recorder for each new slow one.

Real mpirun, real NIXL, 6 busy-loop processes on however many cores there are. A 50 ms slow
threshold: at load >= 8 on 2 cores a control hop alone takes tens of ms (docs/design.md section 16.1).
Bounded: the hog stops itself after ``HOG_S``, the world is killed at ``WORLD_S``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from worldkit import mpirun, run

HOG_S = 100
WORLD_S = 150
HOG = "import time\nend = time.monotonic() + %d\nwhile time.monotonic() < end: pass\n" % HOG_S


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(WORLD_S + 30)
def test_world_beside_a_cpu_hog_reports_slow_sessions_and_both_ranks_dump(tmp_path) -> None:
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(6)]
    try:
        out = tmp_path / "world.json"
        proc = run(mpirun(2) + [sys.executable, "-m", "kvown.apps.benchmarks.world", "--workloads", "w2",
                                "--w2-sizes", "64K", "--w2-rates", "0,50", "--w2-sessions", "300",
                                "--warmup", "5",
                                "--rtt-iters", "200", "--b1-sessions", "1", "--slow-s", "0.05",
                                "--flight-dir", str(tmp_path), "--json", str(out), "--no-progress"], WORLD_S)
    finally:
        for h in hogs:
            h.kill()
            h.wait(10)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    slow = result["slow_sessions"]
    assert slow["excluded_from_percentiles"] is True
    assert slow["count"] == len({w["request_id"] for w in slow["waits"]})
    assert sum(p["slow_sessions"] for p in result["w2"]["points"]) <= slow["count"]
    if slow["count"]:
        headers = [_header(path) for path in result["slow_session_dumps"]]
        assert {h["rank"] for h in headers} == {0, 1}, headers
        assert all(h["reason"].startswith("slow_sessions") for h in headers)


def _header(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.loads(f.readline())
