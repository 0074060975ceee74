"""One rank of a real-mpirun fail-stop scenario (see tests/multiproc/test_failstop_world.py).

Usage: mpirun -n N python failstop_rank.py SCENARIO OUT_DIR [--deadline-s S] [--block-logger]

Scenarios:
  claim        rank 0 holds request 7's claim, which never settles; its watchdog fail-stops at the
               deadline; every other rank blocks in a barrier rank 0 never joins.
  crash        rank 0's executor loop raises; the crash guard kills after KVOWN_RANK_CRASH_GRACE_S;
               rank 1 blocks in a barrier.
  crash-blocking-cleanup   as crash, but rank 0's cleanup blocks (30 s, bounded).
  crash-delivered          as crash, but the error reaches a "client" during the grace: no kill;
               rank 0 then joins the barrier and both ranks exit 0.
  split        4 ranks as two 2-rank executors (world split by rank // 2): executor A runs "claim";
               executor B keeps doing barriers and counts them, to see whether A's abort reaches it.
  threadlevel  qualify_world must refuse (run with MPI4PY_RC_THREAD_LEVEL=serialized); exit 3.
  hello        qualify, barrier, exit 0 (a fresh world after a fail-stop).

Every rank writes OUT_DIR/rank{R}.json ({rank, pid, start_ticks, ...}) once qualified, so the test can
watch its PID. Exit codes that mean "was not killed": 3 (refused), 4 (barrier returned), 5 (timed out).
"""

from __future__ import annotations

import signal

# First statement, before anything can start a thread (importing kvown starts torch's and MPI's):
# every thread inherits this mask, so launcher SIGTERM can only be taken by the sigwait dump thread.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from kvown.adapters.mpi import process_start_ticks  # noqa: E402
from kvown.core.actions import FailStop, FatalReason  # noqa: E402
from kvown.core.events import OpenReceive  # noqa: E402
from kvown.core.machine import CoreConfig  # noqa: E402
from kvown.core.receiver import ReceiverCore  # noqa: E402
from kvown.runtime.failstop import (  # noqa: E402
    FailStopExecutor,
    install_sigterm_dump,
    sigterm_blocked_everywhere,
)
from kvown.runtime.flight import FlightRecorder  # noqa: E402

REQUEST_ID = 7
MAX_LIFETIME_S = 30.0  # every wait below is bounded by this

args_parser = argparse.ArgumentParser()
args_parser.add_argument("scenario")
args_parser.add_argument("out")
args_parser.add_argument("--deadline-s", type=float, default=1.0)
args_parser.add_argument("--block-logger", action="store_true")
args = args_parser.parse_args()
out = Path(args.out)

# A peer's abort arrives here as launcher SIGTERM: this rank's recorder is dumped by the sigwait thread
# even while its main thread sits in a barrier.
recorder = FlightRecorder(rank=int(os.environ.get("OMPI_COMM_WORLD_RANK", "-1")))
install_sigterm_dump(recorder, dump_dir=out)

from mpi4py import MPI  # noqa: E402

from kvown.adapters.mpi import qualify_world  # noqa: E402
from kvown.core.errors import ConfigError  # noqa: E402
from kvown.runtime.crashguard import CrashGuard  # noqa: E402
from kvown.runtime.watchdog import RetirementWatchdog  # noqa: E402


def write_info(rank: int, **extra: object) -> None:
    info = {
        "rank": rank,
        "pid": os.getpid(),
        "start_ticks": process_start_ticks(os.getpid()),
        "sigterm_dump_reliable": sigterm_blocked_everywhere(),
        **extra,
    }
    tmp = out / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(info))
    tmp.rename(out / f"rank{rank}.json")  # atomic: the test never reads half a file



def block_logging_forever() -> None:
    """A handler wedged in emit (holding its lock), and this thread stuck behind it, as a full pipe does."""
    entered = threading.Event()

    class Wedged(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            entered.set()
            time.sleep(MAX_LIFETIME_S)

    logging.getLogger().addHandler(Wedged())
    threading.Thread(target=logging.error, args=("wedged",), name="wedged-logger", daemon=True).start()
    entered.wait(5)
    recorder.record("logger_wedged", None)


def start_runtime(world):  # type: ignore[no-untyped-def]
    """As a real rank does at startup: executor and watchdog exist before any claim does."""
    lock = threading.Lock()
    half_ns = int(args.deadline_s * 1e9) // 2  # transfer timeout + drain grace = the fail-stop deadline
    core = ReceiverCore(CoreConfig(rank=0, timeout_ns=half_ns, grace_ns=half_ns, peers=(1,)))
    watchdog = RetirementWatchdog(core, lock, FailStopExecutor(world, recorder, dump_dir=out))
    watchdog.start()
    return core, lock, watchdog


def hold_claim(runtime, deadline_ns: int) -> None:  # type: ignore[no-untyped-def]
    core, lock, watchdog = runtime
    with lock:  # the real receiver core: request 7 published to writer 1, which never answers
        exposed_ns = deadline_ns - core.config.timeout_ns - core.config.grace_ns
        core.handle(OpenReceive(REQUEST_ID, (0, 1), (1,)), exposed_ns)
    watchdog.wake()
    if args.block_logger:
        block_logging_forever()
    end = time.monotonic() + MAX_LIFETIME_S
    while time.monotonic() < end:  # the engine thread carries on; the watchdog does the killing
        time.sleep(0.05)
    sys.exit(5)


def claim(world) -> None:  # type: ignore[no-untyped-def]
    comm = world.comm
    runtime = start_runtime(world) if world.rank == 0 else None
    deadline_ns = comm.bcast(time.monotonic_ns() + int(args.deadline_s * 1e9) if world.rank == 0 else None)
    recorder.record("publish", REQUEST_ID, deadline_ns=deadline_ns, receiver_rank=0)
    write_info(MPI.COMM_WORLD.Get_rank(), deadline_ns=deadline_ns)
    if runtime is not None:
        hold_claim(runtime, deadline_ns)
    comm.Barrier()  # never completes: rank 0 never joins
    sys.exit(4)


def crash(world, mode: str) -> None:  # type: ignore[no-untyped-def]
    comm = world.comm
    if world.rank != 0:
        write_info(world.rank)
        comm.Barrier()  # completes only if rank 0 survives its crash (delivered mode)
        sys.exit(0 if mode == "crash-delivered" else 4)
    executor = FailStopExecutor(world, recorder, dump_dir=out)
    guard = CrashGuard(lambda: executor.execute(FailStop(FatalReason.RANK_CRASH, None, repr(guard.error))),
                       world_size=world.size)

    def loop(g: CrashGuard) -> None:
        recorder.record("loop_start", None)
        write_info(0, crash_ns=time.monotonic_ns(), grace_s=g.grace_s)
        raise RuntimeError("executor loop died")

    def cleanup() -> None:
        if mode == "crash-blocking-cleanup":
            time.sleep(MAX_LIFETIME_S)
        if mode == "crash-delivered":
            guard.error_delivered.set()  # the stashed error was handed to a client

    try:
        guard.run(loop, cleanup)
    except RuntimeError:
        pass
    if mode != "crash-delivered":
        sys.exit(5)  # only reached if the kill did not happen
    comm.Barrier()
    sys.exit(0)


def split() -> None:
    world_comm = MPI.COMM_WORLD
    color = world_comm.Get_rank() // 2
    sub = world_comm.Split(color, world_comm.Get_rank())
    world = qualify_world(sub, expected_size=2)
    if color == 0:
        claim(world)
    write_info(world_comm.Get_rank(), executor="B")
    rounds = 0
    end = time.monotonic() + MAX_LIFETIME_S
    progress = out / f"progress{world_comm.Get_rank()}.txt"
    while time.monotonic() < end:
        sub.Barrier()
        rounds += 1
        tmp = progress.with_suffix(".tmp")
        tmp.write_text(str(rounds))
        tmp.rename(progress)  # atomic: the kill may land at any instruction
        time.sleep(0.02)
    sys.exit(0)


def main() -> None:
    if args.scenario == "split":
        split()
    try:
        world = qualify_world(expected_size=MPI.COMM_WORLD.Get_size())
    except ConfigError as exc:
        print(f"kvown refused to start: {exc}", file=sys.stderr, flush=True)
        sys.exit(3)
    recorder.rank = world.rank
    if args.scenario == "claim":
        claim(world)
    elif args.scenario.startswith("crash"):
        crash(world, args.scenario)
    elif args.scenario == "hello":
        write_info(world.rank)
        world.comm.Barrier()
        sys.exit(0)
    raise SystemExit(f"unknown scenario {args.scenario}")


main()
