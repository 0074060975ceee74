"""``kvown bench --quick``: the CI smoke test of the benchmark suite (real mpirun, real NIXL).

It asserts what the suite must always produce - one JSON object whose ``metrics`` map holds every
headline key, the machine, versions and UCX transport - and the two safety results, which hold on any
machine: kvown's W2 canaries are intact and no block of W5's frozen writer retired before the abort.
Timings are not asserted here (they belong to docs/benchmarks.md).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from worldkit import left_in_tmp

REQUIRED = (
    "w1_throughput_ratio_vs_raw_1mib", "w1_throughput_ratio_vs_raw_4mib", "w2_retire_p50_over_bound",
    "w2_retire_p99_over_bound", "w2_violations_kvown", "w2_violations_raw", "engine_cpu_us_per_session",
    "w5_failstop_s", "fence_bytes_per_id", "scale_cost_ratio", "kvown_cpu_us_per_session_sender",
    "kvown_cpu_us_per_session_receiver", "build", "w1_writer_engine_busy_1mib",
)


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_kvown_bench_quick_writes_every_metric(tmp_path) -> None:
    out = tmp_path / "bench.json"
    with left_in_tmp("kvown-bench-") as left:
        proc = subprocess.run([sys.executable, "-m", "kvown", "bench", "--quick", "--json", str(out),
                               "--plot", str(tmp_path / "bench.png"), "--timeout-s", "380"],
                              capture_output=True, text=True, timeout=390)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not left, f"the JSON holds every step's figures, yet the run left {left}"
    result = json.loads(out.read_text())
    metrics = result["metrics"]
    missing = [k for k in REQUIRED if metrics.get(k) is None]
    assert not missing, (missing, metrics)
    assert metrics["w2_violations_kvown"] == 0  # safety: no write landed after a retirement
    assert result["raw"]["frozen"]["retired_before_abort"] is False  # nothing retired before fail-stop
    frozen = result["raw"]["frozen"]
    assert frozen["all_dumps_name_the_deadline"], [(r.get("reason"), r.get("detail")) for r in frozen["runs"]]
    env, transport = result["environment"], result["transport"]
    assert env["nixl"] != "-" and env["python"] and env["ucx"] != "unknown"
    assert transport["write"] != "unknown" and transport["notifications"] != "unknown"
    assert (tmp_path / "bench.png").stat().st_size > 0
