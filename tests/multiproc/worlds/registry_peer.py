"""One of two processes launched apart (no MPI) that find each other through etcd (connect_registry).

argv: ROLE ENDPOINT JOB OUT [SCENARIO]. ROLE "writer" is rank 0 (sender), "reader" rank 1 (receiver).
Scenarios: "transfer" (3 requests, data verified), "writer-dies" (the writer SIGKILLs itself with a
WRITE still unsettled; the reader must hold the blocks, see the lease go, and fail-stop at its deadline).
"""

import json
import os
import signal
import sys
import time

import torch

from kvown import KVLayout, Outcome, TransferConfig, make_request_id
from kvown.kernels.nvfp4 import fill_pattern
from kvown.rank import connect_registry
from kvown.testing.faults import fault_wrapper

role, endpoint, job, out = sys.argv[1:5]
scenario = sys.argv[5] if len(sys.argv) > 5 else "transfer"
rank = 0 if role == "writer" else 1
layout = KVLayout.standard(num_layers=1, num_blocks=16, tokens_per_block=4, num_kv_heads=2, head_dim=8,
                           dtype="bfloat16")
fault = "stuck-writer:nth=1" if scenario == "writer-dies" and role == "writer" else None
rt = connect_registry(endpoint, job=job, rank=rank, layout=layout, ttl_s=2, wait_for=(1 - rank,), timeout_s=30,
                      roles={"sender"} if rank == 0 else {"receiver"},
                      # the CANCEL to the dead writer fails too; retrying it longer than the grace lets the
                      # deadline, not the lost control stream, be what fail-stops (both would be safe)
                      config=TransferConfig(transfer_timeout_s=3.0, grace_s=1.0, control_retry_s=10.0),
                      wrap_transport=fault_wrapper(fault))
pool = rt.engine.pool
report = {"rank": rank, "pid": os.getpid(), "ok": []}
for i in range(3 if scenario == "transfer" else 1):
    rid = make_request_id(6, i)
    if rank == 0:
        blocks = (2 * i, 2 * i + 1)
        for j, b in enumerate(blocks):
            fill_pattern(pool.block_view(b), rid, 0, j)
        h = rt.sender.send(rid, blocks)
        if scenario == "writer-dies":
            time.sleep(0.5)  # the WRITE is posted and (stuck) never reports: die now
            os.kill(os.getpid(), signal.SIGKILL)
        report["ok"].append(h.released.wait(20) and h.outcome.result(5) is Outcome.COMPLETED)
    else:
        h = rt.receiver.receive(rid, 2, (0,))
        if scenario == "writer-dies":
            report.update(published_ns=time.monotonic_ns())
            with open(out, "w") as f:
                json.dump(report, f)
            time.sleep(60)  # the fail-stop at the deadline ends this process (SIGKILL of itself)
            sys.exit(5)
        landed = h.landed.wait(20)
        expected = torch.empty(layout.block_nbytes, dtype=torch.uint8)
        same = True
        for j, b in enumerate(h.blocks):
            fill_pattern(expected, rid, 0, j)
            same &= torch.equal(pool.block_view(b), expected)
        rt.receiver.release(rid)
        report["ok"].append(bool(landed and same and h.retired.wait(5)))
with open(out, "w") as f:
    json.dump(report, f)
rt.exit(0)
