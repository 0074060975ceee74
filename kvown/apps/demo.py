"""``kvown demo``: launch a real multi-rank world and run the cancellation-heavy workload.

Owns: the launcher (mpirun from this venv), the live progress bar, and the report (table, JSON, PNG).

Rules:
  1. The world is real: ``mpirun`` starts 4 ranks by default (2 context, 2 generation) that move KV
     over NIXL (UCX, host memory on a CPU machine). Nothing here fakes a transfer.
  2. The launcher never hangs: the world runs under a hard timeout and is killed past it.
  3. The JSON report's schema is documented in docs/demo-report.md.
  4. A clean world leaves no files behind but the flight recorders its report names; a failed one keeps
     its log and results and says where.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from kvown.adapters.mpirun import mpirun_command
from typing import Any


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def _kv_format(args: argparse.Namespace) -> str:
    return f"nvfp4 ({args.scale_layout} scales)" if args.dtype == "nvfp4" else args.dtype


def summarize(results: list[dict[str, Any]], wall_s: float, args: argparse.Namespace) -> dict[str, Any]:
    rx = [r for r in results if r["role"] == "receiver"]
    tx = [r for r in results if r["role"] == "sender"]
    cancel_us = [v for r in rx for v in r["retire_cancel_us"]]
    release_us = [v for r in rx for v in r["retire_release_us"]]
    nbytes = sum(r["engine"]["counters"].get("bytes_written", 0) for r in tx)
    busy_s = max((r["wall_s"] for r in results), default=wall_s)
    return {
        "requests": args.requests,
        "ranks": args.ranks,
        "mode": ("context-first" if args.context_first else "generation-first") + (" fan-in" if args.fan_in else ""),
        "kv_format": _kv_format(args),
        "device": args.device,
        "requests_completed": sum(r["completed"] for r in rx),
        "requests_cancelled": sum(r["cancelled"] for r in rx),
        "requests_aborted": sum(r["aborted"] for r in rx),
        "requests_failed": sum(r["failed"] for r in rx),
        "requests_unfinished": sum(r["unfinished"] for r in rx),
        "bytes_transferred": nbytes,
        "gbps": nbytes / busy_s / 1e9 if busy_s else 0.0,
        "retire_latency_p50_us": percentile(cancel_us, 50),
        "retire_latency_p99_us": percentile(cancel_us, 99),
        "release_to_retired_p50_us": percentile(release_us, 50),
        "release_to_retired_p99_us": percentile(release_us, 99),
        # A latency is the time between the two events themselves: one below zero is a clock bug.
        "negative_latencies": sum(1 for v in cancel_us + release_us if v < 0),
        "blocks_held_at_end": sum(r["blocks_held_at_end"] for r in rx),
        "corrupted_blocks": sum(r["corrupted_blocks"] + r["canary_broken"] for r in rx),
        "verified_blocks": sum(r["verified_blocks"] for r in rx),
        "fences": sum(r["fences"] for r in rx),
        "rejected_frames": sum(r["engine"]["counters"].get("rejected_frames", 0) for r in results),
        "wall_s": round(wall_s, 3),
        "seed": args.seed,
        "retire_cancel_us": cancel_us,
    }


def print_table(s: dict[str, Any]) -> None:
    rows = [
        ("mode", s["mode"]),
        ("KV format / device", f"{s['kv_format']} / {s['device']}"),
        ("requests completed / cancelled / aborted by the writer / failed",
         f"{s['requests_completed']} / {s['requests_cancelled']} / {s['requests_aborted']} / {s['requests_failed']}"),
        ("bytes transferred", f"{s['bytes_transferred'] / 2**20:.1f} MiB ({s['gbps']:.2f} GB/s)"),
        ("cancel -> retired p50 / p99", f"{s['retire_latency_p50_us']:.0f} us / {s['retire_latency_p99_us']:.0f} us"),
        ("release -> retired p50 / p99", f"{s['release_to_retired_p50_us']:.0f} us / {s['release_to_retired_p99_us']:.0f} us"),
        ("blocks held at end (must be 0)", s["blocks_held_at_end"]),
        ("corrupted blocks (must be 0)", f"{s['corrupted_blocks']} of {s['verified_blocks']} verified"),
        ("fences installed", s["fences"]),
        ("wall time", f"{s['wall_s']:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\nkvown demo results")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def plot(values: list[float], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if values:
        ax.hist(values, bins=50, color="#3b7dd8")
        for q, style in ((50, "--"), (99, ":")):
            ax.axvline(percentile(values, q), color="k", linestyle=style, label=f"p{q} {percentile(values, q):.0f} us")
        ax.legend()
    ax.set_xlabel("cancel decided -> blocks back in the pool (us)")
    ax.set_ylabel("requests")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvown demo", description="Run the multi-rank KV-transfer workload over real NIXL.")
    ap.add_argument("--ranks", type=int, default=4, help="world size: half context, half generation (default 4)")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cancel-rate", type=float, default=0.2)
    ap.add_argument("--context-first", action="store_true", help="prefill finishes before decode publishes")
    ap.add_argument("--fan-in", action="store_true", help="every context rank writes a head slice of each request")
    ap.add_argument("--dtype", choices=["bfloat16", "nvfp4"], default="bfloat16",
                    help="KV format: bfloat16 pattern blocks, or NVFP4 values + FP8 scales quantised from "
                         "seeded K/V and checked by checksum and dequantisation (default bfloat16)")
    ap.add_argument("--scale-layout", choices=["inline", "separate"], default="inline",
                    help="nvfp4: scales inside each block (vLLM) or in a separate scale pool (TensorRT-LLM)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the KV pools live (cuda: VRAM registered with NIXL, CUDA-event ready tokens)")
    ap.add_argument("--fault", choices=["stuck-writer"], help="inject a writer whose WRITE never completes")
    ap.add_argument("--timeout-s", type=float, default=None, help="transfer timeout (default 5, 1 with --fault)")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON (schema: docs/demo-report.md)")
    ap.add_argument("--plot", metavar="PATH", help="write a PNG of the retirement-latency distribution")
    ap.add_argument("--deadline-s", type=float, default=120.0, help="hard limit for the whole world")
    ap.add_argument("--mutant", default="", help=argparse.SUPPRESS)  # tests only: a deliberately broken receiver
    ap.add_argument("--inject", default="", help=argparse.SUPPRESS)  # tests only: raw KVOWN_FAULT text
    args = ap.parse_args(argv)
    _check_ranges(ap, args)
    return args


def _check_ranges(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What the types cannot say: ``ap.error`` (usage, exit status 2) names the option, and no world starts."""
    if args.ranks < 2 or args.ranks % 2:
        ap.error("--ranks must be an even number >= 2")
    if args.requests < 0:
        ap.error(f"--requests must be >= 0, not {args.requests}")
    if not 0.0 <= args.cancel_rate <= 1.0:
        ap.error(f"--cancel-rate must be a fraction in [0, 1], not {args.cancel_rate}")
    if args.timeout_s is not None and not args.timeout_s > 0:
        ap.error(f"--timeout-s must be > 0, not {args.timeout_s}")
    if not args.deadline_s > 0:
        ap.error(f"--deadline-s must be > 0, not {args.deadline_s}")


def _rank_args(args: argparse.Namespace, timeout_s: float, out: str) -> list[str]:
    """The command line of every rank (kvown.apps.demo_rank)."""
    rank_args = ["--requests", str(args.requests), "--seed", str(args.seed), "--cancel-rate", str(args.cancel_rate),
                 "--timeout-s", str(timeout_s), "--out", out, "--deadline-s", str(args.deadline_s)]
    if args.context_first:
        rank_args.append("--context-first")
    if args.fan_in:
        rank_args.append("--fan-in")
    rank_args += ["--dtype", args.dtype, "--scale-layout", args.scale_layout, "--device", args.device]
    if args.fault or args.inject:
        rank_args += ["--fault", args.inject or "stuck-writer:rank=0:nth=3"]
    if args.mutant:
        rank_args += ["--mutant", args.mutant]
    return rank_args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    timeout_s = args.timeout_s or (1.0 if args.fault else 5.0)

    workdir = tempfile.mkdtemp(prefix="kvown-demo-")
    out = os.path.join(workdir, "results.json")
    flight_dir = os.path.abspath(os.environ.get("KVOWN_FLIGHT_DIR", workdir))
    rank_args = _rank_args(args, timeout_s, out)
    env = dict(os.environ, KVOWN_FLIGHT_DIR=flight_dir, PYTHONUNBUFFERED="1")
    try:
        cmd = mpirun_command(args.ranks) + [sys.executable, "-m", "kvown.apps.demo_rank", *rank_args]
    except FileNotFoundError as exc:
        raise SystemExit(f"kvown demo: {exc}") from None
    print(f"kvown demo: {args.ranks} ranks, {args.requests} requests, seed {args.seed}, {_kv_format(args)} on "
          f"{args.device}" + (f", fault {args.fault}" if args.fault else ""), flush=True)
    t0 = time.monotonic()
    rc = _run_with_progress(cmd, env, workdir, out, args)
    wall_s = time.monotonic() - t0
    flights = sorted(glob.glob(os.path.join(flight_dir, "kvown-flight-rank*.jsonl")))
    if args.fault:
        status = _report_fault(rc, wall_s, flights, timeout_s)
    elif rc != 0 or not os.path.exists(out):
        print(f"kvown demo: the world failed (exit code {rc}); flight recorders: {flights or 'none'}", file=sys.stderr)
        for path in flights:
            print(f"  {path}: {_fail_stop_reason(path)}", file=sys.stderr)
        status = 1
    else:
        with open(out) as f:
            summary = summarize(json.load(f), wall_s, args)
        status = _report(summary, args)
    named = args.fault and any(os.path.dirname(path) == workdir for path in flights)  # the report names them
    if status != 0:  # rule 4
        print(f"kvown demo: the world's log and results are kept in {workdir}", file=sys.stderr)
    elif not named:
        shutil.rmtree(workdir, ignore_errors=True)
    return status


def _report(summary: dict, args: argparse.Namespace) -> int:
    """Print the table, write the JSON and the plot; 0 only for a clean world with true latencies."""
    print_table(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v for k, v in summary.items() if k != "retire_cancel_us"}, f, indent=2)
        print(f"  json written to {args.json}")
    if args.plot:
        plot(summary["retire_cancel_us"], args.plot, f"kvown: cancel-to-retired latency ({summary['mode']})")
        print(f"  plot written to {args.plot}")
    ok = summary["blocks_held_at_end"] == 0 and summary["corrupted_blocks"] == 0 and summary["requests_unfinished"] == 0
    if summary["negative_latencies"]:
        print(f"kvown demo: {summary['negative_latencies']} latencies came out negative (a clock bug)", file=sys.stderr)
    return 0 if ok and not summary["negative_latencies"] else 1


def _run_with_progress(cmd: list[str], env: dict, workdir: str, out: str, args: argparse.Namespace) -> int:
    from tqdm import tqdm

    log = open(os.path.join(workdir, "world.log"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    bar = tqdm(total=args.requests, unit="req", desc="requests", file=sys.stdout, dynamic_ncols=True)
    deadline = time.monotonic() + args.deadline_s + 30
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            done = 0
            for path in glob.glob(f"{out}.progress*"):
                try:
                    done += int(open(path).read().split()[0])
                except (OSError, ValueError, IndexError):
                    pass
            bar.update(max(0, done - bar.n))
            time.sleep(0.1)
        if proc.poll() is None:
            proc.kill()
        rc = proc.wait(timeout=10)
    finally:
        bar.close()
        log.close()
    if rc != 0:
        tail = open(os.path.join(workdir, "world.log")).read()[-3000:]
        print(tail, file=sys.stderr)
    return rc


def _fail_stop_reason(path: str) -> str:
    """The reason and detail in a flight recorder's header line."""
    try:
        with open(path) as f:
            header = json.loads(f.readline())
    except (OSError, ValueError):
        return "unreadable"
    return f"{header.get('reason')}: {str(header.get('detail', ''))[:300]}"


def _report_fault(rc: int, wall_s: float, flights: list[str], timeout_s: float) -> int:
    print("\nkvown demo --fault stuck-writer")
    print("  a WRITE on rank 0 never completes; its receiver cannot prove quiescence")
    print(f"  world exit code       {rc} (75 = retirement deadline fail-stop)")
    print(f"  wall time             {wall_s:.1f} s (timeout {timeout_s:.1f} s + grace {timeout_s:.1f} s)")
    for path in flights:
        print(f"  flight recorder       {path}   (read it with: kvown inspect {path})")
    ok = rc == 75 and bool(flights)
    print("  result                " + ("world fail-stopped at the deadline, as designed" if ok else "UNEXPECTED"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
