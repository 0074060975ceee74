"""The qualification world behind ``kvown qualify``: every ownership scenario in one 3-rank world.

Ranks 0 and 1 write, rank 2 receives, over real NIXL. Each scenario runs on every rank between
barriers; ranks record checks as {scenario: {check: bool}} and rank 0 writes them all as JSON.
Run it on the hosts and layout you deploy (``--layout nvfp4`` for NVFP4 packed values + scales, with
``--scale-layout inline|separate``; ``kvown qualify --hosts a,b`` places the ranks on several nodes).

Besides the checks, rank 0 reports figures: how long start-up (NIXL agents, registration, metadata
allgather and load) took on each rank, where each rank ran, which rank pairs carried kvown traffic, and
how many bytes were verified (by pattern, and by checksum against a digest the writer sent beside the
KV). Results go to OUT (if given) and, always, to stdout as one ``KVOWN-RESULT {json}`` line, so a
launcher on another host than rank 0 still gets them.

Rules:
  1. Every wait is bounded; a scenario that raises records a failed check instead of hanging the world.
  2. Data is verified against content the writer produced (kvown/apps/kvcontent.py): byte for byte
     against a pattern, or for NVFP4 quantised K/V, by checksum and by dequantising with the landed
     scales. On CUDA the writer's stream is synchronised before the send that reads it.
  3. Checksummed data is random: the receiver cannot regenerate it, only compare digests.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

sys.setswitchinterval(2e-4)

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from kvown import KVLayout, Outcome, TransferConfig, connect_mpi, make_request_id  # noqa: E402
from kvown.adapters.cuda import WriteTracker  # noqa: E402
from kvown.apps.kvcontent import KVContent  # noqa: E402
from kvown.core.messages import Envelope, KvResult, ResultStatus  # noqa: E402
from kvown.kernels.ops import checksum  # noqa: E402
from kvown.testing.faults import fault_wrapper  # noqa: E402

import argparse  # noqa: E402

_ap = argparse.ArgumentParser(prog="kvown.apps.qualify_world")
_ap.add_argument("--layout", choices=["standard", "mla", "nvfp4"], default="standard")
_ap.add_argument("--device", default="cpu")
_ap.add_argument("--scale-layout", choices=["inline", "separate"], default="inline")
_ap.add_argument("out", nargs="?", help="also write the results here (rank 0's filesystem)")
ARGS = _ap.parse_args()
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
RX, W0, W1 = 2, 0, 1
_SHAPE = dict(num_layers=2, num_blocks=64, tokens_per_block=16)
LAYOUT = {
    "standard": lambda: KVLayout.standard(num_kv_heads=2, head_dim=64, dtype="bfloat16", **_SHAPE),
    "mla": lambda: KVLayout.mla(latent_dim=576, dtype="bfloat16", **_SHAPE),
    "nvfp4": lambda: KVLayout.nvfp4(num_kv_heads=2, head_dim=128, scale_layout=ARGS.scale_layout, **_SHAPE),
}[ARGS.layout]()
comm.Barrier()
_connect_t0 = time.monotonic()
rt = connect_mpi(comm, layout=LAYOUT, config=TransferConfig(transfer_timeout_s=4.0, canary=True),
                 roles={"receiver"} if rank == RX else {"sender"}, device=ARGS.device, wrap_transport=fault_wrapper(""))
CONNECT_S = time.monotonic() - _connect_t0  # agent, registration, metadata allgather + load, barrier
pool = rt.pool
results: dict[str, dict[str, bool]] = {}
verified_nbytes = {"pattern": 0, "checksum": 0}
content = KVContent(pool, max_blocks=8)
seq = iter(range(1000))


def rid() -> int:
    return make_request_id(3, next(seq))


def fill(blocks, request_id):
    content.write(pool, request_id, blocks)
    if pool.tensor.is_cuda:  # the sends below take no ready token: the write must be done first
        torch.cuda.current_stream().synchronize()


def verify(blocks, request_id) -> bool:
    if content.bad_blocks(request_id, blocks):
        return False
    verified_nbytes["pattern"] += len(blocks) * LAYOUT.block_nbytes
    return True


def outcome(handle, timeout=5.0):
    return handle.outcome.result(timeout)


def check(name: str, **checks: bool) -> None:
    results.setdefault(name, {}).update({k: bool(v) for k, v in checks.items()})


def recv(source: int, tag: int, timeout_s: float = 10.0):
    """A bounded MPI receive: a peer whose scenario failed must not hang this one."""
    request = comm.irecv(source=source, tag=tag)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, value = request.test()
        if done:
            return value
        time.sleep(0.001)
    request.Cancel()
    raise TimeoutError(f"no message from rank {source} tag {tag}")


def scenario(fn):
    comm.Barrier()
    r = rid()
    try:
        fn(r)
    except Exception as exc:  # a scenario that raises fails its checks, not the whole world
        check(fn.__name__, **{f"raised_{type(exc).__name__}_on_rank{rank}": False})
        print(f"kvown qualify: scenario {fn.__name__} raised on rank {rank}: {exc}", file=sys.stderr, flush=True)
    comm.Barrier()
    return fn


@scenario
def happy(r):
    if rank == RX:
        h = rt.receiver.receive(r, 4, (W0,), aux=True)
        landed = h.landed.wait(5)
        ok = verify(h.blocks, r)
        aux = rt.receiver.read_aux(h)[:8] == r.to_bytes(8, "little")
        rt.receiver.release(r)
        check("happy", landed=landed, data_verified=ok, aux_verified=aux, retired=h.retired.wait(5),
              completed=outcome(h) is Outcome.COMPLETED)
    elif rank == W0:
        blocks = (10, 11, 12, 13)
        fill(blocks, r)
        hs = rt.sender.send(r, blocks, aux=r.to_bytes(8, "little"))
        check("happy", sender_released=hs.released.wait(5), sender_completed=outcome(hs) is Outcome.COMPLETED)


@scenario
def cancel_before_publication(r):
    if rank == RX:
        rt.receiver.cancel(r)  # the client aborted before the decode side dispatched
        sent_before = rt.statistics().counter("control_sent")
        h = rt.receiver.receive(r, 2, (W0,))
        retired = h.retired.wait(5)
        sent_after = rt.statistics().counter("control_sent")
        check("cancel_before_publication", born_cancelled=outcome(h) is Outcome.CANCELLED, retired=retired,
              nothing_published=sent_after == sent_before)
    elif rank == W0:
        rt.sender.cancel(r)
        written = rt.statistics().counter("bytes_written")
        hs = rt.sender.send(r, (1, 2))
        check("cancel_before_publication", sender_born_cancelled=outcome(hs) is Outcome.CANCELLED,
              sender_released=hs.released.wait(5),
              nothing_written=rt.statistics().counter("bytes_written") == written)


@scenario
def cancel_mid_transfer(r):
    if rank == W0:
        rt.inject_fault("slow-writer:nth=1:ms=400")  # the next WRITE reports DONE only after 400 ms
        hs = rt.sender.send(r, (20, 21, 22))
        deadline = time.monotonic() + 5
        while rt.statistics().writes_in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        comm.send("posted", dest=RX, tag=11)
        check("cancel_mid_transfer", sender_cancelled=outcome(hs) is Outcome.CANCELLED,
              sender_released_after_done=hs.released.wait(5))
        rt.inject_fault("")
    elif rank == RX:
        h = rt.receiver.receive(r, 3, (W0,))
        recv(W0, 11)
        t0 = time.monotonic_ns()
        rt.receiver.cancel(r)
        time.sleep(0.15)
        held_while_writing = not h.retired.is_set() and rt.statistics().pool.free <= 64 - 3
        retired = h.retired.wait(5)
        check("cancel_mid_transfer", held_while_write_in_flight=held_while_writing, retired_after_quiesce=retired,
              waited_for_the_write=(h.retired_ns - t0) >= 200_000_000, outcome_cancelled=outcome(h) is Outcome.CANCELLED)


@scenario
def cancel_before_sender_session(r):
    if rank == RX:
        h = rt.receiver.receive(r, 2, (W0,))
        rt.receiver.cancel(r)
        retired = h.retired.wait(5)  # the writer has no session: it acknowledges at once
        check("cancel_before_sender_session", retired=retired, cancelled=outcome(h) is Outcome.CANCELLED)
        comm.send("go", dest=W0, tag=12)
    elif rank == W0:
        recv(RX, 12)
        written = rt.statistics().counter("bytes_written")
        hs = rt.sender.send(r, (30, 31))  # the late session is born cancelled by the fence
        check("cancel_before_sender_session", late_session_born_cancelled=outcome(hs) is Outcome.CANCELLED,
              released=hs.released.wait(5),
              nothing_written=rt.statistics().counter("bytes_written") == written)


@scenario
def fan_in_one_writer_cancelled(r):
    if LAYOUT.num_kv_heads % 2:  # MLA: one latent head, nothing to split between two writers
        check("fan_in_one_writer_cancelled", not_applicable_single_head=True)
        return
    if rank == RX:
        h = rt.receiver.receive(r, 4, (W0, W1), num_slices=2)
        retired = h.retired.wait(5)
        check("fan_in_one_writer_cancelled", failed=outcome(h) is Outcome.FAILED, retired=retired)
    else:
        blocks = (40, 41, 42, 43)
        token = WriteTracker("cpu").pending() if rank == W1 else None
        hs = rt.sender.send(r, blocks, ready=token)
        if rank == W1:
            time.sleep(0.05)
            rt.sender.cancel(r)  # writer 1 aborts mid-way: its write was never posted
            check("fan_in_one_writer_cancelled", writer1_cancelled=outcome(hs) is Outcome.CANCELLED)
        check("fan_in_one_writer_cancelled", **{f"writer{rank}_released": hs.released.wait(5)})


@scenario
def broadcast_publication(r):
    if rank == RX:
        h = rt.receiver.receive(r, 2, (W0, W1), num_slices=1)  # published to 2, eligible 1
        landed = h.landed.wait(5)
        ok = verify(h.blocks, r)
        rt.receiver.release(r)
        retired = h.retired.wait(5)  # needs writer 1's SESSION_QUIESCED too
        check("broadcast_publication", landed=landed, data_verified=ok, retired=retired,
              completed=outcome(h) is Outcome.COMPLETED)
        comm.send("done", dest=W1, tag=13)
    elif rank == W0:
        blocks = (50, 51)
        fill(blocks, r)
        hs = rt.sender.send(r, blocks)
        check("broadcast_publication", selected_writer_completed=outcome(hs) is Outcome.COMPLETED)
    else:
        recv(RX, 13)
        hs = rt.sender.send(r, (52, 53))  # the non-selected candidate acknowledged: it is fenced now
        check("broadcast_publication", candidate_fenced=outcome(hs) is Outcome.CANCELLED)


@scenario
def context_first(r):
    if rank == W0:
        blocks = (60, 61, 62)
        fill(blocks, r)
        hs = rt.sender.send(r, blocks, num_pieces=3)  # the session exists before any REQUEST_DATA
        comm.send("prefilled", dest=RX, tag=14)
        check("context_first", sender_completed=outcome(hs) is Outcome.COMPLETED)
    elif rank == RX:
        recv(W0, 14)
        h = rt.receiver.receive(r, 3, (W0,))
        landed = h.landed.wait(5)
        ok = verify(h.blocks, r)
        rt.receiver.release(r)
        check("context_first", landed=landed, data_verified=ok, retired=h.retired.wait(5))


@scenario
def hostile_frames(r):
    """Garbage, a forged tag, a replay, a misaddressed frame and a malformed body: each rejected (or,
    the replay, dropped as a duplicate) and counted, and nothing changes. (Oversized frames are
    rejected by the size cap before anything else; that is tested in-process, because UCX itself
    fails notifications of about a MiB now and then under load, after send_notif returned.)"""
    if rank == W1:  # an insider or a stranger
        hooks = rt.testing
        result = KvResult(W1, r, 0, True, ResultStatus.SUCCESS, 0)
        frames = {
            "garbage": b"\x00garbage",
            "forged": hooks.encode(Envelope(W1, RX, 99, result), b"k" * 32),
            "replay": hooks.encode(Envelope(W1, RX, 0, result)),  # seq 0 was used long ago
            "misaddressed": hooks.encode(Envelope(W1, 1, 5, result)),
            "malformed": hooks.seal(b"\x91\x01"),
        }

        sent: list[str] = []
        recv(RX, 16)  # the receiver has taken its "before" snapshot
        try:
            for name, frame in frames.items():  # one per engine step, so the agent progresses between
                try:
                    hooks.send_raw(RX, frame)  # past kvown's framing: the agent sends it as-is
                    sent.append(name)
                except Exception:  # not sent: not expected either
                    pass
                time.sleep(0.002)
        finally:
            comm.send(sent, dest=RX, tag=15)
    elif rank == RX:
        before = rt.statistics()
        comm.send("snapshot taken", dest=W1, tag=16)
        sent = recv(W1, 15)
        want_rejected = len([name for name in sent if name != "replay"])
        want_duplicates = int("replay" in sent)
        deadline = time.monotonic() + 10
        while True:
            after = rt.statistics()
            rejected = after.rejected_frames - before.rejected_frames
            duplicates = after.duplicate_frames - before.duplicate_frames
            if (rejected >= want_rejected and duplicates >= want_duplicates) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        check("hostile_frames", rejected_and_counted=rejected == want_rejected and want_rejected == 4,
              replay_dropped=duplicates == want_duplicates == 1,
              no_session_created=after.receiver.sessions == before.receiver.sessions,
              not_quarantined=after.receiver.quarantined == "",
              pool_unchanged=after.pool == before.pool)


@scenario
def still_works_afterwards(r):
    if rank == RX:
        h = rt.receiver.receive(r, 2, (W1,))
        landed = h.landed.wait(5)
        ok = verify(h.blocks, r)
        rt.receiver.release(r)
        check("still_works_afterwards", landed=landed, data_verified=ok, retired=h.retired.wait(5))
    elif rank == W1:
        blocks = (5, 6)
        fill(blocks, r)
        rt.sender.send(r, blocks).released.wait(5)


@scenario
def checksummed_transfer(r):
    """Each writer sends random blocks (no pattern to regenerate) and, by MPI, their checksums; the
    receiver's checksums of what landed must match, block by block, from every writer's host."""
    n = 24
    ids = {W0: make_request_id(4, 2 * next(seq)), W1: make_request_id(4, 2 * next(seq) + 1)}
    if rank == RX:
        handles = {w: rt.receiver.receive(ids[w], n, (w,)) for w in (W0, W1)}
        for w, h in handles.items():
            landed = h.landed.wait(10)
            sent = recv(w, 17)
            got = [checksum(pool.block_view(b)) for b in h.blocks]
            match = landed and got == sent
            if match:
                verified_nbytes["checksum"] += n * LAYOUT.block_nbytes
            if landed:
                rt.receiver.release(ids[w])
            else:
                rt.receiver.cancel(ids[w])
                print(f"kvown qualify: checksummed transfer from writer {w} did not land: "
                      f"{h.outcome.result(5) if h.outcome.done() else 'no outcome'}", file=sys.stderr, flush=True)
            check("checksummed_transfer", **{f"writer{w}_landed": landed, f"writer{w}_checksums_match": match,
                                             f"writer{w}_retired": h.retired.wait(5)})
    elif rank in (W0, W1):
        blocks = tuple(range(8, 8 + n))
        generator = torch.Generator().manual_seed(ids[rank])
        for b in blocks:
            view = pool.block_view(b)
            view.copy_(torch.randint(0, 256, (view.numel(),), dtype=torch.uint8, generator=generator))
        sums = [checksum(pool.block_view(b)) for b in blocks]
        hs = rt.sender.send(ids[rank], blocks)  # before the MPI send: the receiver reads sums after landing
        comm.send(sums, dest=RX, tag=17)
        check("checksummed_transfer", **{f"writer{rank}_released": hs.released.wait(10)})


me = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "connect_s": CONNECT_S,
      "verified_nbytes": verified_nbytes}
gathered = comm.gather((results, me), root=0)
if rank == 0:
    merged: dict[str, dict[str, bool]] = {}
    for part, _ in gathered:
        for name, checks in part.items():
            merged.setdefault(name, {}).update(checks)
    ranks = [info for _, info in gathered]
    figures = {
        "ranks": [{k: info[k] for k in ("rank", "host", "pid")} for info in ranks],
        "connect_s": [round(info["connect_s"], 4) for info in ranks],
        "metadata_nbytes": {p: peer.metadata_nbytes for p, peer in rt.view.peers.items()},
        # who carried kvown traffic (NIXL WRITEs and notifications) in this world, as (from, to)
        "traffic_pairs": [[W0, RX], [W1, RX], [RX, W0], [RX, W1]],
        "verified_nbytes_pattern": sum(info["verified_nbytes"]["pattern"] for info in ranks),
        "verified_nbytes_checksum": sum(info["verified_nbytes"]["checksum"] for info in ranks),
        "layout": ARGS.layout, "device": ARGS.device, "block_nbytes": LAYOUT.block_nbytes,
    }
    if ARGS.out:
        with open(ARGS.out, "w") as f:
            json.dump(merged, f, indent=1)
    print("KVOWN-RESULT " + json.dumps({"checks": merged, "figures": figures}), flush=True)
comm.Barrier()
rt.exit(0)
