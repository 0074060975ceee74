"""One world for the network-fault tests across test hosts (tests/multihost/test_network_faults.py).

Usage: mpirun ... python netfault_world.py SCENARIO OUT_DIR [--sessions N] [--blocks B] [--timeout-s T]

Ranks: 0 writes (on the host whose link the test breaks), 1 receives, 2 (if present) is a bystander.
Ranks never learn what the test does to the network; they talk to the test only through files in
OUT_DIR (every test host shares this machine's filesystem), because a broken link also stops the
launcher's own channel to the writer's host.

Scenarios:
  linkdown   rank 1 publishes request L (32 blocks) to rank 0, which starts one big WRITE. The test
             takes rank 0's link down while the WRITE is in flight. Rank 1 keeps a journal of its pool
             (rx-journal.jsonl) and, once the link is down and L's transfer timeout has passed (the
             window where a timer-based system frees), asks for more blocks than are free (must be
             refused) and for exactly the free ones (must not overlap request L's). No proof can come:
             the world must fail-stop at request L's deadline.
  sessions   rank 1 runs N sessions with rank 0 (B blocks each; every 5th is cancelled right after
             publication), verifies every landed block, and writes report.json: outcome, proof
             (retired) and latencies per session. Exit 0 only if every session ended retired.
  hostdeath  as sessions, endless (bounded by MAX_LIFETIME_S), under kvown's rank-crash guard; the
             test kills every process of rank 0's host.

Every rank writes OUT_DIR/rank{R}.json ({rank, host, pid, start_ticks}) once connected. Exit codes:
0 done, 5 outlived MAX_LIFETIME_S (was not killed), 6 a session ended without proof.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI

from kvown import KVLayout, PoolExhausted, TransferConfig, connect_mpi, make_request_id
from kvown.adapters.mpi import process_start_ticks
from kvown.kernels.nvfp4 import fill_pattern

MAX_LIFETIME_S = 60.0
W, RX = 0, 1

ap = argparse.ArgumentParser()
ap.add_argument("scenario", choices=["linkdown", "sessions", "hostdeath"])
ap.add_argument("out")
ap.add_argument("--sessions", type=int, default=40)
ap.add_argument("--blocks", type=int, default=4)
ap.add_argument("--timeout-s", type=float, default=2.0)
ap.add_argument("--grace-s", type=float, default=1.0)
ap.add_argument(
    "--mutant",
    default="",
    choices=["", "free-on-timeout"],
    help="free-on-timeout: the receiver returns request L's blocks to the pool when its transfer "
    "timeout passes, as a timer-based system does (the test must catch it)",
)
args = ap.parse_args()
out = Path(args.out)
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
END = time.monotonic() + MAX_LIFETIME_S

# 64 KiB blocks: big enough that a throttled link keeps a WRITE in flight for seconds
layout = KVLayout.standard(num_layers=4, num_blocks=48, tokens_per_block=16, num_kv_heads=2, head_dim=128)
rt = connect_mpi(
    comm,
    layout=layout,
    config=TransferConfig(transfer_timeout_s=args.timeout_s, grace_s=args.grace_s),
    roles={"receiver"} if rank == RX else {"sender"},
)
pool = rt.engine.pool


def write_json(name: str, value: object) -> None:
    tmp = out / f".{name}.tmp"
    tmp.write_text(json.dumps(value))
    tmp.rename(out / name)  # atomic: the test never reads half a file


def append_journal(value: dict) -> None:
    with open(out / "rx-journal.jsonl", "a") as f:
        f.write(json.dumps(value) + "\n")
        f.flush()
        os.fsync(f.fileno())  # the kill may come at any instruction


write_json(
    f"rank{rank}.json",
    {
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "start_ticks": process_start_ticks(os.getpid()),
    },
)
comm.Barrier()


def live_until_killed(code: int) -> None:
    while time.monotonic() < END:
        time.sleep(0.01)
    sys.stdout.flush()
    os._exit(code)


def linkdown() -> None:
    rid = make_request_id(5, 1)
    if rank == W:
        blocks = tuple(range(32))
        for j, b in enumerate(blocks):
            fill_pattern(pool.block_view(b), rid, 0, j)
        rt.sender.send(rid, blocks)
        while rt.engine.statistics().writes_in_flight == 0 and time.monotonic() < END:
            time.sleep(0.001)
        write_json("writing.json", {"t_ns": time.monotonic_ns()})
        live_until_killed(5)
    elif rank == RX:
        h = rt.receiver.receive(rid, 32, (W,))
        held = sorted(h.blocks)
        deadline = None
        while deadline is None and time.monotonic() < END:
            deadline = rt.engine.statistics().receiver.oldest_fail_stop_deadline_ns
            time.sleep(0.001)
        write_json("deadline.json", {"request_id": rid, "deadline_ns": deadline, "blocks": held})
        timed_out_ns = deadline - int(args.grace_s * 1e9) if deadline else 0  # drain start (transfer timeout)
        probed = mutated = False
        while time.monotonic() < END:
            if args.mutant and not mutated and time.monotonic_ns() >= timed_out_ns:
                mutated = True  # the planted bug: free on a timer, without proof
                rt.engine.call(lambda e: e.pool.retire(h.blocks, owner=rid))
            stats = rt.engine.statistics()
            entry = {
                "t_ns": time.monotonic_ns(),
                "pool": stats.pool.to_dict(),
                "landed": h.landed.is_set(),
                "retired": h.retired.is_set(),
            }
            if (
                not probed
                and (out / "link-is-down").exists()
                and time.monotonic_ns() >= timed_out_ns + 200_000_000
            ):
                probed = True
                free, total = stats.pool.free, stats.pool.total
                if free == total:  # request L's blocks already count as free: nothing can be oversized
                    entry["oversized_request"] = "impossible: every block counts as free"
                else:
                    try:  # more than is free: must be refused, never served from request L's blocks
                        rt.receiver.receive(make_request_id(5, 2), free + 1, (2 % comm.Get_size(),))
                        entry["oversized_request"] = "served"
                    except PoolExhausted:
                        entry["oversized_request"] = "refused"
                extra = rt.receiver.receive(
                    make_request_id(5, 3), stats.pool.free, (2 % comm.Get_size(),)
                )
                entry["free_request_blocks"] = sorted(extra.blocks)
                entry["overlap_with_held"] = sorted(set(extra.blocks) & set(held))
            append_journal(entry)
            time.sleep(0.05)
        os._exit(5)
    else:
        live_until_killed(5)


def sessions(count: int, guard=None) -> None:
    report = []
    expected = torch.empty(layout.block_nbytes, dtype=torch.uint8)
    i = 0
    while (count <= 0 or i < count) and time.monotonic() < END:
        rid = make_request_id(6, i)
        cancel = i % 5 == 4
        if rank == W:
            blocks = tuple(range((i % 8) * args.blocks, (i % 8) * args.blocks + args.blocks))
            for j, b in enumerate(blocks):
                fill_pattern(pool.block_view(b), rid, 0, j)
            hs = rt.sender.send(rid, blocks)
            if not hs.released.wait(30):
                raise RuntimeError(f"session {i}: source blocks never released")
        elif rank == RX:
            t0 = time.monotonic_ns()
            h = rt.receiver.receive(rid, args.blocks, (W,))
            if cancel:
                rt.receiver.cancel(rid)
                landed, ok = None, None
            else:
                landed = h.landed.wait(30)
                t_landed = time.monotonic_ns()
                ok = landed
                for j, b in enumerate(h.blocks if landed else ()):
                    fill_pattern(expected, rid, 0, j)
                    ok = ok and torch.equal(pool.block_view(b), expected)
                rt.receiver.release(rid)
            t_release = time.monotonic_ns()
            retired = h.retired.wait(30)
            outcome = h.outcome.result(5).value if h.outcome.done() else None
            report.append(
                {
                    "session": i,
                    "cancelled": cancel,
                    "landed": landed,
                    "verified": ok,
                    "retired": retired,
                    "outcome": outcome,
                    "publish_to_landed_us": None if cancel else (t_landed - t0) / 1e3,
                    "release_to_retired_us": (h.retired_ns - t_release) / 1e3 if retired else None,
                }
            )
            if count <= 0:
                write_json("progress.json", {"sessions": i + 1})
            if not retired:
                raise RuntimeError(f"session {i} ended without proof")
        i += 1
    if rank == RX:
        write_json("report.json", {"sessions": report, "pool": rt.engine.statistics().pool.to_dict()})
    if guard is not None:
        guard.mark_completed()


if args.scenario == "linkdown":
    linkdown()
elif args.scenario == "sessions":
    try:
        sessions(args.sessions)
    except RuntimeError as exc:
        print(f"netfault_world: {exc}", file=sys.stderr, flush=True)
        os._exit(6)
    comm.Barrier()
    rt.exit(0)
else:  # hostdeath: the loops run under the rank-crash guard, as a server's executor loop does
    guard = rt.crash_guard()
    if rank in (W, RX):
        guard.run(lambda g: sessions(0, g), cleanup=lambda: None)
    live_until_killed(5)
