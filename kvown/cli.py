"""The ``kvown`` command line.

Owns: parsing the first word of argv and handing the rest, unchanged, to the subcommand's
``main(argv) -> int``. Nothing else.

Rules:
  1. Each subcommand is imported lazily, inside its branch, so ``kvown doctor`` works on a machine
     where, say, the benchmark's dependencies are broken, and ``kvown --help`` imports nothing heavy.
  2. A subcommand whose module is not in this build prints one clear line and returns 2; an import
     error inside an existing module is not hidden (it propagates with its traceback).

Invariants:
  1. The argv a subcommand receives is exactly what followed its name on the command line.
  2. ``main`` returns an int exit status; it never calls ``sys.exit`` itself.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import kvown

# name -> ("module:function", one-line help). The function is ``main(argv: list[str]) -> int``.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("kvown.apps.demo:main", "run the main job: context ranks write KV into generation ranks"),
    "bench": ("kvown.apps.bench:main", "run the reproducible benchmarks (JSON + PNG output)"),
    "qualify": ("kvown.apps.qualify:main", "qualify a deployment: scenarios, UCX transports, fail-stop"),
    "doctor": ("kvown.apps.doctor:main", "print what this machine offers, one line per part"),
    "inspect": ("kvown.apps.inspect:inspect_main", "read flight-recorder dumps (--hops: time across ranks)"),
    "serve": ("kvown.apps.serve.cli:main", "reference disaggregated server: prefill|decode|single|router|local"),
}


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser (subcommand options belong to the subcommand, not here)."""
    commands = "\n".join(f"  {name:<9} {text}" for name, (_, text) in SUBCOMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="kvown",
        usage="kvown [--version] COMMAND [ARGS...]",
        description="kvown: KV-transfer ownership runtime for disaggregated LLM inference.",
        epilog=f"commands:\n{commands}\n\nRun 'kvown COMMAND --help' for a command's own options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvown {kvown.__version__}")
    parser.add_argument("command", choices=sorted(SUBCOMMANDS), metavar="COMMAND", help=argparse.SUPPRESS)
    # Everything after COMMAND, options included, belongs to the subcommand (invariant 1).
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _is_missing_module(error: ModuleNotFoundError, module_name: str) -> bool:
    """True when ``error`` says ``module_name`` itself (or a parent package) is absent."""
    missing = error.name or ""
    return missing == module_name or module_name.startswith(missing + ".")


def dispatch(command: str, argv: list[str]) -> int:
    """Import the subcommand lazily and run it.

    Called: once per process, from the main thread.
    After error: a missing module or function returns 2 with a message on stderr; exceptions raised
    by the subcommand itself propagate.
    """
    target, _ = SUBCOMMANDS[command]
    module_name, function_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if not _is_missing_module(error, module_name):
            raise
        print(f"kvown {command}: not available in this build (module {module_name} is missing)", file=sys.stderr)
        return 2
    function = getattr(module, function_name, None)
    if function is None:
        print(f"kvown {command}: {module_name} has no {function_name}() entry point", file=sys.stderr)
        return 2
    status = function(argv)
    return int(status) if status is not None else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvown`` console script and ``python -m kvown``.

    Called: once per process, from the main thread.
    After error: usage errors exit 2 through argparse; see ``dispatch`` for the rest.
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not arguments:
        parser.print_usage(sys.stderr)
        print(f"kvown: choose a command: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    args = parser.parse_args(arguments)
    return dispatch(args.command, list(args.args))
