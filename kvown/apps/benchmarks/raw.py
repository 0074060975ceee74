"""B0 / B1 of ``kvown bench world``: raw NIXL between a second pair of agents per rank, no protocol.

The engine thread owns the runtime's agent, so each rank makes a second one here (``Raw``):
  B0 raw NIXL   one WRITE + notification per session, one descriptor, no protocol. The receiver frees a
                slot when it has counted the notification, and AT ONCE on cancel (unsafe).
  B0+pub        W1 only: B0 where the writer waits for the receiver's one notification per session
                before it writes (the publication kvown's protocol sends), and nothing else.
  B1 timeout    like B0, but a cancelled slot is held for a fixed ``--b1-timeout-s`` (vLLM/SGLang hold
                cancelled KV for 30-480 s; scaled down here and reported).
Yardsticks: the notification ping-pong RTT and one raw WRITE of each size (post -> DONE).

Rules:
  1. Both sides yield-poll like kvown's engine (no NIXL progress thread).
  2. Rank 0 (``RX``) peers with every writer; a writer only with rank 0. Every wait is bounded by the
     run's deadline and raises ``BenchError`` past it.
  3. Every barrier of a baseline phase progresses its agent (``soft_barrier(progress=pump)``): a
     notification NIXL accepted leaves only while its sender is progressed (docs/design.md section 16).
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any

RX = 0
CANARY = 0xA5


class BenchError(RuntimeError):
    pass


def soft_barrier(comm: Any, deadline: float, progress: Any = None) -> None:
    """A barrier that sleeps (Open MPI's spins a core; this machine may have two). ``progress``: called
    while waiting - a baseline's last notification may still sit in its agent's UCX until that agent
    is progressed, and the peer it is for may be waiting for it before it reaches this barrier."""
    req = comm.Ibarrier()
    while not req.Test():
        if time.monotonic() > deadline:
            raise BenchError("barrier past the run deadline")
        if progress is not None:
            progress()
        time.sleep(1e-4)


def soft_recv(comm: Any, source: int, tag: int, deadline: float) -> Any:
    req = comm.irecv(source=source, tag=tag)
    while True:
        done, value = req.test()
        if done:
            return value
        if time.monotonic() > deadline:
            raise BenchError("receive past the run deadline")
        time.sleep(2e-5)


def publication(i: int) -> bytes:
    """B0+pub's notification "write session i" (the ``;`` keeps ``q1`` from matching ``q10``)."""
    return b"q%d;" % i


def spin_until_ns(t_ns: int) -> None:
    while time.monotonic_ns() < t_ns:
        os.sched_yield()


def sync_device(t: Any) -> None:
    """Wait for the fills on a CUDA tensor (the canary must be in memory before anyone may write)."""
    if t.device.type == "cuda":
        import torch

        torch.cuda.synchronize(t.device)



class Raw:
    """A second NixlEndpoint and buffer per rank for the baselines; rank 0 peers with every writer."""

    def __init__(self, comm: Any, rank: int, nbytes: int, tag: str, device: str = "cpu",
                 huge_pages: bool = True) -> None:
        """``huge_pages``: a CPU buffer is host memory like kvown's own pool (``kvown.cache.hostmem``), so
        the two sides of every ratio WRITE between the same kind of pages."""
        from kvown.adapters.nixl import MemKind, NixlEndpoint
        from kvown.cache.hostmem import device_bytes

        self.comm, self.rank, self.nbytes = comm, rank, nbytes
        self.buf = device_bytes(nbytes, device, huge_pages=huge_pages).tensor.fill_(rank + 1)
        self.mem = MemKind.VRAM if self.buf.device.type == "cuda" else MemKind.DRAM
        self.device_id = self.buf.device.index or 0
        self.ep = NixlEndpoint(f"bench-raw-{tag}-r{rank}")
        self.ep.register_tensor(self.buf)
        info = comm.allgather((self.ep.metadata(), self.buf.data_ptr()))
        self.peers: dict[int, str] = {}
        self.remote_addr: dict[int, int] = {}
        for other, (md, addr) in enumerate(info):
            if other != rank and (rank == RX or other == RX):
                self.peers[other] = self.ep.add_peer(md)
                self.remote_addr[other] = int(addr)
        self.rank_of = {name: r for r, name in self.peers.items()}
        self.addr = self.buf.data_ptr()
        self.inbox: collections.deque = collections.deque()

    def post(self, dst: int, src_off: int, dst_off: int, nbytes: int, notif: bytes | None) -> Any:
        return self.ep.post_write(self.peers[dst], [(self.addr + src_off, nbytes)],
                                  [(self.remote_addr[dst] + dst_off, nbytes)], self.mem, self.mem, notif=notif,
                                  device_id=self.device_id, remote_device_id=self.device_id)

    def wait_done(self, handle: Any, deadline: float) -> None:
        from kvown.adapters.nixl import XferStatus

        while True:
            status = self.ep.poll(handle)
            if status is XferStatus.DONE:
                self.ep.release(handle)
                return
            if status is XferStatus.ERROR or time.monotonic() > deadline:
                raise BenchError(f"raw WRITE ended {status}: {handle.error}")
            self.pump()
            os.sched_yield()

    def pump(self) -> int:
        got = self.ep.drain_notifs()
        self.inbox.extend((self.rank_of.get(a), m) for a, m in got)
        return len(got)

    def take(self, prefix: bytes, deadline: float) -> tuple[int | None, bytes]:
        """The next notification starting with ``prefix`` (others stay queued)."""
        while True:
            for i, (src, msg) in enumerate(self.inbox):
                if msg.startswith(prefix):
                    del self.inbox[i]
                    return src, msg
            if not self.pump():
                os.sched_yield()
            if time.monotonic() > deadline:
                raise BenchError(f"raw: no {prefix!r} notification before the deadline")

    def close(self) -> None:
        self.ep.close()

    # -- yardsticks (rank 0 against writer 1)

    def rtt(self, iters: int, deadline: float) -> list[int]:
        soft_barrier(self.comm, deadline, self.pump)
        out = []
        if self.rank == RX:
            for i in range(iters + 100):
                t0 = time.perf_counter_ns()
                self.ep.send_notif(self.peers[1], b"p%d" % i)
                self.take(b"a%d" % i, deadline)
                if i >= 100:
                    out.append(time.perf_counter_ns() - t0)
            self.ep.send_notif(self.peers[1], b"pend")
        elif self.rank == 1:
            while True:
                _, msg = self.take(b"p", deadline)
                if msg == b"pend":
                    break
                self.ep.send_notif(self.peers[RX], b"a" + msg[1:])
        soft_barrier(self.comm, deadline, self.pump)
        return out

    def write_latency(self, size: int, iters: int, deadline: float) -> list[int]:
        """Writer 1 -> rank 0, post -> DONE, one at a time (rank 0 keeps progressing)."""
        soft_barrier(self.comm, deadline, self.pump)
        out = []
        if self.rank == 1:
            for i in range(iters + 20):
                t0 = time.perf_counter_ns()
                self.wait_done(self.post(RX, 0, 0, size, None), deadline)
                if i >= 20:
                    out.append(time.perf_counter_ns() - t0)
            self.ep.send_notif(self.peers[RX], b"wend")
        elif self.rank == RX:
            self.take(b"wend", deadline)
        soft_barrier(self.comm, deadline, self.pump)
        return out

    # -- W1 (B0): window of sessions from writer 1

    def throughput(self, size: int, n: int, window: int, deadline: float, published: bool = False) -> int:
        """``n`` WRITEs of ``size``, ``window`` in flight; ns on each rank's clock. ``published``: B0+pub,
        where rank 0 first tells the writer "write session i" with one notification (rank 0 keeps
        ``window`` of them ahead and sends the next when a WRITE's notification lands), and the writer
        posts WRITE i only once it has read that one: the one message kvown's protocol adds to raw's
        session (the publication), with nothing else of kvown, so kvown / B0+pub prices the rest."""
        soft_barrier(self.comm, deadline, self.pump)
        t0 = time.perf_counter_ns()
        if self.rank == 1:
            live: collections.deque = collections.deque()
            for i in range(n):
                if len(live) == window:
                    self.wait_done(live.popleft(), deadline)
                if published:
                    self.take(publication(i), deadline)
                slot = (i % window) * size
                live.append(self.post(RX, slot, slot, size, b"w%d" % i))
            while live:
                self.wait_done(live.popleft(), deadline)
        elif self.rank == RX:
            ahead = min(window, n) if published else 0
            for i in range(ahead):
                self.ep.send_notif(self.peers[1], publication(i))
            for i in range(ahead, n + ahead):  # one WRITE landed: publish the session a window later
                self.take(b"w", deadline)
                if published and i < n:
                    self.ep.send_notif(self.peers[1], publication(i))
        ns = time.perf_counter_ns() - t0
        soft_barrier(self.comm, deadline, self.pump)
        return ns

    # -- W2 (B0 / B1): one session at a time, cancel after a delay

    def cancel_sweep(self, size: int, plan: list[tuple[bool, int]], hold_ns: int, settle_ns: int,
                     deadline: float) -> dict[str, Any]:
        """Per session: rank 0 says go; writer 1 posts one WRITE(S) with a notification. A cancelled
        slot is freed ``hold_ns`` after the cancel (0: B0, at once; > 0: B1's timeout) and canaried."""
        soft_barrier(self.comm, deadline, self.pump)
        violations, freed = 0, []
        if self.rank == 1:
            for i in range(len(plan)):
                self.take(b"go", deadline)
                self.wait_done(self.post(RX, 0, 0, size, b"w%d" % i), deadline)
            self.take(b"end", deadline)
        elif self.rank == RX:
            slot = self.buf[:size]
            for i, (cancel, delay_ns) in enumerate(plan):
                t_go = time.monotonic_ns()
                self.ep.send_notif(self.peers[1], b"go")
                if not cancel:
                    self.take(b"w%d" % i, deadline)
                    continue
                spin_until_ns(t_go + delay_ns)
                t_cancel = time.monotonic_ns()
                if hold_ns:
                    spin_until_ns(t_cancel + hold_ns)
                slot.fill_(CANARY)  # the slot is free again: the next request may use it
                sync_device(slot)
                freed.append(time.monotonic_ns() - t_cancel)
                end = time.monotonic_ns() + settle_ns
                while time.monotonic_ns() < end:  # let a late write land (and keep progressing)
                    self.pump()
                    os.sched_yield()
                violations += int(bool((slot != CANARY).any()))
                self.take(b"w%d" % i, deadline)  # the writer's WRITE did finish; drop its notification
            self.ep.send_notif(self.peers[1], b"end")
        soft_barrier(self.comm, deadline, self.pump)
        return {"violations": violations, "freed_ns": freed}


__all__ = ["BenchError", "CANARY", "RX", "Raw", "publication", "soft_barrier", "soft_recv", "spin_until_ns",
           "sync_device"]
