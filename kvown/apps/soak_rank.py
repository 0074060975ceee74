"""One rank of ``kvown bench soak``: the demo's workload (``kvown.apps.demo_rank``) in rounds, for a time.

Owns: the rounds, the per-rank samples (``OUT/samples-rank{R}.jsonl``, one JSON line per round), the
leak accounting after every round, the heartbeat of a hang detector whose reports are counted
instead of acted on, and the planted faults that prove each detector can fire (``--plant``).

Rules:
  1. Round k gives every request id the admission epoch k + 1 and runs ``demo_rank.run_sender`` /
     ``run_receiver`` on a fresh seeded plan (30 % cancels by default, on either side, early or
     mid-transfer). Then every rank meets (non-blocking barrier) and sets its watermark to k + 2, so
     the fences of finished epochs are compacted world-wide (``RankRuntime.set_watermark``).
  2. After each round, with the world quiet, each rank records: RSS, sessions so far, its pool
     (``total == free + owned + held``; owned + held must be 0), every driver table that must be
     empty between rounds (sessions, handles, writes, in-doubt writes, unsent frames, local copies,
     aux slots, saved publications; a table still busy is looked at again for up to twice the resend
     budget, since a watermark whose send just raised is resent on the next step), corrupted blocks
     (every landed block compared with its pattern; every free block's retirement canary), fence
     count and bytes, and the hang detector's reports.
  3. The hang detector (``HangDetector``, Python tier only) is fed from the workload loop; a report
     while the loop is alive is a false positive. Waits at barriers are ``pause()``-d. The largest gap
     between two heartbeats is recorded: it is the margin the timeout had.
  4. Every wait is bounded by ``--duration-s`` + ``--grace-run-s``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

from kvown.apps.demo_rank import add_workload_args, layout_for, make_plan, run_receiver, run_sender
from kvown.core.actions import FailStop
from kvown.core.ids import make_request_id
from kvown.rank import connect_mpi
from kvown.runtime.config import TransferConfig
from kvown.runtime.hang import HangDetector
from kvown.testing.faults import fault_wrapper

PLANTS = ("leak", "corrupt", "hang")


class CountingExecutor:
    """Stands in for the fail-stop executor behind the hang detector: counts reports (rule 3)."""

    def __init__(self) -> None:
        self.reports: list[str] = []

    def execute(self, action: FailStop) -> None:
        self.reports.append(action.detail)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvown.apps.soak_rank")
    ap.add_argument("--duration-s", type=float, required=True)
    ap.add_argument(
        "--grace-run-s", type=float, default=120.0, help="a round may overrun the duration by this"
    )
    add_workload_args(ap, requests=150, cancel_rate=0.3, requests_help="requests per round (per world)")
    ap.add_argument("--hang-timeout-s", type=float, default=5.0)
    ap.add_argument("--plant", default="", help=argparse.SUPPRESS)  # comma list of PLANTS (tests)
    ap.add_argument("--out", required=True, help="directory for samples-rank{R}.jsonl")
    args = ap.parse_args(argv)
    plants = set(filter(None, args.plant.split(",")))
    if plants - set(PLANTS):
        ap.error(f"--plant takes {PLANTS}")
    sys.setswitchinterval(2e-4)  # as the demo: the engine thread must not wait 5 ms for the GIL

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    ctx, gen = list(range(size // 2)), list(range(size // 2, size))
    role = "sender" if rank in ctx else "receiver"
    config = TransferConfig(transfer_timeout_s=args.timeout_s, canary=True)
    rt = connect_mpi(comm, layout=layout_for(args), config=config, roles={role},
                     wrap_transport=fault_wrapper(args.fault or ""))
    executor = CountingExecutor()
    hang = rt.hang_detector(args.hang_timeout_s, executor=executor, c_backstop=False)
    gap = {"last": time.monotonic(), "max": 0.0}

    def beat() -> None:
        now = time.monotonic()
        gap["max"] = max(gap["max"], now - gap["last"])
        gap["last"] = now
        hang.heartbeat()

    def meet() -> None:
        with hang.pause():
            barrier = comm.Ibarrier()
            while not barrier.Test():
                time.sleep(0.001)
        gap["last"] = time.monotonic()

    samples_path = os.path.join(args.out, f"samples-rank{rank}.jsonl")
    totals = {
        "completed": 0,
        "cancelled": 0,
        "aborted": 0,
        "failed": 0,
        "unfinished": 0,
        "corrupted_blocks": 0,
        "verified_blocks": 0,
        "canary_broken": 0,
        "released": 0,
    }
    comm.Barrier()
    t0 = time.monotonic()
    hard_deadline = t0 + args.duration_s + args.grace_run_s
    k = 0
    while True:
        with hang.pause():
            go = comm.bcast(time.monotonic() - t0 < args.duration_s if rank == 0 else None, root=0)
        gap["last"] = time.monotonic()
        if not go:
            break
        epoch = k + 1
        round_args = argparse.Namespace(**{**vars(args), "seed": args.seed * 100_003 + k})
        plan = [
            dataclasses.replace(p, request_id=make_request_id(epoch, p.index))
            for p in make_plan(round_args, ctx, gen)
        ]
        round_t0 = time.monotonic()
        tick = beat
        if "hang" in plants and k == 1 and rank == 0:

            def tick() -> None:  # planted: the loop stalls once for twice the hang timeout
                beat()
                if not gap.get("stalled"):
                    gap["stalled"] = True
                    time.sleep(2 * args.hang_timeout_s)

        if role == "sender":
            local = run_sender(rt, comm, plan, round_args, hard_deadline, tick=tick)
            totals["released"] += local["released"]
            totals["unfinished"] += local["unreleased"]
        else:
            local = run_receiver(rt, comm, plan, round_args, hard_deadline, None, tick=tick)
            for key in (
                "completed",
                "cancelled",
                "aborted",
                "failed",
                "unfinished",
                "corrupted_blocks",
                "verified_blocks",
            ):
                totals[key] += local[key]
        round_s = time.monotonic() - round_t0
        meet()  # the world is quiet: every session of this round ended on every rank
        rt.set_watermark(epoch + 1)
        if role == "receiver" and "leak" in plants and k == 1:
            leaked_rid = make_request_id(epoch, 10**6)
            rt.testing.plant_leak(leaked_rid)
        if role == "receiver" and "corrupt" in plants and k == 1:

            rt.testing.plant_scribble()  # a late write lands in a free (retired) block
        canary_broken = 0  # counted here only (run_receiver's own check would count a block twice)
        if role == "receiver":  # restamp: count each broken block once, keep the soak running
            canary_broken = len(rt.audit(restamp=True).canary_broken)
            totals["canary_broken"] += canary_broken
        audit = rt.audit(check_canaries=False)
        settle_end = time.monotonic() + 2 * config.control_retry_s
        while audit.leaks and time.monotonic() < settle_end:
            time.sleep(0.01)  # a send that just raised is resent on the next step: not a leak (yet)
            audit = rt.audit(check_canaries=False)
        stats = rt.statistics()
        pool = stats.pool.to_dict()
        sample = {
            "rank": rank,
            "role": role,
            "round": k,
            "epoch": epoch,
            "t_s": round(time.monotonic() - t0, 3),
            "round_s": round(round_s, 3),
            "rss_bytes": rss_bytes(),
            "pool": pool,
            "pool_accounting_ok": pool["total"] == pool["free"] + pool["owned"] + pool["held"],
            "blocks_held": pool["owned"] + pool["held"] if role == "receiver" else 0,
            "tables": dict(audit.tables),
            "leaks": audit.leaks,
            "totals": dict(totals),
            "canary_broken_now": canary_broken,
            "hang_reports": len(executor.reports),
            "max_heartbeat_gap_s": round(gap["max"], 4),
            "counters": {
                name: stats.counter(name)
                for name in (
                    "control_sent",
                    "control_resent",
                    "control_send_failures",
                    "rejected_frames",
                    "bytes_written",
                    "local_protocol_errors",
                    "duplicate_frames",
                )
            },
            "faults": dict(stats.faults),
            "fences": audit.fences,
            "fence_nbytes": audit.fence_nbytes,
            "fences_compacted": audit.fences_compacted,
        }
        with open(samples_path, "a") as f:
            f.write(json.dumps(sample) + "\n")
        k += 1
    hang.stop()
    comm.Barrier()
    rt.exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
