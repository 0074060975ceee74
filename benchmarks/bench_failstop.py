"""Fail-stop latency: time from a claim's deadline to every rank of the job gone.

Fixed configuration: the ``claim`` scenario of tests/multiproc/ranks/failstop_rank.py (rank 0 holds
request 7's claim, which never settles; the others block in a barrier), deadline 1.0 s after
startup, real Open MPI ``mpirun`` on this host, each rank dumping its flight recorder (rank 0 on the
fail-stop, the others on the launcher's SIGTERM). Measured from outside by polling every rank's PID
(with its start time) every 2 ms against the shared CLOCK_MONOTONIC.

    python benchmarks/bench_failstop.py --runs 10 --ranks 2 4 --json out/bench_failstop.json

Across hosts (``--test-hosts N``, ``--hosts a,b,c``, ``--hostfile F`` or ``--launcher LINE``): the
fail-stop world of ``kvown qualify`` (``kvown.apps.qualify_failstop``: rank 0 publishes to a writer on
another host that has frozen itself; no proof can come), one rank per host, deadline 1.0 s after the
publication. With ``--test-hosts`` every rank's PID is watched from here (deadline -> every rank on
every host gone); on real hosts only the launcher's exit is seen (wall clocks). The baseline, in the
same run and interleaved, is the same world with every rank on this host.

    kvown bench failstop --test-hosts 3 --runs 10 --json out/bench_failstop_hosts.json
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


def _machine(load_before: tuple[float, float, float]) -> dict[str, object]:
    versions = {"python": platform.python_version(), "kernel": platform.release()}
    for module in ("torch", "mpi4py", "nixl"):
        try:
            versions[module] = __import__("importlib.metadata").metadata.version(module)
        except Exception:  # noqa: BLE001 - a version we cannot read is left out
            pass
    try:
        from mpi4py import MPI

        versions["mpi"] = MPI.Get_library_version().splitlines()[0].rstrip("\x00")
    except Exception:  # noqa: BLE001
        pass
    return {"cpus": os.cpu_count(), **versions, "loadavg_before": load_before, "loadavg_after": os.getloadavg()}


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


def bench_hosts(args: argparse.Namespace) -> dict[str, object]:
    """deadline -> world gone across hosts, against the same world on this host (baseline), interleaved."""
    from kvown.apps import qualify

    hosts = None
    if args.test_hosts:
        from kvown.testing.hosts import TestHosts

        hosts = TestHosts(args.test_hosts).open()
    try:
        across = qualify._launch_for(argparse.Namespace(launcher=args.launcher, hosts=args.hosts,
                                                        hostfile=args.hostfile, slots=4, expect_hosts=0), hosts)
        local = qualify._launch_for(argparse.Namespace(launcher=None, hosts=None, hostfile=None), None)
        ranks = args.ranks[0] if args.ranks_given else max(3, across.hosts_wanted)
        samples: dict[str, list[dict]] = {"across_hosts": [], "one_host": []}
        for i in range(args.runs):
            for name, launch in (("across_hosts", across), ("one_host", local)):
                checks, fig = qualify.run_failstop(launch, ranks, "cpu", 90.0, bound_s=5.0)
                fig = {k: v for k, v in fig.items() if k != "tail"}
                fig["ok"] = all(checks.values())
                samples[name].append(fig)
                print(f"{name:<12} run={i} ok={fig['ok']} hosts={len(fig['hosts'])} deadline->all gone "
                      f"{fig.get('deadline_to_all_ranks_gone_ms')} ms, launcher exit "
                      f"{fig.get('deadline_to_launcher_exit_ms')} ms", flush=True)
    finally:
        if hosts is not None:
            hosts.close()

    def summary(name: str, key: str) -> dict[str, float] | None:
        values = [f[key] for f in samples[name] if f["ok"] and f.get(key) is not None]
        return summarize(values) if values else None

    result = {"ranks": ranks, "runs": args.runs, "where": across.where, "clock": samples["across_hosts"][0].get("clock")}
    for name in samples:
        result[name] = {"ok_runs": sum(f["ok"] for f in samples[name]),
                        "deadline_to_all_gone": summary(name, "deadline_to_all_ranks_gone_ms"),
                        "deadline_to_launcher_exit": summary(name, "deadline_to_launcher_exit_ms"),
                        "samples": samples[name]}
    a, b = result["across_hosts"]["deadline_to_all_gone"], result["one_host"]["deadline_to_all_gone"]
    if a and b:
        result["ratio_all_gone_median_across_vs_one_host"] = a["median_ms"] / b["median_ms"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--ranks", type=int, nargs="+", default=None)
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--test-hosts", type=int, default=0, metavar="N", help="N namespace hosts on this machine")
    where.add_argument("--hosts", help="comma-separated hosts (mpirun --host)")
    where.add_argument("--hostfile", help="an Open MPI hostfile")
    where.add_argument("--launcher", help="a launcher line that starts the ranks, e.g. 'srun --mpi=pmix -N3 -n3'")
    args = parser.parse_args(argv)
    args.ranks_given = args.ranks is not None
    if args.ranks is None:
        args.ranks = [2, 4]
    if args.test_hosts or args.hosts or args.hostfile or args.launcher:
        load_before = os.getloadavg()
        result = bench_hosts(args)
        report = {
            "benchmark": "failstop_deadline_to_world_gone_across_hosts",
            "config": {"world": "kvown.apps.qualify_failstop", "timeout_s": 0.5, "grace_s": 0.5, "poll_ms": 2,
                       "target_ms": 1000},
            "machine": _machine(load_before),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "results": result,
        }
        for name in ("across_hosts", "one_host"):
            s = result[name]["deadline_to_all_gone"] or result[name]["deadline_to_launcher_exit"]
            if s:
                print(f"{name}: deadline->world gone median {s['median_ms']:.1f} ms, "
                      f"max {s['max_ms']:.1f} ms ({result[name]['ok_runs']}/{args.runs} runs)")
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2))
        return 0 if all(result[n]["ok_runs"] == args.runs for n in ("across_hosts", "one_host")) else 1
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kvown-bench-failstop-") as tmp:
        results = [bench(n, args.runs, Path(tmp)) for n in args.ranks]
    report = {
        "benchmark": "failstop_deadline_to_world_gone",
        "config": {"scenario": "claim", "deadline_s": DEADLINE_S, "poll_ms": 2, "target_ms_4_ranks": 1000},
        "machine": _machine(load_before),
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
