"""``kvown bench soak``: hours of the demo's cancellation-heavy workload, with faults, in rotating worlds.

Owns: the rotation of worlds (rank count and mode), their launch under a hard timeout, and the report:
sessions, blocks held at the end, leaks, corrupted blocks, hang-detector false positives, RSS growth
after warm-up, fence memory after watermark compaction - as a table, ``--json`` and a ``--plot`` PNG
over time. Each world is ``mpirun -n R python -m kvown.apps.soak_rank`` (see there for what a rank
measures after every round).

Rules:
  1. ``--minutes`` is split into at least two worlds of about ``--segment-minutes`` each, taken in turn
     from ``ROTATION`` (2 or 4 ranks; generation-first, context-first, fan-in). Start-up is not counted.
  2. Every world runs 30 % cancels (either side, before or during the transfer), random WRITE delays
     and recoverable injected faults (``DEFAULT_FAULTS``: sends that raise before or after sending,
     which the driver resends; the receiver drops the duplicates). Faults that must end in a fail-stop
     are not soaked: they are the crash matrix's and the lost-frame tests' business.
  3. Pass means: every world exited 0, no leak (a round ended with blocks owned or held, a driver
     table not empty, or pool accounting broken), no corrupted block (pattern or canary), no hang
     report, no block held at the end, and - for worlds that measured at least ``MIN_RSS_SPAN_S`` after
     warm-up - RSS growth within ``--rss-limit-pct`` of the RSS at the end of warm-up.
  4. Every world is bounded: it is killed (its process group) ``--grace-run-s`` after its duration.

Called: once per process, from ``kvown bench soak`` or
``python -m kvown.apps.soak``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvown.adapters.mpirun import kill_group, launcher_failed_to_start, mpirun_command

REPO = Path(__file__).resolve().parents[2]
ROTATION: tuple[tuple[str, int], ...] = (
    ("gen-first", 2),
    ("ctx-first", 4),
    ("fan-in", 4),
    ("ctx-first", 2),
    ("gen-first", 4),
    ("fan-in", 4),
)
DEFAULT_FAULTS = "slow-writer:pct=20:ms=5,send-raise:pct=1,send-raise-after:pct=1"
MIN_RSS_SPAN_S = 120.0  # a shorter measured span gives an RSS figure, but it is not gated


def linear_slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x; 0 for fewer than two distinct x."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return 0.0 if sxx == 0 else sum((x - mx) * (y - my) for x, y in points) / sxx


def read_samples(world_dir: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(world_dir.glob("samples-rank*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a world killed mid-write leaves a cut last line
                pass
    return out


def world_figures(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    """The figures of one world from its ranks' round samples (soak_rank rule 2)."""
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for s in samples:
        by_rank.setdefault(s["rank"], []).append(s)
    last = {r: max(ss, key=lambda s: s["round"]) for r, ss in by_rank.items()}
    receivers = [s for s in last.values() if s["role"] == "receiver"]
    leaks = [
        {
            "rank": s["rank"],
            "round": s["round"],
            **s["leaks"],
            **({"blocks_held": s["blocks_held"]} if s["blocks_held"] else {}),
            **({} if s["pool_accounting_ok"] else {"pool_accounting": 1}),
        }
        for s in samples
        if s["leaks"] or s["blocks_held"] or not s["pool_accounting_ok"]
    ]
    rss = {}
    for r, ss in sorted(by_rank.items()):
        ss = sorted(ss, key=lambda s: s["t_s"])
        warm = [s for s in ss if s["t_s"] >= warmup_s] or ss[-1:]
        base, end = warm[0]["rss_bytes"], warm[-1]["rss_bytes"]
        span_s = warm[-1]["t_s"] - warm[0]["t_s"]
        slope = linear_slope([(s["t_s"], s["rss_bytes"]) for s in warm])
        rss[r] = {
            "start_bytes": ss[0]["rss_bytes"],
            "after_warmup_bytes": base,
            "end_bytes": end,
            "max_bytes": max(s["rss_bytes"] for s in ss),
            "measured_span_s": round(span_s, 1),
            "growth_pct": round(100.0 * (end - base) / base, 3),
            "growth_pct_per_hour": round(100.0 * slope * 3600 / base, 3),
        }
    faults: dict[str, int] = {}
    for s in last.values():
        for name, n in s["faults"].items():
            faults[name] = faults.get(name, 0) + n
    totals = [s["totals"] for s in receivers]
    return {
        "rounds": 1 + max((s["round"] for s in samples), default=-1),
        "sessions": sum(_sessions(t) for t in totals),
        "completed": sum(t["completed"] for t in totals),
        "cancelled": sum(t["cancelled"] for t in totals),
        "aborted": sum(t["aborted"] for t in totals),  # the plan's prefill-side aborts
        "failed": sum(t["failed"] for t in totals),
        "unfinished": sum(s["totals"]["unfinished"] for s in last.values()),
        "verified_blocks": sum(t["verified_blocks"] for t in totals),
        "corrupted_blocks": sum(t["corrupted_blocks"] + t["canary_broken"] for t in totals),
        "blocks_held_at_end": sum(s["blocks_held"] for s in receivers),
        "leaks": len(leaks),
        "leak_examples": leaks[:5],
        "hang_reports": sum(s["hang_reports"] for s in last.values()),
        "max_heartbeat_gap_s": max((s["max_heartbeat_gap_s"] for s in last.values()), default=0.0),
        "rss": rss,
        "fences_at_end": sum(s["fences"] for s in last.values()),
        "fence_nbytes_at_end": sum(s["fence_nbytes"] for s in last.values()),
        "fence_nbytes_max_per_rank": max((s["fence_nbytes"] for s in samples), default=0),
        "fences_compacted": sum(s["fences_compacted"] for s in last.values()),
        "control_resent": sum(s["counters"]["control_resent"] for s in last.values()),
        "duplicates_dropped": sum(s["counters"]["duplicate_frames"] for s in last.values()),
        "bytes_written": sum(s["counters"]["bytes_written"] for s in last.values()),
        "faults_injected": faults,
    }


def _sessions(totals: dict[str, int]) -> int:
    """Receive sessions that ended, however they ended."""
    return totals["completed"] + totals["cancelled"] + totals["aborted"] + totals["failed"]


def run_world(
    index: int, mode: str, ranks: int, duration_s: float, out: Path, args: argparse.Namespace
) -> dict:
    world_dir = out / f"world{index}-{mode}-{ranks}r"
    world_dir.mkdir(parents=True, exist_ok=True)
    rank_args = [
        "--duration-s",
        str(duration_s),
        "--out",
        str(world_dir),
        "--seed",
        str(args.seed * 1000 + index),
        "--requests",
        str(args.requests_per_round),
        "--cancel-rate",
        str(args.cancel_rate),
        "--fault",
        args.faults,
        "--hang-timeout-s",
        str(args.hang_timeout_s),
        "--grace-run-s",
        str(args.grace_run_s),
    ]
    rank_args += {"ctx-first": ["--context-first"], "fan-in": ["--fan-in"]}.get(mode, [])
    if args.plant:
        rank_args += ["--plant", args.plant]
    cmd = mpirun_command(ranks) + [sys.executable, "-m", "kvown.apps.soak_rank", *rank_args]
    env = dict(
        os.environ,
        KVOWN_FLIGHT_DIR=str(world_dir),
        NIXL_LOG_LEVEL=os.environ.get("NIXL_LOG_LEVEL", "WARN"),
        PYTHONUNBUFFERED="1",
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    for launch in range(2):  # a second launch only after Open MPI failed to start any rank (rule 4 there)
        rc = _launch_world(cmd, env, world_dir / "world.log", duration_s + args.grace_run_s + 60)
        log_text = (world_dir / "world.log").read_text(errors="replace")
        if rc == 0 or not launcher_failed_to_start(log_text, bool(read_samples(world_dir))):
            break
    figures = world_figures(
        read_samples(world_dir), args.warmup_s if args.warmup_s is not None else min(60.0, duration_s / 3)
    )
    flights = sorted(str(p) for p in world_dir.glob("kvown-flight-rank*.jsonl"))
    return {
        "world": index,
        "mode": mode,
        "ranks": ranks,
        "duration_s": round(duration_s, 1),
        "exit_code": rc,
        "launch_retries": launch,
        "wall_s": round(time.monotonic() - t0, 1),
        "dir": str(world_dir),
        "flight_recorders": flights,
        **figures,
    }


def _launch_world(cmd: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> int:
    """One bounded world: its exit code, 124 when it outlived ``timeout_s`` (its session killed)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, env=env, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return 124


def summarize(worlds: list[dict], args: argparse.Namespace) -> dict[str, Any]:
    gated = [
        (w["world"], r, f)
        for w in worlds
        for r, f in w["rss"].items()
        if f["measured_span_s"] >= MIN_RSS_SPAN_S
    ]
    rss_ok = all(f["growth_pct"] <= args.rss_limit_pct for _, _, f in gated)
    summary = {
        "minutes": args.minutes,
        "worlds": len(worlds),
        "seed": args.seed,
        "faults": args.faults,
        "cancel_rate": args.cancel_rate,
        "hang_timeout_s": args.hang_timeout_s,
        "sessions": sum(w["sessions"] for w in worlds),
        "rounds": sum(w["rounds"] for w in worlds),
        "blocks_held_at_end": sum(w["blocks_held_at_end"] for w in worlds),
        "leaks": sum(w["leaks"] for w in worlds),
        "corrupted_blocks": sum(w["corrupted_blocks"] for w in worlds),
        "verified_blocks": sum(w["verified_blocks"] for w in worlds),
        "hang_false_positives": 0 if "hang" in args.plant else sum(w["hang_reports"] for w in worlds),
        "hang_reports": sum(w["hang_reports"] for w in worlds),
        "max_heartbeat_gap_s": max((w["max_heartbeat_gap_s"] for w in worlds), default=0.0),
        # over the ranks whose measured span is long enough to mean something (rule 3); None if none is
        "rss_growth_pct_max": max((f["growth_pct"] for _, _, f in gated), default=None),
        "rss_growth_pct_per_hour_max": max((f["growth_pct_per_hour"] for _, _, f in gated), default=None),
        "rss_growth_pct_max_all_ranks": max(
            (f["growth_pct"] for w in worlds for f in w["rss"].values()), default=0.0
        ),
        "rss_gated_ranks": len(gated),
        "rss_limit_pct": args.rss_limit_pct,
        "rss_within_limit": rss_ok,
        "fence_nbytes_at_end": max((w["fence_nbytes_at_end"] for w in worlds), default=0),
        "fence_nbytes_max_per_rank": max((w["fence_nbytes_max_per_rank"] for w in worlds), default=0),
        "fences_compacted": sum(w["fences_compacted"] for w in worlds),
        "control_resent": sum(w["control_resent"] for w in worlds),
        "exit_codes": [w["exit_code"] for w in worlds],
    }
    summary["passed"] = bool(
        all(w["exit_code"] == 0 and w["rounds"] > 0 and w["unfinished"] == 0 for w in worlds)
        and summary["leaks"] == 0
        and summary["corrupted_blocks"] == 0
        and summary["hang_false_positives"] == 0
        and summary["blocks_held_at_end"] == 0
        and rss_ok
    )
    return summary


def print_report(summary: dict, worlds: list[dict]) -> None:
    print("\nkvown soak")
    print(
        f"  {'world':<24} {'exit':>4} {'rounds':>6} {'sessions':>8} {'leaks':>5} {'corrupt':>7} {'hang':>4} "
        f"{'held':>4} {'RSS +% (span)':>16} {'fence B':>8}"
    )
    for w in worlds:
        growth = max(w["rss"].values(), key=lambda f: f["growth_pct"], default=None)
        g = f"{growth['growth_pct']:+.2f} ({growth['measured_span_s']:.0f}s)" if growth else "-"
        print(
            f"  {w['world']}: {w['mode']} x{w['ranks']:<12} {w['exit_code']:>4} {w['rounds']:>6} {w['sessions']:>8} "
            f"{w['leaks']:>5} {w['corrupted_blocks']:>7} {w['hang_reports']:>4} {w['blocks_held_at_end']:>4} "
            f"{g:>16} {w['fence_nbytes_at_end']:>8}"
        )
    s = summary
    print(
        f"  sessions {s['sessions']} in {s['rounds']} rounds; leaks {s['leaks']}; corrupted blocks "
        f"{s['corrupted_blocks']} of {s['verified_blocks']} verified; hang false positives {s['hang_false_positives']} "
        f"(largest heartbeat gap {s['max_heartbeat_gap_s']:.3f} s); blocks held at end {s['blocks_held_at_end']}"
    )
    if s["rss_gated_ranks"]:
        print(
            f"  RSS growth after warm-up: max {s['rss_growth_pct_max']:+.2f} % "
            f"({s['rss_growth_pct_per_hour_max']:+.2f} %/h by slope) over {s['rss_gated_ranks']} ranks with "
            f">= {MIN_RSS_SPAN_S:.0f} s measured; within {s['rss_limit_pct']} %: {s['rss_within_limit']}"
        )
    else:
        print(
            f"  RSS growth after warm-up: max {s['rss_growth_pct_max_all_ranks']:+.2f} % (no world measured "
            f">= {MIN_RSS_SPAN_S:.0f} s after warm-up: not gated)"
        )
    print(
        f"  fence memory after compaction: {s['fence_nbytes_at_end']} B at the end (max per rank "
        f"{s['fence_nbytes_max_per_rank']} B, {s['fences_compacted']} fences compacted)"
    )
    print("  result: " + ("PASS" if s["passed"] else "FAIL"))


def plot(worlds: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharex=True)
    (ax_rss, ax_sessions), (ax_fence, ax_held) = axes
    offset = 0.0
    done = 0
    for w in worlds:
        samples = read_samples(Path(w["dir"]))
        for ax in axes.flat:
            ax.axvline(offset / 60, color="#bbbbbb", lw=0.8)
        ax_rss.text(
            offset / 60,
            0.98,
            f" {w['mode']} x{w['ranks']}",
            transform=ax_rss.get_xaxis_transform(),
            fontsize=7,
            va="top",
        )
        for r in sorted({s["rank"] for s in samples}):
            ss = sorted((s for s in samples if s["rank"] == r), key=lambda s: s["t_s"])
            xs = [(offset + s["t_s"]) / 60 for s in ss]
            ax_rss.plot(xs, [s["rss_bytes"] / 2**20 for s in ss], lw=1)
            ax_fence.plot(xs, [s["fence_nbytes"] for s in ss], lw=1)
            ax_held.plot(xs, [s["blocks_held"] + sum(s["leaks"].values()) for s in ss], lw=1)
        rx = sorted((s for s in samples if s["role"] == "receiver"), key=lambda s: s["t_s"])
        by_round: dict[int, int] = {}
        for s in rx:
            t = s["totals"]
            by_round[s["round"]] = by_round.get(s["round"], 0) + _sessions(t)
        times = {s["round"]: s["t_s"] for s in rx}
        ax_sessions.plot(
            [(offset + times[k]) / 60 for k in sorted(by_round)],
            [done + by_round[k] for k in sorted(by_round)],
            color="#3b7dd8",
        )
        done += w["sessions"]
        offset += max([w["duration_s"], *(s["t_s"] for s in samples)])  # the last round may overrun
    ax_rss.set_ylabel("RSS per rank (MiB)")
    ax_sessions.set_ylabel("sessions (cumulative)")
    ax_fence.set_ylabel("fence bytes per rank")
    ax_held.set_ylabel("blocks held + leaks at round end")
    for ax in axes[1]:
        ax.set_xlabel("soak time (min)")
    fig.suptitle("kvown soak: memory, sessions, fences, leaks over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvown bench soak", description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=1.0, help="soak time, split over the worlds (default 1)")
    ap.add_argument(
        "--segment-minutes", type=float, default=5.0, help="about this long per world (default 5)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests-per-round", type=int, default=150)
    ap.add_argument("--cancel-rate", type=float, default=0.3)
    ap.add_argument(
        "--faults", default=DEFAULT_FAULTS, help=f"fault plan for every rank (default {DEFAULT_FAULTS})"
    )
    ap.add_argument("--hang-timeout-s", type=float, default=5.0)
    ap.add_argument("--warmup-s", type=float, default=None, help="default: min(60 s, a third of a world)")
    ap.add_argument("--rss-limit-pct", type=float, default=5.0)
    ap.add_argument("--grace-run-s", type=float, default=120.0)
    ap.add_argument(
        "--out", default=None, help="keep the worlds' samples and logs here (default: a temp dir)"
    )
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--plot", default=None, help="write a PNG over time here")
    ap.add_argument("--plant", default="", help=argparse.SUPPRESS)  # tests: leak, corrupt, hang
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.segment_minutes <= 0:
        ap.error("--minutes and --segment-minutes must be > 0")
    n = max(2, round(args.minutes / args.segment_minutes))
    duration_s = args.minutes * 60 / n
    out = Path(args.out or tempfile.mkdtemp(prefix="kvown-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"kvown soak: {args.minutes:g} min in {n} worlds of {duration_s:.0f} s, faults {args.faults!r}, "
        f"cancels {args.cancel_rate:.0%}, output {out}",
        flush=True,
    )
    worlds = []
    for i in range(n):
        mode, ranks = ROTATION[i % len(ROTATION)]
        print(f"  world {i}: {mode}, {ranks} ranks ...", end="", flush=True)
        try:
            w = run_world(i, mode, ranks, duration_s, out, args)
        except FileNotFoundError as exc:
            print(f"\nkvown soak: {exc}", file=sys.stderr)
            return 2
        worlds.append(w)
        print(f" exit {w['exit_code']}, {w['sessions']} sessions, {w['rounds']} rounds", flush=True)
    summary = summarize(worlds, args)
    print_report(summary, worlds)
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "worlds": worlds}, indent=2))
        print(f"  json written to {args.json}")
    if args.plot:
        plot(worlds, args.plot)
        print(f"  plot written to {args.plot}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
