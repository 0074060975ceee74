"""Real mpirun worlds for the runtime's start-up, exit and crash paths, and the bad-input matrix.

argv: SCENARIO OUT_DIR. Every rank writes OUT_DIR/rank{R}.json with its pid (so the test can watch it
die) and what it saw. Scenarios:

  engine-crash    rank 0's engine thread raises; its main thread then exits at once. Peers wait in a
                  barrier that never completes. The world must be gone within the fail-stop bound.
  sys-exit        rank 0 calls sys.exit(0) while peers wait in a barrier (no rt.exit): the exit
                  barrier times out after the rank-crash grace and the world is taken down.
  raise           rank 0's main thread raises while peers wait: the world is taken down at once.
  clean-return    every rank returns from its program without rt.exit(): they meet at the exit
                  barrier and finalize together (exit 0).
  busy-port       rank 1's metrics port is taken: every rank raises ConfigError naming rank 1.
  bad-input       rank 1 (receiver) and rank 0 (sender) try every bad API argument; each must raise a
                  typed error in the caller and leave the pool unchanged; then a good transfer works.

KVOWN_TEST_MUTANT=no-exit-hooks runs a scenario without the exit hooks (defect 13's fix reverted):
the test then expects the world to hang.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from mpi4py import MPI

from kvown import KVLayout, KvownError, TransferConfig, WriteTracker, connect_mpi, make_request_id
from kvown.rank import RankRuntime

if os.environ.get("KVOWN_TEST_MUTANT") == "no-exit-hooks":
    RankRuntime._install_exit_hooks = lambda self, **kwargs: None  # type: ignore[method-assign]

SCENARIO, OUT = sys.argv[1], Path(sys.argv[2])
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
LAYOUT = KVLayout.standard(num_layers=1, num_blocks=16, tokens_per_block=4, num_kv_heads=2, head_dim=8,
                           dtype="bfloat16")


def report(**fields) -> None:
    tmp = OUT / f".rank{rank}.tmp"
    tmp.write_text(json.dumps({"rank": rank, "pid": os.getpid(), **fields}))
    tmp.rename(OUT / f"rank{rank}.json")


def roles() -> set[str]:
    return {"sender"} if rank == 0 else {"receiver"}


def wait_forever_in_barrier() -> None:
    comm.Barrier()  # never completes in these scenarios: rank 0 is gone
    report(barrier_returned=True)
    time.sleep(60)


if SCENARIO == "busy-port":
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    base = comm.bcast(holder.getsockname()[1] - 1 if rank == 0 else None)  # rank 1 would serve base + 1
    try:
        connect_mpi(comm, layout=LAYOUT, config=TransferConfig(metrics_port=base), roles=roles())
        report(error=None)
    except KvownError as exc:
        report(error=type(exc).__name__, field=getattr(exc, "field", None), message=str(exc))
    sys.exit(0)

rt = connect_mpi(comm, layout=LAYOUT, config=TransferConfig(transfer_timeout_s=5.0), roles=roles())
report(started=True)

if SCENARIO == "engine-crash":
    comm.Barrier()
    if rank == 0:
        rt.engine.submit(object())  # not a command: the driver raises on the engine thread
        report(crash_ns=time.monotonic_ns())
        sys.exit(0)  # the main thread leaves at once; the kill must not depend on it
    wait_forever_in_barrier()

elif SCENARIO == "sys-exit":
    comm.Barrier()
    if rank == 0:
        report(exit_ns=time.monotonic_ns())
        sys.exit(0)
    wait_forever_in_barrier()

elif SCENARIO == "raise":
    comm.Barrier()
    if rank == 0:
        report(raise_ns=time.monotonic_ns())
        raise RuntimeError("the server's main loop died")
    wait_forever_in_barrier()

elif SCENARIO == "clean-return":
    comm.Barrier()
    report(returned=True)  # no rt.exit(): the interpreter-exit hook meets the others and finalizes

elif SCENARIO == "bad-input":
    from kvown.api import Receiver, Sender  # noqa: F401  (the facades under test)

    results: dict[str, str] = {}

    def expect(name: str, call) -> None:  # type: ignore[no-untyped-def]
        before = rt.engine.statistics().pool
        try:
            call()
            results[name] = "ACCEPTED"
        except KvownError as exc:
            results[name] = f"{type(exc).__name__}:{getattr(exc, 'field', '')}"
        except Exception as exc:  # noqa: BLE001 - an untyped error is a failure of the matrix
            results[name] = f"UNTYPED {type(exc).__name__}: {exc}"
        if rt.engine.statistics().pool != before:
            results[name] += " POOL_CHANGED"

    class NoQuery:
        pass

    good = make_request_id(9, 1)
    if rank == 1:
        rx = rt.receiver
        expect("writers_self", lambda: rx.receive(make_request_id(9, 10), 1, (1,)))
        expect("writers_unknown_rank", lambda: rx.receive(make_request_id(9, 11), 1, (7,)))
        expect("writers_minus_one", lambda: rx.receive(make_request_id(9, 12), 1, (-1,)))
        expect("writers_empty", lambda: rx.receive(make_request_id(9, 13), 1, ()))
        expect("writers_duplicated", lambda: rx.receive(make_request_id(9, 14), 1, (0, 0)))
        expect("num_slices_zero", lambda: rx.receive(make_request_id(9, 15), 1, (0,), num_slices=0))
        expect("num_slices_not_dividing", lambda: rx.receive(make_request_id(9, 16), 1, (0,), num_slices=2))
        expect("num_blocks_zero", lambda: rx.receive(make_request_id(9, 17), 0, (0,)))
        expect("num_blocks_too_many", lambda: rx.receive(make_request_id(9, 18), 99, (0,)))
        expect("request_id_negative", lambda: rx.receive(-5, 1, (0,)))
        expect("local_copy_without_query", lambda: rx.local_copy(make_request_id(9, 19), NoQuery()))
        expect("release_unknown", lambda: rx.release(make_request_id(9, 20)))
        expect("timeout_nan", lambda: rx.receive(make_request_id(9, 21), 1, (0,), timeout_s=float("nan")))
        h = rx.receive(good, 2, (0,))
        expect("duplicate_receive", lambda: rx.receive(good, 2, (0,)))
        landed = h.landed.wait(10)
        rx.release(good)
        retired = h.retired.wait(10)
        stats = rt.engine.statistics()
        report(results=results, landed=landed, retired=retired, outcome=h.outcome.result(5).value,
               pool=stats.pool.to_dict(), crashes=stats.counter("local_protocol_errors"))
    else:
        tx = rt.sender
        expect("src_blocks_empty", lambda: tx.send(make_request_id(9, 30), ()))
        expect("src_blocks_out_of_range", lambda: tx.send(make_request_id(9, 31), (0, 99)))
        expect("ready_without_query", lambda: tx.send(make_request_id(9, 32), (0,), ready=NoQuery()))
        expect("aux_too_big", lambda: tx.send(make_request_id(9, 33), (0,), aux=b"x" * 4096))
        expect("aux_str", lambda: tx.send(make_request_id(9, 34), (0,), aux="text"))
        expect("num_pieces_zero", lambda: tx.send(make_request_id(9, 35), (0,), num_pieces=0))
        expect("num_receivers_zero", lambda: tx.send(make_request_id(9, 36), (0,), num_receivers=0))
        token = WriteTracker("cpu").pending()
        h = tx.send(good, (3, 4), ready=token)
        expect("duplicate_send", lambda: tx.send(good, (5, 6)))
        time.sleep(0.2)
        written_before_ready = rt.engine.statistics().counter("bytes_written")
        token.signal()
        released = h.released.wait(10)
        report(results=results, released=released, outcome=h.outcome.result(5).value,
               written_before_ready=written_before_ready)
    comm.Barrier()

rt.exit(0)
