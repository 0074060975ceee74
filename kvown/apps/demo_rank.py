"""One rank of ``kvown demo``: a seeded, cancellation-heavy disaggregated workload over real NIXL.

Owns: the workload plan (derived identically on every rank from the seed), the prefill/decode
stand-ins, and the verification of every received block.

Rules:
  1. Context ranks are the first half of the world, generation ranks the second half.
  2. Every source block is written *after* its send session was opened (on CUDA: enqueued on the
     producer's stream before the send, whose ready token is an event recorded behind the write) and
     *before* its write-ready token is done; a WRITE posted early would carry stale bytes and fail
     verification (the demo checks the gating for real). What a block holds (``KVContent``):
       * bfloat16: ``fill_pattern(request, 0, block index)``;
       * nvfp4: K and V values drawn from the request's seed, quantised with kvown.kernels.ops into the
         block's value and scale planes (``--scale-layout``: inline, or a separate scale pool).
     (kvown/apps/kvcontent.py, shared with ``kvown qualify``.)
  3. Every landed request is verified block by block: by pattern (bfloat16), or (nvfp4) by the 64-bit
     checksum of each landed block against the expected quantisation's, and by dequantising the landed
     values with their landed scales. The runtime's retirement canaries are on: a
     late write into a retired block is caught when the block is handed out again (the rank then
     fail-stops) or by the check of every free block when the run ends.
  4. Every wait is bounded by ``--deadline-s``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import sys
import time
from dataclasses import dataclass

import torch

from kvown.adapters.cuda import WriteTracker
from kvown.apps.kvcontent import KVContent
from kvown.cache.layout import KVLayout
from kvown.core.actions import Outcome
from kvown.core.ids import make_request_id
from kvown.rank import connect_mpi
from kvown.runtime.config import TransferConfig
from kvown.testing.faults import fault_wrapper

GO_TAG = 7  # context-first: "prefill done, publish now" (context rank -> generation rank)


@dataclass(frozen=True)
class Planned:
    index: int
    request_id: int
    receiver: int
    writers: tuple[int, ...]
    num_blocks: int
    cancel: str  # "", "rx_early", "rx_mid", "tx_mid", "both_before"
    cancel_delay_s: float


def make_plan(args: argparse.Namespace, ctx: list[int], gen: list[int]) -> list[Planned]:
    rng = random.Random(args.seed)
    plan = []
    for i in range(args.requests):
        writers = tuple(ctx) if args.fan_in else (ctx[i % len(ctx)],)
        cancel = ""
        if rng.random() < args.cancel_rate:
            cancel = rng.choices(["rx_early", "rx_mid", "tx_mid", "both_before"], [2, 4, 3, 1])[0]
        plan.append(Planned(i, make_request_id(1, i), gen[(i // len(ctx)) % len(gen)], writers,
                            rng.randint(1, args.max_blocks), cancel, rng.uniform(0.0, 0.002)))
    return plan


def layout_for(args: argparse.Namespace, num_blocks: int | None = None) -> KVLayout:
    shape = {"num_layers": 4, "num_blocks": num_blocks or args.pool_blocks, "tokens_per_block": 16,
             "num_kv_heads": 2, "head_dim": 128}
    if args.dtype == "nvfp4":
        return KVLayout.nvfp4(**shape, scale_layout=args.scale_layout)
    return KVLayout.standard(**shape, dtype="bfloat16")


def add_workload_args(ap: argparse.ArgumentParser, *, requests: int, cancel_rate: float,
                      requests_help: str | None = None) -> None:
    """The workload, what the blocks hold and where the pools live (the demo's and the soak's ranks)."""
    ap.add_argument("--requests", type=int, default=requests, help=requests_help)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cancel-rate", type=float, default=cancel_rate)
    ap.add_argument("--max-blocks", type=int, default=16)
    ap.add_argument("--pool-blocks", type=int, default=512)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--context-first", action="store_true")
    ap.add_argument("--fan-in", action="store_true")
    ap.add_argument("--timeout-s", type=float, default=5.0)
    ap.add_argument("--fault", default="")
    ap.add_argument("--dtype", choices=["bfloat16", "nvfp4"], default="bfloat16")
    ap.add_argument("--scale-layout", choices=["inline", "separate"], default="inline")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")


def run_sender(rt, comm, plan: list[Planned], args, deadline: float, tick=None) -> dict:
    """The prefill stand-in. ``tick`` (optional) is called once per loop iteration (the soak's heartbeat)."""
    sender, pool = rt.sender, rt.pool
    content, tracker = KVContent(pool, max_blocks=args.max_blocks), WriteTracker(args.device)
    mine = [p for p in plan if rt.rank in p.writers]
    free = list(range(args.pool_blocks))
    open_: dict[int, tuple[Planned, object, tuple[int, ...], float]] = {}
    pending, released = list(reversed(mine)), 0
    cancelled: set[int] = set()  # mid-flight cancels asked (once per request)
    while (pending or open_) and time.monotonic() < deadline:
        if tick is not None:
            tick()
        while pending and len(open_) < args.window and len(free) >= pending[-1].num_blocks:
            p = pending.pop()
            blocks = tuple(free.pop() for _ in range(p.num_blocks))
            if p.cancel == "both_before":
                sender.cancel(p.request_id)
            aux = p.request_id.to_bytes(8, "little")
            if args.device == "cuda":  # the "prefill" is enqueued; its event gates the WRITE (rule 2)
                content.write(pool, p.request_id, blocks)
                handle = sender.send(p.request_id, blocks, ready=tracker.record(), aux=aux)
            else:  # the "prefill": open the session, write the KV, then signal (rule 2)
                token = tracker.pending()
                handle = sender.send(p.request_id, blocks, ready=token, aux=aux)
                content.write(pool, p.request_id, blocks)
                token.signal()
            open_[p.request_id] = (p, handle, blocks, time.monotonic())
            if args.context_first:
                comm.send(p.request_id, dest=p.receiver, tag=GO_TAG)  # small: sent eagerly, never blocks long
        now = time.monotonic()
        for rid, (p, handle, blocks, opened) in list(open_.items()):
            if p.cancel == "tx_mid" and now - opened >= p.cancel_delay_s and rid not in cancelled:
                cancelled.add(rid)
                sender.cancel(rid)
            if handle.released.is_set():
                free.extend(blocks)
                released += 1
                del open_[rid]
        time.sleep(0.0002)
    return {"role": "sender", "released": released, "unreleased": len(open_) + len(pending), "cancels": len(cancelled)}


def run_receiver(rt, comm, plan: list[Planned], args, deadline: float, progress_path: str | None, tick=None) -> dict:
    """The decode stand-in. ``tick`` (optional) is called once per loop iteration (the soak's heartbeat)."""
    from mpi4py import MPI

    receiver, pool = rt.receiver, rt.pool
    mine = [p for p in plan if p.receiver == rt.rank]
    pending = list(reversed(mine))
    go: dict[int, int] = {}
    open_: dict[int, tuple[Planned, object, float]] = {}
    out = {"role": "receiver", "completed": 0, "cancelled": 0, "aborted": 0, "failed": 0, "bytes": 0,
           "corrupted_blocks": 0, "verified_blocks": 0, "retire_cancel_us": [], "retire_release_us": [],
           "canary_broken": 0}
    block_nbytes = pool.layout.block_nbytes
    content = KVContent(pool, max_blocks=args.max_blocks)
    last_progress = 0.0
    while (pending or open_) and time.monotonic() < deadline:
        if tick is not None:
            tick()
        if args.context_first:
            while comm.Iprobe(source=MPI.ANY_SOURCE, tag=GO_TAG):
                rid = comm.recv(source=MPI.ANY_SOURCE, tag=GO_TAG)
                go[rid] = go.get(rid, 0) + 1
        _open_next(receiver, pending, open_, go, args, out)
        now = time.monotonic()
        for rid, (p, handle, opened) in list(open_.items()):
            # handle.closing: this program already released or cancelled it (the engine stamps the times)
            if p.cancel in ("rx_early", "rx_mid") and not handle.closing and not handle.landed.is_set():
                if p.cancel == "rx_early" or now - opened >= p.cancel_delay_s:
                    receiver.cancel(rid)
            if handle.landed.is_set() and not handle.closing:
                out["corrupted_blocks"] += content.bad_blocks(rid, handle.blocks)
                out["verified_blocks"] += len(handle.blocks)
                if receiver.read_aux(handle)[:8] != rid.to_bytes(8, "little"):
                    out["corrupted_blocks"] += 1
                receiver.release(rid)
            if handle.retired.is_set():
                _count_retired(out, p, handle, block_nbytes)
                del open_[rid]
        if progress_path and now - last_progress > 0.1:
            last_progress = now
            done = len(mine) - len(pending) - len(open_)
            _write_atomic(progress_path, f"{done} {len(mine)}")
        time.sleep(0.0002)
    time.sleep(0.05)  # let any stray late write land before the final canary check
    out["canary_broken"] = len(rt.audit().canary_broken)
    out["unfinished"] = len(open_) + len(pending)
    stats = rt.statistics()
    out["blocks_held_at_end"] = stats.pool.held + stats.pool.owned
    out["fences"] = stats.receiver.fences
    if progress_path:
        _write_atomic(progress_path, f"{len(mine) - out['unfinished']} {len(mine)}")
    return out


def _open_next(receiver, pending: list[Planned], open_: dict, go: dict[int, int], args, out: dict) -> None:
    """Open the next planned receives while the window has room (PoolExhausted: back-pressure, later)."""
    while pending and len(open_) < args.window:
        p = pending[-1]
        if p.cancel == "both_before":
            pending.pop()
            receiver.cancel(p.request_id)  # fence before publication: nothing is ever published
            out["cancelled"] += 1
            continue
        if args.context_first and go.get(p.request_id, 0) < len(p.writers):
            return
        try:
            handle = receiver.receive(p.request_id, p.num_blocks, p.writers,
                                      num_slices=len(p.writers) if args.fan_in else 1, aux=True)
        except Exception as exc:  # PoolExhausted: back-pressure, try again later
            if type(exc).__name__ != "PoolExhausted":
                raise
            return
        pending.pop()
        open_[p.request_id] = (p, handle, time.monotonic())


def _count_retired(out: dict, p: Planned, handle, block_nbytes: int) -> None:
    """Count a retired receive by its outcome, with its engine-stamped retirement latency."""
    outcome = handle.outcome.result(0) if handle.outcome.done() else None
    if outcome is Outcome.COMPLETED:
        out["completed"] += 1
        out["bytes"] += len(handle.blocks) * block_nbytes
        if handle.released_ns:  # not when a cancel raced the landing and lost
            out["retire_release_us"].append((handle.retired_ns - handle.released_ns) / 1e3)
    elif outcome is Outcome.CANCELLED:
        out["cancelled"] += 1
        out["retire_cancel_us"].append((handle.retired_ns - handle.cancelled_ns) / 1e3)
    elif outcome is Outcome.FAILED and p.cancel == "tx_mid":
        out["aborted"] += 1  # the plan's prefill-side abort: the writer failed the session
    else:
        out["failed"] += 1


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _apply_mutant(name: str) -> None:
    """Deliberately break the receiver so tests can prove the demo's verification catches it."""
    from kvown.core import receiver

    if name != "retire-on-cancel":
        raise SystemExit(f"unknown mutant {name!r}")
    original = receiver.ReceiveSession.has_claims

    def retire_on_cancel_without_ack(self) -> bool:  # the bug every peer system shipped
        return False if self.outcome is Outcome.CANCELLED else original(self)

    receiver.ReceiveSession.has_claims = retire_on_cancel_without_ack


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvown.apps.demo_rank")
    add_workload_args(ap, requests=2000, cancel_rate=0.2)
    ap.add_argument("--grace-s", type=float, default=None)
    ap.add_argument("--deadline-s", type=float, default=120.0)
    ap.add_argument("--switch-interval-s", type=float, default=2e-4)
    ap.add_argument("--mutant", default="", help=argparse.SUPPRESS)  # tests: prove the checks catch a bug
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    faulthandler.enable()  # a fatal signal prints every thread's Python stack
    sys.setswitchinterval(args.switch_interval_s)  # the engine thread must not wait 5 ms for the GIL

    from mpi4py import MPI

    if args.mutant:
        _apply_mutant(args.mutant)
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    ctx, gen = list(range(size // 2)), list(range(size // 2, size))
    role = "sender" if comm.Get_rank() in ctx else "receiver"
    config = TransferConfig(transfer_timeout_s=args.timeout_s, grace_s=args.grace_s, canary=True)
    if args.device == "cuda":
        torch.cuda.set_device(comm.Get_rank() % torch.cuda.device_count())
    rt = connect_mpi(comm, layout=layout_for(args), config=config, roles={role}, device=args.device,
                     wrap_transport=fault_wrapper(args.fault or None))
    plan = make_plan(args, ctx, gen)
    comm.Barrier()
    t0 = time.monotonic()
    deadline = t0 + args.deadline_s
    if role == "sender":
        local = run_sender(rt, comm, plan, args, deadline)
    else:
        progress = f"{args.out}.progress{comm.Get_rank()}"
        local = run_receiver(rt, comm, plan, args, deadline, progress)
    local["wall_s"] = time.monotonic() - t0
    local["rank"] = comm.Get_rank()
    local["engine"] = rt.statistics().to_dict()
    results = comm.gather(local, root=0)
    if comm.Get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    comm.Barrier()
    rt.exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
