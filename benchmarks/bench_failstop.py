"""Fail-stop latency: time from a claim's deadline to every rank of the job gone.

Fixed configuration: the ``claim`` scenario of tests/multiproc/ranks/failstop_rank.py (rank 0 holds
request 7's claim, which never settles; the others block in a barrier), deadline 1.0 s after
startup, real Open MPI ``mpirun`` on this host, each rank dumping its flight recorder (rank 0 on the
fail-stop, the others on the launcher's SIGTERM). Measured from outside by polling every rank's PID
(with its start time) every 2 ms against the shared CLOCK_MONOTONIC.

    python benchmarks/bench_failstop.py --runs 10 --ranks 2 4 --json out/bench_failstop.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "multiproc"))

from ranks.launch import run_world  # noqa: E402

DEADLINE_S = 1.0


def summarize(values_ms: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(values_ms), "max_ms": max(values_ms), "min_ms": min(values_ms)}


def bench(ranks: int, runs: int, workdir: Path) -> dict[str, object]:
    gone_ms, launcher_ms, failures = [], [], []
    for i in range(runs):
        run = run_world(ranks, "claim", workdir / f"n{ranks}-{i}", extra_args=("--deadline-s", str(DEADLINE_S)),
                        timeout_s=90)
        deadline_ns = run.infos.get(0, {}).get("deadline_ns")
        if run.timed_out or deadline_ns is None or run.all_gone_ns is None or len(run.infos) != ranks:
            failures.append({"run": i, "returncode": run.returncode, "timed_out": run.timed_out})
            continue
        gone_ms.append((run.all_gone_ns - deadline_ns) / 1e6)
        launcher_ms.append((run.launcher_exit_ns - deadline_ns) / 1e6)
        print(f"ranks={ranks} run={i} rc={run.returncode} deadline->all gone {gone_ms[-1]:.1f} ms "
              f"launcher exit {launcher_ms[-1]:.1f} ms", flush=True)
    return {
        "ranks": ranks,
        "runs": runs,
        "ok_runs": len(gone_ms),
        "failures": failures,
        "deadline_to_all_gone": summarize(gone_ms) if gone_ms else None,
        "deadline_to_launcher_exit": summarize(launcher_ms) if launcher_ms else None,
        "samples_ms": gone_ms,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kvown-bench-failstop-") as tmp:
        results = [bench(n, args.runs, Path(tmp)) for n in args.ranks]
    report = {
        "benchmark": "failstop_deadline_to_world_gone",
        "config": {"scenario": "claim", "deadline_s": DEADLINE_S, "poll_ms": 2, "target_ms_4_ranks": 1000},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "results": results,
    }
    for r in results:
        s = r["deadline_to_all_gone"]
        if s:
            print(f"ranks={r['ranks']}: deadline->all gone median {s['median_ms']:.1f} ms, max {s['max_ms']:.1f} ms "
                  f"({r['ok_runs']}/{r['runs']} runs)")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if all(r["ok_runs"] == r["runs"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
