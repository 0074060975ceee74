"""One of two separately launched processes (no shared MPI world) joined through a rendezvous server.

argv: RANK HOST PORT OUT. Rank 0 sends 3 requests, rank 1 receives and verifies them; OUT gets JSON.
"""

import json
import sys

import torch

from kvown import KVLayout, Outcome, TransferConfig, connect_rendezvous, make_request_id
from kvown.kernels.nvfp4 import fill_pattern

rank, host, port, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
layout = KVLayout.standard(num_layers=2, num_blocks=32, tokens_per_block=16, num_kv_heads=2, head_dim=64,
                           dtype="bfloat16")
rt = connect_rendezvous((host, port), rank=rank, world_ranks=(0, 1), layout=layout,
                        config=TransferConfig(transfer_timeout_s=5.0), roles={"sender"} if rank == 0 else {"receiver"})
pool = rt.engine.pool
report = {"rank": rank, "ok": []}
for i in range(3):
    rid = make_request_id(5, i)
    if rank == 0:
        blocks = (2 * i, 2 * i + 1)
        for j, b in enumerate(blocks):
            fill_pattern(pool.block_view(b), rid, 0, j)
        h = rt.sender.send(rid, blocks)
        report["ok"].append(h.released.wait(20) and h.outcome.result(5) is Outcome.COMPLETED)
    else:
        h = rt.receiver.receive(rid, 2, (0,))
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
