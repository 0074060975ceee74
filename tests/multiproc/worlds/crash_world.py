"""One cell of the crash matrix: a real mpirun world in which one rank dies at a named protocol point.

argv: MODE POINT ROLE KIND OUT [MUTANT]

  MODE   gen-first   2 ranks; the receiver publishes, then the writer opens its send session
         ctx-first   2 ranks; the writer opens its session (KV ready) first, then the receiver publishes
         fan-in      3 ranks; writers 0 and 1 each write one head slice of every request
         broadcast   3 ranks; published to writers 0 and 1, one slice: writer 0 delivers, writer 1 is a
                     candidate that must acknowledge
  POINT  a crash point of kvown.testing.faults (CRASH_POINTS), or "none" (the workload runs to the
         end and every rank reports how often it passed each point)
  ROLE   which rank dies: "sender" (rank 0) or "receiver" (the last rank)
  KIND   "kill": SIGKILL; "raise": an uncaught exception in the victim's main thread; "freeze": SIGSTOP
         (the victim is alive and silent: a wedged or swapped-out writer)
  MUTANT ""; "retire-without-proof": the receiver retires a cancelled session without waiting for the
         writers' proof; "timer-free": the receiver stops waiting for the writers of a session that
         timed out; "no-exit-hooks": the runtime's exit hooks are off (a rank whose main thread dies
         leaves its peers running); "no-sigterm-dump": the ranks do not install the launcher-SIGTERM
         flight-recorder dump; "no-executor-dump": the fail-stop executor skips its diagnostics

The point is seen by one rank's transport (the receiver's for before-publish, request-data,
cancel-sent and retire; writer 0's for the others) - the *observer*. When it fires, the observer writes
OUT/crash.json (point, observer, victim, kind, monotonic ns) and then kills the victim: SIGKILL of its
PID, or SIGUSR1, whose handler raises ``InjectedCrash`` in the victim's main thread. An observer that
is its own victim in "raise" parks its engine thread inside the transport call, so the rank stops
exactly at the point while its main thread dies.

Workload: 8 requests one after another, 3 blocks each from an 8-block pool (so blocks are reused), odd
requests cancelled by the receiver right after publication. Canaries are on. Every rank blocks
SIGTERM first and dumps its flight recorder when the launcher terminates it (OUT/term/), and its
fail-stop executor dumps into OUT (KVOWN_FLIGHT_DIR); a world that ends normally leaves the
receiver's recorder in OUT/end/. Every rank writes OUT/rank{R}.json with its pid at start and its
counts at the end. Every wait is bounded.

The lost-frame worlds (tests/multiproc/test_lost_frames_world.py) reuse this one with POINT "none":
``CRASH_WORLD_PLAN`` adds fault-plan entries (``drop-frame:rank=0:nth=3``) and ``CRASH_WORLD_TIMEOUT_S``
sets the transfer timeout and the grace (default 5 s each).
"""

from __future__ import annotations

import signal

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # before any thread exists (see failstop.py)

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from mpi4py import MPI  # noqa: E402

from kvown import KVLayout, Outcome, TransferConfig, connect_mpi, make_request_id  # noqa: E402
from kvown.adapters.mpi import process_start_ticks  # noqa: E402
from kvown.kernels.nvfp4 import fill_pattern  # noqa: E402
from kvown.runtime.failstop import install_sigterm_dump  # noqa: E402
from kvown.testing.faults import CRASH_POINTS, fault_wrapper  # noqa: E402

MODE, POINT, ROLE, KIND, OUT = sys.argv[1:6]
MUTANT = sys.argv[6] if len(sys.argv) > 6 else ""
OUT_DIR = Path(OUT)
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
RX = size - 1
WRITERS = (0,) if MODE in ("gen-first", "ctx-first") else (0, 1)
SLICES = 2 if MODE == "fan-in" else 1
SELECTED = (0,) if MODE == "broadcast" else WRITERS  # the writers that open send sessions
RX_POINTS = ("before-publish", "request-data", "cancel-sent", "retire")
NTH = {
    "before-publish": 5,
    "request-data": 5,
    "write-posted": 3,
    "write-done": 3,
    "kv-result-sent": 3,
    "cancel-sent": 2,
    "quiesced-sent": 1,  # a cancel is proven by a carried result or a SESSION_QUIESCED, as timing decides
    "retire": 4,
}
OBSERVER = RX if POINT in RX_POINTS else 0
VICTIM = 0 if ROLE == "sender" else RX
REQUESTS, BLOCKS, POOL = 8, 3, 8
LIFETIME_S = 60.0  # every wait below ends by then
TAG_PUBLISHED, TAG_READY, TAG_DONE = 21, 22, 23
LAYOUT = KVLayout.standard(
    num_layers=1, num_blocks=POOL, tokens_per_block=4, num_kv_heads=2, head_dim=16, dtype="bfloat16"
)
if POINT != "none" and POINT not in CRASH_POINTS:
    raise SystemExit(f"unknown point {POINT}")


class InjectedCrash(RuntimeError):
    """Raised in a victim's main thread by its SIGUSR1 handler ("raise" kind)."""


def on_usr1(signum, frame):
    raise InjectedCrash(f"injected crash at {POINT} ({MODE}, observer {OBSERVER})")


signal.signal(signal.SIGUSR1, on_usr1)
sys.setswitchinterval(2e-4)  # as kvown's own worlds (demo, qualify): the engine must not hold the GIL 5 ms


def write_json(name: str, **fields) -> None:
    tmp = OUT_DIR / f".{name}.tmp{rank}"
    tmp.write_text(json.dumps(fields))
    tmp.rename(OUT_DIR / name)


if POINT == "none":  # count every point: entries that never fire still count the calls they see
    plan = ",".join(f"crash-{p}:nth=1000000" for p in CRASH_POINTS)
else:
    plan = f"crash-{POINT}:rank={OBSERVER}:nth={NTH[POINT]}"
plan = ",".join(filter(None, [plan, os.environ.get("CRASH_WORLD_PLAN", "")]))
TIMEOUT_S = float(os.environ.get("CRASH_WORLD_TIMEOUT_S", "5"))
if MUTANT == "retire-without-proof" and rank == RX:
    from kvown.core import receiver as _receiver

    _has_claims = _receiver.ReceiveSession.has_claims
    _receiver.ReceiveSession.has_claims = lambda s: (
        False if s.outcome is Outcome.CANCELLED else _has_claims(s)
    )
if MUTANT == "timer-free" and rank == RX:
    from kvown.core import receiver as _receiver

    _writer_claims = _receiver.ReceiveSession.writer_claims
    _receiver.ReceiveSession.writer_claims = lambda s: (
        False if s.outcome is Outcome.TIMED_OUT else _writer_claims(s)
    )

config = TransferConfig(transfer_timeout_s=TIMEOUT_S, grace_s=TIMEOUT_S, canary=True)
rt = connect_mpi(comm, layout=LAYOUT, config=config, roles={"receiver"} if rank == RX else {"sender"},
                 wrap_transport=fault_wrapper(plan))
(OUT_DIR / "term").mkdir(exist_ok=True)
if MUTANT != "no-sigterm-dump":
    install_sigterm_dump(rt.driver.recorder, dump_dir=OUT_DIR / "term")
if MUTANT == "no-executor-dump":
    rt.executor._dump_thread = None  # FailStopExecutor: no diagnostics thread, straight to the kill
if MUTANT == "no-exit-hooks":
    rt.closed = True  # the excepthook and the interpreter-exit hook both stand down for a closed runtime
pids = comm.allgather(os.getpid())
write_json(f"rank{rank}.json", rank=rank, pid=pids[rank], pids=pids, start_ticks=process_start_ticks(pids[rank]))
current = {"request": -1}
main_ident = threading.main_thread().ident


def crash(point: str) -> None:
    """The observer's crash action (engine thread, inside the transport call at the point)."""
    write_json(
        "crash.json",
        point=point,
        observer=rank,
        victim=VICTIM,
        kind=KIND,
        t_ns=time.monotonic_ns(),
        request=current["request"],
    )
    if KIND in ("kill", "freeze"):
        os.kill(pids[VICTIM], signal.SIGKILL if KIND == "kill" else signal.SIGSTOP)  # own pid: stops right here
        return
    if rank != VICTIM:
        os.kill(pids[VICTIM], signal.SIGUSR1)
        return
    signal.pthread_kill(main_ident, signal.SIGUSR1)
    end = time.monotonic() + LIFETIME_S
    while time.monotonic() < end:  # park at the point; the world is going down
        time.sleep(0.01)


rt.engine.call(lambda driver: setattr(driver.transport, "crash_action", crash))
pool = rt.engine.pool
comm.Barrier()
deadline = time.monotonic() + LIFETIME_S


def wait_for(cond, what: str) -> None:
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: {what} did not happen within {LIFETIME_S} s")
        time.sleep(0.001)


def recv_from(source: int, tag: int):
    request = comm.irecv(source=source, tag=tag)
    box = {}

    def done() -> bool:
        ok, value = request.test()
        if ok:
            box["v"] = value
        return ok

    wait_for(done, f"message {tag} from rank {source}")
    return box["v"]


def rid_of(i: int) -> int:
    return make_request_id(1, i)


def run_receiver() -> dict:
    outcomes = []
    for i in range(REQUESTS):
        current["request"] = i
        rid = rid_of(i)
        if MODE == "ctx-first":
            for w in SELECTED:
                recv_from(w, TAG_READY)
        handle = rt.receiver.receive(rid, BLOCKS, WRITERS, num_slices=SLICES)
        if MODE != "ctx-first":
            for w in SELECTED:
                comm.send(i, dest=w, tag=TAG_PUBLISHED)
        if i % 2:
            rt.receiver.cancel(rid)
        else:
            wait_for(lambda: handle.landed.is_set() or handle.outcome.done(), f"request {i} landing")  # noqa: B023
        if not i % 2 and handle.landed.is_set():
            expected = pool.block_view(handle.blocks[0]).clone()
            for j, b in enumerate(handle.blocks):
                fill_pattern(expected, rid, 0, j)
                if not bool((pool.block_view(b) == expected).all()):
                    raise AssertionError(f"request {i} block {b} holds the wrong bytes")
            rt.receiver.release(rid)
        wait_for(handle.retired.is_set, f"request {i} retirement")
        outcomes.append(handle.outcome.result(1).value)
    return {"outcomes": outcomes}


def run_sender() -> dict:
    outcomes = []
    free = list(range(POOL))
    for i in range(REQUESTS):
        current["request"] = i
        rid = rid_of(i)
        if rank not in SELECTED:
            continue
        if MODE != "ctx-first":
            recv_from(RX, TAG_PUBLISHED)
        blocks = tuple(free[:BLOCKS])
        for j, b in enumerate(blocks):
            fill_pattern(pool.block_view(b), rid, 0, j)
        handle = rt.sender.send(rid, blocks)
        if MODE == "ctx-first":
            comm.send(i, dest=RX, tag=TAG_READY)
        wait_for(handle.released.is_set, f"request {i} release")
        outcomes.append(handle.outcome.result(1).value)
    return {"outcomes": outcomes}


result = run_receiver() if rank == RX else run_sender()
barrier = comm.Ibarrier()
wait_for(barrier.Test, "the end barrier")  # every rank is done: the counts below are final
counts = rt.engine.call(lambda d: {e.name.removeprefix("crash-"): e.seen for e in d.transport.plan.values()})
stats = rt.engine.statistics()
write_json(
    f"rank{rank}.end.json", rank=rank, counts=counts, pool=stats.pool.to_dict(), engine=dict(stats.counters), **result
)
if rank == RX:  # a world that ends normally leaves the receiver's recorder too (proof check, lost frames)
    (OUT_DIR / "end").mkdir(exist_ok=True)
    rt.driver.recorder.dump(OUT_DIR / "end", "end", include_stacks=False)
rt.exit(0)
