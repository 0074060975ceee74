"""What a slow or lossy link costs kvown's sessions: two test hosts, the same sessions on a clean link
and on impaired ones, interleaved, with ratios to the clean baseline of the same run.

Fixed configuration: ``tests/multihost/worlds/netfault_world.py sessions`` (rank 0 writes on host 0,
rank 1 receives on host 1; every 5th session is cancelled right after publication; each landed block
is verified), 64 KiB blocks, ``--blocks`` per session, one session at a time, UCX over TCP between the
namespace hosts. The impairment sits on the writer host's egress (its data and its control frames):

  clean             no qdisc
  tbf-100mbit-q64k  100 Mbit/s, 64 KB queue (tail drops: real loss, TCP retransmits)
  tbf-20mbit-q24k   20 Mbit/s, 24 KB queue
  netem-20ms-2pct   20 ms +- 5 ms delay, 2 % loss (only where the kernel has netem; skipped otherwise)

Figures per profile (µs, medians and p99 over every run): publish -> landed (completed sessions),
release -> retired (completed), cancel -> retired (cancelled); TCP retransmits and qdisc drops on the
writer host. Needs root (network namespaces).

    kvown bench link --runs 2 --sessions 60 --json out/bench_link.json
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
sys.path.insert(0, str(ROOT / "tests" / "multihost"))
sys.path.insert(0, str(ROOT))

from hostkit import start_world  # noqa: E402

from kvown.testing.hosts import HostsUnavailable, TestHosts  # noqa: E402

PROFILES = {
    "clean": None,
    "tbf-100mbit-q64k": ("tbf", {"rate_kbit": 100_000, "queue_bytes": 64_000, "burst_bytes": 32_000}),
    "tbf-20mbit-q24k": ("tbf", {"rate_kbit": 20_000, "queue_bytes": 24_000, "burst_bytes": 16_000}),
    "netem-20ms-2pct": ("netem", {"delay_ms": 20, "jitter_ms": 5, "loss_pct": 2}),
}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_run(hosts: TestHosts, profile: str, sessions: int, blocks: int, workdir: Path) -> dict:
    hosts.clear_qdisc(0)
    spec = PROFILES[profile]
    if spec is not None:
        kind, params = spec
        (hosts.netem if kind == "netem" else hosts.throttle)(0, **params)
    retrans0 = hosts.tcp_retransmits(0)
    world = start_world(
        hosts,
        2,
        [
            "sessions",
            str(workdir),
            "--sessions",
            str(sessions),
            "--blocks",
            str(blocks),
            "--timeout-s",
            "20",
            "--grace-s",
            "20",
        ],
        workdir,
    )
    try:
        rc = world.wait_exit(600)
    finally:
        world.stop()
    stats = hosts.qdisc_stats(0) if spec is not None else {}
    report = json.loads((workdir / "report.json").read_text()) if (workdir / "report.json").exists() else None
    hosts.clear_qdisc(0)
    return {
        "profile": profile,
        "returncode": rc,
        "report": report,
        "retransmits": hosts.tcp_retransmits(0) - retrans0,
        "qdisc_dropped": stats.get("dropped", 0),
    }


def summarize(runs: list[dict]) -> dict:
    done = [s for r in runs if r["report"] for s in r["report"]["sessions"]]
    landed = [s["publish_to_landed_us"] for s in done if not s["cancelled"] and s["publish_to_landed_us"]]
    released = [s["release_to_retired_us"] for s in done if not s["cancelled"] and s["release_to_retired_us"]]
    cancelled = [s["release_to_retired_us"] for s in done if s["cancelled"] and s["release_to_retired_us"]]
    return {
        "runs_ok": sum(1 for r in runs if r["returncode"] == 0),
        "sessions": len(done),
        "all_retired_with_proof": bool(done) and all(s["retired"] for s in done),
        "publish_to_landed_us": {"p50": pct(landed, 0.5), "p99": pct(landed, 0.99)},
        "release_to_retired_us": {"p50": pct(released, 0.5), "p99": pct(released, 0.99)},
        "cancel_to_retired_us": {"p50": pct(cancelled, 0.5), "p99": pct(cancelled, 0.99)},
        "retransmits": sum(r["retransmits"] for r in runs),
        "qdisc_dropped": sum(r["qdisc_dropped"] for r in runs),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2, help="runs per profile (interleaved)")
    ap.add_argument("--sessions", type=int, default=60)
    ap.add_argument("--blocks", type=int, default=4, help="64 KiB blocks per session")
    ap.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {p: [] for p in args.profiles}
    skipped: dict[str, str] = {}
    try:
        hosts = TestHosts(2).open()
    except HostsUnavailable as exc:  # not a failure of kvown: say why and leave (make bench runs on)
        print(f"bench_link: skipped, test hosts unavailable: {exc.reason}", file=sys.stderr)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(
                json.dumps({"benchmark": "degraded_link_session_latency", "skipped": exc.reason})
            )
        return 0
    try:
        with tempfile.TemporaryDirectory(prefix="kvown-bench-link-") as tmp:
            for i in range(args.runs):
                for profile in args.profiles:
                    if profile in skipped:
                        continue
                    try:
                        result = one_run(
                            hosts, profile, args.sessions, args.blocks, Path(tmp) / f"{profile}-{i}"
                        )
                    except HostsUnavailable as exc:
                        skipped[profile] = exc.reason
                        print(f"{profile}: skipped ({exc.reason})", flush=True)
                        continue
                    runs[profile].append(result)
                    rep = result["report"] or {"sessions": []}
                    landed = [s["publish_to_landed_us"] for s in rep["sessions"] if s["publish_to_landed_us"]]
                    print(
                        f"{profile:<18} run={i} rc={result['returncode']} sessions={len(rep['sessions'])} "
                        f"publish->landed p50 {statistics.median(landed) if landed else float('nan'):.0f} us "
                        f"retransmits {result['retransmits']} drops {result['qdisc_dropped']}",
                        flush=True,
                    )
    finally:
        hosts.close()
    summary = {p: summarize(r) for p, r in runs.items() if r}
    base = summary.get("clean")
    if base:
        for s in summary.values():
            for key in ("publish_to_landed_us", "release_to_retired_us", "cancel_to_retired_us"):
                b, v = base[key]["p50"], s[key]["p50"]
                s[key]["p50_vs_clean"] = round(v / b, 2) if b and v else None
    report = {
        "benchmark": "degraded_link_session_latency",
        "config": {
            "sessions": args.sessions,
            "blocks": args.blocks,
            "block_nbytes": 65536,
            "runs": args.runs,
            "profiles": {p: PROFILES[p] for p in args.profiles},
            "skipped": skipped,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "summary": summary,
    }
    for profile, s in summary.items():
        print(
            f"{profile:<18} publish->landed p50 {s['publish_to_landed_us']['p50']} us "
            f"(x{s['publish_to_landed_us'].get('p50_vs_clean')}), release->retired p50 "
            f"{s['release_to_retired_us']['p50']} us, "
            f"cancel->retired p50 {s['cancel_to_retired_us']['p50']} us, "
            f"all retired with proof: {s['all_retired_with_proof']}"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return (
        0
        if all(s["all_retired_with_proof"] and s["runs_ok"] == len(runs[p]) for p, s in summary.items())
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
