"""``kvown bench builds``: the engine's CPU per session with the interpreted and the compiled hot path,
side by side in one run (issue 19 item 4).

Owns: running ``kvown.apps.benchmarks.cost --parts engine`` as child processes, alternately against the
interpreted source (``--source-dir``, default: the checkout) and a compiled build (``--compiled-dir``,
default: the checkout's ``build/compiled``, made by ``make build-compiled``), round by round, and the
per-round ratios compiled / interpreted.

Rules:
  1. A child reports the build it imported (``environment.kvown_build``); a child that ran another
     build than asked is an error (exit status 2), never a figure.
  2. The builds alternate within each round and ratios are taken within a round, then the median: this
     VM's speed drifts 10-25 % between identical runs, and the drift then hits both builds alike.
  3. Every child is bounded (``--timeout-s``; past it its process group is killed and the run fails).
  4. "own" is the engine CPU minus the CPU inside NIXL calls (the cost module's breakdown pass); the
     NIXL share is reported beside it: it is what a raw NIXL loop pays for the same calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvown.adapters.mpirun import kill_group
from kvown.apps.benchmarks.common import count, emit, environment, plot_figure, progress, save
from kvown.apps.benchmarks.registry import CHECKOUT

BUILDS = ("interpreted", "compiled")
FIGURES = (  # name -> where the cost module's JSON has it
    ("sender_cpu_us", ("engine", "sender_cpu_us")),
    ("receiver_cpu_us", ("engine", "receiver_cpu_us")),
    ("sender_own_us", ("engine_breakdown", "sender", "python_cpu_us")),
    ("receiver_own_us", ("engine_breakdown", "receiver", "python_cpu_us")),
    ("sender_nixl_us", ("engine_breakdown", "sender", "nixl_cpu_us")),
    ("receiver_nixl_us", ("engine_breakdown", "receiver", "nixl_cpu_us")),
    ("wall_us", ("engine", "wall_us")),
)


class BuildMismatch(RuntimeError):
    """A child imported another build than the one asked for (rule 1)."""


def _child(build: str, tree: Path, sessions: int, timeout_s: float) -> dict[str, Any]:
    """One cost run of ``build`` from ``tree``: its figures (rule 4), checked against rule 1."""
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONSAFEPATH="1")  # the tree first, never the cwd
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cost.json"
        cmd = [sys.executable, "-m", "kvown.apps.benchmarks.cost", "--parts", "engine", "--sessions",
               str(sessions), "--reps", "1", "--no-progress", "--json", str(out)]
        proc = subprocess.Popen(cmd, env=env, cwd=tmp, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            raise TimeoutError(f"the {build} cost run passed {timeout_s:.0f} s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"the {build} cost run exited {proc.returncode}: {err.decode()[-2000:]}")
        raw = json.loads(out.read_text())
    ran = raw["environment"].get("kvown_build")
    if ran != build:
        raise BuildMismatch(f"asked for the {build} build from {tree}, the child imported {ran!r}")
    figures: dict[str, Any] = {}
    for name, path in FIGURES:
        value: Any = raw
        for key in path:
            value = value[key]
        figures[name] = float(value)
    return figures


def run(source: Path, compiled: Path, rounds: int, sessions: int, timeout_s: float, bar: bool) -> dict[str, Any]:
    trees = {"interpreted": source, "compiled": compiled}
    per_round: list[dict[str, dict[str, float]]] = []
    with progress(rounds * len(BUILDS), "builds: cost runs", bar) as pbar:
        for r in range(rounds):
            order = BUILDS if r % 2 == 0 else BUILDS[::-1]  # rule 2: neither build always goes first
            row = {}
            for build in order:
                row[build] = _child(build, trees[build], sessions, timeout_s)
                row[build]["load_1min"] = os.getloadavg()[0]
                pbar.update(1)
            per_round.append(row)
    names = [name for name, _ in FIGURES]
    medians = {b: {n: round(statistics.median(row[b][n] for row in per_round), 1) for n in names} for b in BUILDS}
    ratios = {n: round(statistics.median(row["compiled"][n] / row["interpreted"][n] for row in per_round
                                         if row["interpreted"][n] > 0), 3) for n in names}
    return {"benchmark": "builds", "environment": environment(), "sessions": sessions, "rounds": rounds,
            "trees": {b: str(t) for b, t in trees.items()}, "medians": medians,
            "ratio_compiled_over_interpreted": ratios, "per_round": per_round}


def report(r: dict[str, Any]) -> None:
    print(f"builds  {r['rounds']} rounds x {r['sessions']} sessions per build, alternating (1 x 64 KiB, real NIXL)")
    print(f"  {'per session':18s} {'interpreted':>12s} {'compiled':>10s} {'ratio':>7s}  (median; ratio per round)")
    for name, _ in FIGURES:
        m = r["medians"]
        print(f"  {name:18s} {m['interpreted'][name]:10.1f}us {m['compiled'][name]:8.1f}us "
              f"{r['ratio_compiled_over_interpreted'][name]:7.3f}")


def plot(r: dict[str, Any], path: str) -> None:
    fig, (ax,) = plot_figure(path, 1, "engine CPU per session: interpreted vs compiled hot path")
    names = [name for name, _ in FIGURES if name != "wall_us"]
    xs = range(len(names))
    for i, build in enumerate(BUILDS):
        ax.bar([x + 0.4 * i for x in xs], [r["medians"][build][n] for n in names], width=0.4, label=build)
    ax.set_xticks([x + 0.2 for x in xs], names, rotation=30, ha="right")
    ax.set_ylabel("µs per session (median of rounds)")
    ax.legend()
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvown bench builds", description=__doc__.split("\n\n")[0])
    ap.add_argument("--source-dir", type=Path, default=CHECKOUT, help="the interpreted tree (a checkout)")
    ap.add_argument("--compiled-dir", type=Path, default=CHECKOUT / "build" / "compiled",
                    help="the compiled build (make build-compiled)")
    ap.add_argument("--rounds", type=count, default=4)
    ap.add_argument("--sessions", type=count, default=3000)
    ap.add_argument("--timeout-s", type=float, default=300.0, help="bound of one child run")
    ap.add_argument("--quick", action="store_true", help="2 rounds x 300 sessions (smoke test)")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=sys.stderr.isatty())
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.sessions = 2, 300
    for flag, tree in (("--source-dir", args.source_dir), ("--compiled-dir", args.compiled_dir)):
        if not (tree / "kvown" / "__init__.py").is_file():
            print(f"kvown bench builds: {flag} {tree} holds no kvown package"
                  + (" (run `make build-compiled`)" if flag == "--compiled-dir" else ""), file=sys.stderr)
            return 2
    if args.rounds < 1 or args.sessions < 1:
        print("kvown bench builds: --rounds and --sessions must be >= 1", file=sys.stderr)
        return 2
    try:
        result = run(args.source_dir.resolve(), args.compiled_dir.resolve(), args.rounds, args.sessions,
                     args.timeout_s, args.progress)
    except BuildMismatch as exc:
        print(f"kvown bench builds: {exc}", file=sys.stderr)
        return 2
    return emit(result, args, report, plot)


if __name__ == "__main__":
    sys.exit(main())
