"""A minimal disaggregated server pair embedding kvown: run with ``mpirun -n 2 python examples/disagg_server.py``.

Rank 0 is the prefill (context) server, rank 1 the decode (generation) server. The "model" is a
stand-in that writes a recognisable pattern as its KV; everything else is what a real server does:

  decode server                               prefill server
  -------------                               --------------
  receive(rid, blocks, writers=(0,))  ----->  (REQUEST_DATA arrives; kvown saves it)
                                              prefill: write KV into src blocks
                                              send(rid, src, ready=token)   (WRITE waits for token)
  handle.landed.wait()  <------------------   (WRITE DONE, KV_RESULT, AUX_RESULT)
  decode on handle.blocks
  release(rid) -> handle.retired              handle.released -> reuse src blocks
  (or cancel(rid) at any time: blocks retire only after the writer quiesced)

Both executor loops run under kvown's rank-crash guard and heartbeat a hang detector.
"""

from __future__ import annotations

import sys

import torch
from mpi4py import MPI

from kvown import KVLayout, Outcome, TransferConfig, WriteTracker, connect_mpi, make_request_id
from kvown.kernels.nvfp4 import fill_pattern

REQUESTS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
PREFILL, DECODE = 0, 1
comm = MPI.COMM_WORLD
layout = KVLayout.standard(num_layers=4, num_blocks=128, tokens_per_block=16, num_kv_heads=2, head_dim=64)
rt = connect_mpi(comm, layout=layout, config=TransferConfig(transfer_timeout_s=5.0),
                 roles={"sender"} if comm.rank == PREFILL else {"receiver"})
guard = rt.crash_guard()
hang = rt.hang_detector(timeout_s=30.0)


def prefill_loop(g) -> None:
    tracker, pool = WriteTracker("cpu"), rt.pool
    for i in range(REQUESTS):
        hang.heartbeat()
        rid = make_request_id(1, i)
        src = tuple(range(4 * (i % 8), 4 * (i % 8) + 4))
        token = tracker.pending()  # on a GPU: tracker.record(stream) after the forward pass
        handle = rt.sender.send(rid, src, ready=token, aux=bytes([i % 256]) * 8)
        for j, b in enumerate(src):  # the forward pass writes the KV...
            fill_pattern(pool.block_view(b), rid, 0, j)
        token.signal()  # ...and only now may kvown post the WRITE
        handle.released.wait(10)  # then these source blocks may be reused
    g.mark_completed()


def decode_loop(g) -> None:
    pool, served, cancelled = rt.pool, 0, 0
    expected = torch.empty(layout.block_nbytes, dtype=torch.uint8)
    for i in range(REQUESTS):
        hang.heartbeat()
        rid = make_request_id(1, i)
        handle = rt.receiver.receive(rid, 4, writers=(PREFILL,), aux=True)
        if i % 5 == 4:  # a client disconnects
            rt.receiver.cancel(rid)
            handle.retired.wait(10)  # retired only once the prefill rank proved it stopped writing
            cancelled += 1
            continue
        assert handle.landed.wait(10), f"request {i} did not land"
        for j, b in enumerate(handle.blocks):
            fill_pattern(expected, rid, 0, j)
            assert torch.equal(pool.block_view(b), expected), f"request {i} block {j} corrupted"
        assert rt.receiver.read_aux(handle)[:8] == bytes([i % 256]) * 8
        # The reads above finished (CPU, synchronous). On a GPU the decode kernel is still running here:
        # pass its token, rt.receiver.release(rid, ready=tracker.record(stream)), and nothing retires
        # (no canary fill, no republication to the next writer) before it is done.
        rt.receiver.release(rid)
        handle.retired.wait(10)
        served += handle.outcome.result(1) is Outcome.COMPLETED
    print(f"decode server: served {served}, cancelled {cancelled}, pool {rt.statistics().pool}", flush=True)
    g.mark_completed()


guard.run(prefill_loop if comm.rank == PREFILL else decode_loop, cleanup=hang.stop)
comm.Barrier()
rt.exit(0)  # close, finalize MPI, and skip C++ destructors at interpreter exit
