"""The fail-stop world behind ``kvown qualify`` and ``kvown bench failstop``: a deadline missed on purpose.

Rank 0 receives; rank 1 is a writer that goes silent; every other rank is a bystander. Rank 1 freezes
itself (SIGSTOP: a process that is alive but does nothing, as a wedged or swapped-out writer is)
right after rank 0 knows it will, and rank 0 then publishes a request to it. No result and no
SESSION_QUIESCED can come, so the claim is still unproven at its deadline (transfer timeout + grace
after the publication): rank 0's watchdog fail-stops and Open MPI takes down every rank on every host.
Nothing in this world injects a fault into kvown; the writer is really silent.

What it prints (one line each, stdout, flushed; ``mpirun`` forwards them to the launcher):
  ``KVOWN-RANK {"rank", "host", "pid", "start_ticks"}``   every rank, once connected
  ``KVOWN-DEADLINE {"deadline_mono_ns", "deadline_wall_ns", "request_id"}``   rank 0, once published

The launcher measures from the deadline to every listed PID gone (where it can see them) and to its
own ``mpirun`` exiting (always). Exit code of the world: 75 (deadline) when kvown did its job.

Rules:
  1. Every wait is bounded (``MAX_LIFETIME_S``); a rank still alive then exits 5, which the launcher
     reports as "the world was not killed".
  2. Rank 1 announces its freeze with a synchronous send, so rank 0 publishes only to a writer that is
     about to stop (if the frame arrives before the stop, the writer has no session and stays silent).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time

MAX_LIFETIME_S = 60.0
FROZEN = 1


def line(tag: str, **fields: object) -> None:
    print(f"{tag} {json.dumps(fields)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(prog="kvown.apps.qualify_failstop")
    ap.add_argument(
        "--timeout-s", type=float, default=0.5, help="transfer timeout (first half of the deadline)"
    )
    ap.add_argument("--grace-s", type=float, default=0.5, help="drain grace (second half)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    from mpi4py import MPI

    from kvown import KVLayout, TransferConfig, connect_mpi, make_request_id
    from kvown.adapters.mpi import process_start_ticks

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size < 2:
        raise SystemExit("kvown.apps.qualify_failstop needs at least 2 ranks")
    layout = KVLayout.standard(
        num_kv_heads=2, head_dim=64, dtype="bfloat16", num_layers=2, num_blocks=16, tokens_per_block=16
    )
    rt = connect_mpi(
        comm,
        layout=layout,
        config=TransferConfig(transfer_timeout_s=args.timeout_s, grace_s=args.grace_s),
        roles={"receiver"} if rank == 0 else {"sender"},
        device=args.device,
    )
    line(
        "KVOWN-RANK",
        rank=rank,
        host=socket.gethostname(),
        pid=os.getpid(),
        start_ticks=process_start_ticks(os.getpid()),
    )
    comm.Barrier()
    end = time.monotonic() + MAX_LIFETIME_S
    if rank == FROZEN:
        comm.ssend("freezing", dest=0, tag=1)
        os.kill(os.getpid(), signal.SIGSTOP)  # alive, silent; only a kill ends it
    elif rank == 0:
        comm.recv(source=FROZEN, tag=1)
        time.sleep(0.05)
        request_id = make_request_id(9, 1)
        rt.receiver.receive(request_id, 2, (FROZEN,))
        deadline = None
        while deadline is None and time.monotonic() < end:
            deadline = rt.statistics().receiver.oldest_fail_stop_deadline_ns
            time.sleep(0.001)
        offset_ns = time.time_ns() - time.monotonic_ns()  # monotonic -> wall clock, sampled together
        line(
            "KVOWN-DEADLINE",
            request_id=request_id,
            deadline_mono_ns=deadline,
            deadline_wall_ns=None if deadline is None else deadline + offset_ns,
        )
    else:  # a bystander: in a barrier that never completes (rank 1 never joins)
        request = comm.Ibarrier()
        while not request.Test() and time.monotonic() < end:
            time.sleep(0.005)
    while time.monotonic() < end:  # the fail-stop should end this process long before
        time.sleep(0.01)
    sys.stdout.flush()
    os._exit(5)


if __name__ == "__main__":
    main()
