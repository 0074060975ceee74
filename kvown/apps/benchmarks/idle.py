"""``kvown bench idle``: what an idle kvown rank costs the code that shares its process.

A server embeds kvown in the process that runs its model (a vLLM worker), so between transfers the
engine thread naps and polls beside the model's Python. Each wake-up takes the GIL from that code. This
workload runs two stand-ins for it - small torch ops in a loop (each releases the GIL, as a forward on
CPU does) and a pure-Python loop - alone and beside one idle rank (``connect_local``, both roles):
  fixed    naps of ``idle_sleep_s`` only (``idle_sleep_max_s`` = ``idle_sleep_s``): kvown before the
           quiet back-off, and still what a rank with an open session does
  backoff  the defaults: a quiet rank naps twice as long each time, up to ``idle_sleep_max_s``
  open     the defaults, with one send open that nobody publishes to: a rank with work in hand keeps
           naps of ``idle_sleep_s`` (what a server under load sees between its transfers)

Rules:
  1. Baseline in the same run: every round measures alone, fixed and backoff, in a rotating order, and
     a slowdown is the median over rounds of (beside / alone of the same round): this VM drifts.
  2. A rank is measured only after ``--settle-s`` (past its spin and the back-off's climb); its engine's
     CPU over the measured window comes from the public ``statistics().engine_cpu_ns``.
  3. Every run is bounded: each neighbour loop has a fixed size, each rank is closed before the next.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

from kvown.apps.benchmarks.common import count, emit, environment, plot_figure, progress, save
from kvown import make_request_id

MODES = ("alone", "fixed", "backoff", "open")


def _torch_ops(n: int) -> Callable[[], None]:
    import torch

    a, b = torch.randn(64, 64), torch.randn(64, 64)

    def run() -> None:
        x = a
        for _ in range(n):
            x = torch.tanh(x @ b * 0.01)

    return run


def _python_loop(n: int) -> Callable[[], None]:
    def run() -> None:
        table: dict[int, int] = {}
        total = 0
        for i in range(n):
            table[i & 1023] = i
            total += table.get((i * 7) & 1023, 0)

    return run


def neighbours(quick: bool) -> dict[str, Callable[[], None]]:
    """The code beside the rank: each call is a few tens of milliseconds on this VM."""
    scale = 4 if quick else 1
    return {"torch_ops": _torch_ops(1500 // scale), "python": _python_loop(100_000 // scale)}


def _timed_ms(fn: Callable[[], None], reps: int) -> float:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e6)
    return statistics.median(out)


def _rank(mode: str) -> Any:
    import kvown
    from kvown import KVLayout, TransferConfig

    config = TransferConfig()
    if mode == "fixed":
        config = TransferConfig(idle_sleep_max_s=config.idle_sleep_s)
    layout = KVLayout.standard(num_layers=2, num_blocks=64, tokens_per_block=16, num_kv_heads=2, head_dim=64)
    return kvown.connect_local({0: {"sender", "receiver"}}, config=config, layout=layout)[0]


def measure(mode: str, work: dict[str, Callable[[], None]], reps: int, settle_s: float) -> dict[str, float]:
    """One mode of one round: each neighbour's median time, and the engine's CPU share meanwhile."""
    rt = None if mode == "alone" else _rank(mode)
    request_id = make_request_id(1, 1)
    try:
        if mode == "open":
            rt.sender.send(request_id, range(1))
        if rt is not None:
            time.sleep(settle_s)
            cpu0, t0 = rt.statistics().engine_cpu_ns, time.perf_counter_ns()
        out = {name: _timed_ms(fn, reps) for name, fn in work.items()}
        if rt is not None:
            cpu1, t1 = rt.statistics().engine_cpu_ns, time.perf_counter_ns()
            if cpu0 is not None and cpu1 is not None:
                out["engine_cpu_share"] = (cpu1 - cpu0) / (t1 - t0)
        return out
    finally:
        if mode == "open":
            rt.sender.cancel(request_id)
        if rt is not None:
            rt.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = neighbours(args.quick)
    rounds: list[dict[str, dict[str, float]]] = []
    with progress(args.rounds, "idle rank beside code", args.progress) as bar:
        for r in range(args.rounds):
            order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]  # rule 1: no mode always runs first
            rounds.append({mode: measure(mode, work, args.reps, args.settle_s) for mode in order})
            bar.update(1)
    summary: dict[str, Any] = {}
    for mode in MODES[1:]:
        row: dict[str, Any] = {}
        for name in work:
            ratios = [rd[mode][name] / rd["alone"][name] for rd in rounds]
            row[f"{name}_slowdown"] = round(statistics.median(ratios), 3)
            row[f"{name}_slowdown_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
        shares = [rd[mode]["engine_cpu_share"] for rd in rounds if "engine_cpu_share" in rd[mode]]
        row["engine_cpu_share"] = round(statistics.median(shares), 4) if shares else None
        summary[mode] = row
    return {"benchmark": "kvown bench idle", "options": vars(args), "rounds": rounds, "summary": summary,
            "environment": environment()}


def report(result: dict[str, Any]) -> None:
    print("kvown bench idle: the code beside one idle rank, slowdown against alone (median of rounds)")
    for mode, row in result["summary"].items():
        share = row["engine_cpu_share"]
        cells = ", ".join(f"{k.removesuffix('_slowdown')} {v:.3f}x" for k, v in row.items()
                          if k.endswith("_slowdown"))
        print(f"  {mode:8s} {cells}; engine CPU {share * 100 if share is not None else float('nan'):.1f} %")


def plot(result: dict[str, Any], path: str) -> None:
    import numpy as np

    fig, axes = plot_figure(path, 1, f"kvown bench idle ({result['environment']['date']}, "
                                     f"load {result['environment']['loadavg'][0]})")
    ax = axes[0]
    names = [k for k in next(iter(result["summary"].values())) if k.endswith("_slowdown")]
    x = np.arange(len(names))
    for i, (mode, row) in enumerate(result["summary"].items()):
        ax.bar(x + (i - 1) * 0.27, [row[n] for n in names], 0.27, label=mode)
    ax.axhline(1.0, color="black", lw=1)
    ax.set_xticks(x, [n.removesuffix("_slowdown") for n in names])
    ax.set_ylabel("time beside the idle rank / alone")
    ax.legend()
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvown bench idle", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=count, default=9)
    ap.add_argument("--reps", type=count, default=7, help="timed calls of each neighbour per mode and round")
    ap.add_argument("--settle-s", type=float, default=0.1)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=sys.stderr.isatty())
    args = ap.parse_args(argv)
    if not 0.0 < args.settle_s <= 10.0:
        ap.error(f"--settle-s: {args.settle_s} (want 0 < s <= 10)")
    if args.quick:
        args.rounds, args.reps = min(args.rounds, 3), min(args.reps, 3)
    result = run(args)
    return emit(result, args, report, plot)


if __name__ == "__main__":
    sys.exit(main())
