"""The registry of ``kvown bench`` workloads (name -> ``Workload``), their command lines and bounded runs.

Rules (``kvown.apps.bench`` has the why):
  1. A workload is a module of the installed package with ``main(argv)``, run as ``python -m MODULE``;
     checkout-only scripts (``script``) say so with FileNotFoundError when there is no checkout.
  2. ``ranks``: an MPI world started with ``mpirun -n ranks`` (``kvown.adapters.mpirun``).
  3. Every run is bounded: past its timeout its process group is killed and it reports 124.

Used by ``kvown.apps.bench`` (the CLI) and ``kvown.apps.benchmarks.suite`` (every workload in one run).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvown.adapters.mpirun import kill_group, mpirun_command

CHECKOUT = Path(__file__).resolve().parents[3]  # a source checkout, when kvown runs from one


@dataclass(frozen=True)
class Workload:
    module: str  # run as ``python -m module`` (or a script under benchmarks/ when ``script`` is set)
    ranks: int | None  # ``mpirun -n ranks`` for an MPI world; None: a plain process
    help: str
    args: tuple[str, ...] = ()  # fixed options that select the workload inside the module
    script: str | None = None  # benchmarks/<script> of a checkout (rule 1: checkout-only workloads)
    quick_ranks: int | None = None  # ranks under --quick, when fewer
    workdir: bool = False  # takes ``--out DIR`` for the files of its worlds (else it makes a temp dir)


REGISTRY: dict[str, Workload] = {
    "suite": Workload("kvown.apps.benchmarks.suite", None, "every workload below vs its baselines; one JSON with `metrics`"),
    "world": Workload("kvown.apps.benchmarks.world", 2, "W1 happy path + W2 cancellation sweep vs B0 raw NIXL / B1 timeout",
                      ("--workloads", "w1,w2")),
    "fanin": Workload("kvown.apps.benchmarks.world", 4, "W3 fan-in, 1-3 writers", ("--workloads", "w3"), quick_ranks=3),
    "descriptors": Workload("kvown.apps.benchmarks.cost", None, "W4 descriptor sweep, 16-256 tokens per block",
                            ("--parts", "w4")),
    "frozen": Workload("kvown.apps.benchmarks.frozen", None, "W5 frozen writer: deadline -> world gone, nothing retired early",
                       workdir=True),
    "cost": Workload("kvown.apps.benchmarks.cost", None, "engine CPU per session, scale (10k sessions, 1M fences), fence",
                     ("--parts", "engine,scale,fence")),
    "fence": Workload("kvown.apps.benchmarks.cost", None, "cancellation fence: bytes per fenced id at 1M ids",
                      ("--parts", "fence")),
    "builds": Workload("kvown.apps.benchmarks.builds", None, "engine CPU per session: interpreted vs compiled hot "
                       "path, alternating rounds (needs make build-compiled)"),
    "idle": Workload("kvown.apps.benchmarks.idle", None, "the code beside one idle rank (torch ops, Python): "
                     "fixed naps vs the quiet back-off, against alone"),
    "control": Workload("kvown.apps.benchmarks.control", None, "NIXL notification RTT, ZeroMQ RTT, WRITE post -> DONE"),
    "kernels": Workload("kvown.apps.benchmarks.kernels", None, "NVFP4 quantize/dequantize and checksum vs torch's copy"),
    "failstop": Workload("", None, "deadline -> world dead (MPI_Abort); across hosts: --test-hosts N",
                         script="bench_failstop.py"),
    "link": Workload("", None, "session latency on a slow / lossy link between two test hosts (root)",
                     script="bench_link.py"),
    "serve": Workload("", None, "reference server: TTFT and tokens/s, disaggregated vs single process",
                      script="bench_serve.py"),
    "soak": Workload("kvown.apps.soak", None, "soak: --minutes N of the demo workload with faults; leaks, RSS, fences"),
    "vllm": Workload("kvown.apps.benchmarks.vllm", None, "real vLLM P/D: TTFT, ITL, tokens/s at c=1/4/16 per connector "
                     "vs single; --faults adds the fault matrix (needs .venv-vllm; --timeout-s 3600)"),
}


def build_command(name: str, extra: list[str], *, quick: bool = False,
                  fixed: tuple[str, ...] | None = None, ranks: int | None = None) -> list[str]:
    """The argv that runs workload ``name`` with ``extra`` options (``fixed`` replaces the registry's
    selecting options). Raises FileNotFoundError (rule 1)."""
    w = REGISTRY[name]
    if w.script is not None:
        path = CHECKOUT / "benchmarks" / w.script
        if not path.is_file():
            raise FileNotFoundError(f"kvown bench {name}: it drives the test worlds of a source checkout "
                                    f"(benchmarks/{w.script}), and there is none beside this kvown")
        program = [sys.executable, str(path)]
    else:
        program = [sys.executable, "-m", w.module, *(w.args if fixed is None else fixed)]
    if ranks is None or w.ranks is None:
        ranks = w.quick_ranks if quick and w.quick_ranks else w.ranks
    if ranks is None:
        return [*program, *extra]
    try:
        cmd = mpirun_command(ranks)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"kvown bench {name}: {exc}") from None
    return [*cmd, *program, *extra]


def child_env() -> dict[str, str]:
    """The environment of a workload: a checkout's kvown first on the path when we run from one."""
    env = dict(os.environ)
    if (CHECKOUT / "kvown" / "__init__.py").is_file() and (CHECKOUT / "pyproject.toml").is_file():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CHECKOUT), env.get("PYTHONPATH", "")]))
    return env


def run_bounded(cmd: list[str], timeout_s: float, name: str) -> int:
    """Run ``cmd`` in its own process group; kill the group past ``timeout_s`` (rule 3)."""
    proc = subprocess.Popen(cmd, env=child_env(), start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"kvown bench {name}: killed after {timeout_s:.0f} s", file=sys.stderr)
        kill_group(proc)
        return 124
    except KeyboardInterrupt:
        kill_group(proc)
        return 130
