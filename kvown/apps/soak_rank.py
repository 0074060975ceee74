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


_TOTALS = ("completed", "cancelled", "aborted", "failed", "unfinished", "corrupted_blocks", "verified_blocks",
           "canary_broken", "released")
_RECEIVER_TOTALS = _TOTALS[:7]  # what run_receiver counts; canary_broken is counted here (rule 2)
_COUNTERS = ("control_sent", "control_resent", "control_send_failures", "rejected_frames", "bytes_written",
             "local_protocol_errors", "duplicate_frames")


def _parse(argv: list[str] | None) -> argparse.Namespace:
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
    args.plants = set(filter(None, args.plant.split(",")))
    if args.plants - set(PLANTS):
        ap.error(f"--plant takes {PLANTS}")
    return args


class _Soak:
    """One rank's soak: its runtime, its counted hang detector, the heartbeat gap and the totals."""

    def __init__(self, args: argparse.Namespace, comm: Any) -> None:
        self.args, self.comm = args, comm
        self.rank, size = comm.Get_rank(), comm.Get_size()
        self.ctx, self.gen = list(range(size // 2)), list(range(size // 2, size))
        self.role = "sender" if self.rank in self.ctx else "receiver"
        self.config = TransferConfig(transfer_timeout_s=args.timeout_s, canary=True)
        self.rt = connect_mpi(comm, layout=layout_for(args), config=self.config, roles={self.role},
                              wrap_transport=fault_wrapper(args.fault or ""))
        self.executor = CountingExecutor()
        self.hang: HangDetector = self.rt.hang_detector(args.hang_timeout_s, executor=self.executor,
                                                        c_backstop=False)
        self.gap = {"last": time.monotonic(), "max": 0.0}
        self.totals = dict.fromkeys(_TOTALS, 0)
        self.samples_path = os.path.join(args.out, f"samples-rank{self.rank}.jsonl")

    def beat(self) -> None:
        now = time.monotonic()
        self.gap["max"] = max(self.gap["max"], now - self.gap["last"])
        self.gap["last"] = now
        self.hang.heartbeat()

    def meet(self) -> None:
        with self.hang.pause():
            barrier = self.comm.Ibarrier()
            while not barrier.Test():
                time.sleep(0.001)
        self.gap["last"] = time.monotonic()

    def go(self, t0: float) -> bool:
        with self.hang.pause():
            go = self.comm.bcast(time.monotonic() - t0 < self.args.duration_s if self.rank == 0 else None, root=0)
        self.gap["last"] = time.monotonic()
        return bool(go)

    def tick_for(self, k: int) -> Any:
        if not ("hang" in self.args.plants and k == 1 and self.rank == 0):
            return self.beat

        def tick() -> None:  # planted: the loop stalls once for twice the hang timeout
            self.beat()
            if not self.gap.get("stalled"):
                self.gap["stalled"] = True
                time.sleep(2 * self.args.hang_timeout_s)

        return tick

    def run_round(self, k: int, hard_deadline: float) -> float:
        """Round k (rule 1); returns its wall time in seconds."""
        epoch = k + 1
        round_args = argparse.Namespace(**{**vars(self.args), "seed": self.args.seed * 100_003 + k})
        plan = [dataclasses.replace(p, request_id=make_request_id(epoch, p.index))
                for p in make_plan(round_args, self.ctx, self.gen)]
        round_t0 = time.monotonic()
        if self.role == "sender":
            local = run_sender(self.rt, self.comm, plan, round_args, hard_deadline, tick=self.tick_for(k))
            self.totals["released"] += local["released"]
            self.totals["unfinished"] += local["unreleased"]
        else:
            local = run_receiver(self.rt, self.comm, plan, round_args, hard_deadline, None, tick=self.tick_for(k))
            for key in _RECEIVER_TOTALS:
                self.totals[key] += local[key]
        return time.monotonic() - round_t0

    def plant_after(self, k: int, epoch: int) -> None:
        if self.role == "receiver" and "leak" in self.args.plants and k == 1:
            self.rt.testing.plant_leak(make_request_id(epoch, 10**6))
        if self.role == "receiver" and "corrupt" in self.args.plants and k == 1:
            self.rt.testing.plant_scribble()  # a late write lands in a free (retired) block

    def sample(self, k: int, t0: float, round_s: float) -> dict[str, Any]:
        """What rule 2 records after round k, with the world quiet."""
        rt = self.rt
        canary_broken = 0  # counted here only (run_receiver's own check would count a block twice)
        if self.role == "receiver":  # restamp: count each broken block once, keep the soak running
            canary_broken = len(rt.audit(restamp=True).canary_broken)
            self.totals["canary_broken"] += canary_broken
        audit = rt.audit(check_canaries=False)
        settle_end = time.monotonic() + 2 * self.config.control_retry_s
        while audit.leaks and time.monotonic() < settle_end:
            time.sleep(0.01)  # a send that just raised is resent on the next step: not a leak (yet)
            audit = rt.audit(check_canaries=False)
        stats = rt.statistics()
        pool = stats.pool.to_dict()
        return {
            "rank": self.rank, "role": self.role, "round": k, "epoch": k + 1,
            "t_s": round(time.monotonic() - t0, 3), "round_s": round(round_s, 3), "rss_bytes": rss_bytes(),
            "pool": pool, "pool_accounting_ok": pool["total"] == pool["free"] + pool["owned"] + pool["held"],
            "blocks_held": pool["owned"] + pool["held"] if self.role == "receiver" else 0,
            "tables": dict(audit.tables), "leaks": audit.leaks, "totals": dict(self.totals),
            "canary_broken_now": canary_broken, "hang_reports": len(self.executor.reports),
            "max_heartbeat_gap_s": round(self.gap["max"], 4),
            "counters": {name: stats.counter(name) for name in _COUNTERS},
            "faults": dict(stats.faults), "fences": audit.fences, "fence_nbytes": audit.fence_nbytes,
            "fences_compacted": audit.fences_compacted,
        }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    sys.setswitchinterval(2e-4)  # as the demo: the engine thread must not wait 5 ms for the GIL

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    soak = _Soak(args, comm)
    comm.Barrier()
    t0 = time.monotonic()
    hard_deadline = t0 + args.duration_s + args.grace_run_s
    k = 0
    while soak.go(t0):
        round_s = soak.run_round(k, hard_deadline)
        soak.meet()  # the world is quiet: every session of this round ended on every rank
        soak.rt.set_watermark(k + 2)
        soak.plant_after(k, k + 1)
        with open(soak.samples_path, "a") as f:
            f.write(json.dumps(soak.sample(k, t0, round_s)) + "\n")
        k += 1
    soak.hang.stop()
    comm.Barrier()
    soak.rt.exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
