"""``KvownLink``: the serve app's KV link over kvown itself (NIXL one-sided WRITEs, ownership with proof).

Owns: this server's kvown rank (``kvown.rank.connect_registry``: etcd discovery with leases, the
server's own paged KV tensors as bring-your-own memory), the translation between the link interface
the server uses (``kvown.apps.serve.link.Link``: names, lent blocks, ``landed`` futures) and
kvown's API (ranks, handles), and the publication timeout of the prefill side.

Rules:
  1. The server's ``BlockAllocator`` stays the only allocator. A decode destination is lent to kvown
     (``receive(blocks=...)``) and comes back through ``on_returned`` only at kvown's retirement: with
     proof that the writer is quiescent. A prefill's source blocks come back when no WRITE can read
     them any more (``on_done`` at ``released``).
  2. Writers are named by server name; the server's directory (etcd) maps a name to its kvown rank
     (``RankInfo.meta["kvown_rank"]``). A writer kvown has not loaded yet is waited for, bounded.
  3. ``peer_gone`` changes nothing: a lease that expired proves only that the writer stopped renewing
     it, not that its WRITEs stopped. An unsettled destination stays held until the writer's own
     evidence arrives or this server fail-stops at the deadline (docs/embedding.md, section 7).
  4. Callbacks from kvown run on its engine thread: they only resolve futures and hand ids back.

Invariants:
  INV-KL-1  ``on_returned`` is called exactly once per lent set (kvown's INV-LENT-2, and ``on_done``
            once per send).
"""

from __future__ import annotations

import concurrent.futures
import heapq
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvown.apps.serve.link import KVMemory, RecvHandle, SendHandle, TransferFailed
from kvown.cache.space import BlockSpace, Region
from kvown.core.actions import Outcome
from kvown.core.errors import KvownError, LocalProtocolError
from kvown import SendPhase
from kvown.rank import connect_registry
from kvown.runtime.config import TransferConfig


def memory_space(memory: KVMemory) -> BlockSpace:
    """The server's per-layer ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensors as regions:
    K then V of every layer, each one chunk per block, token-major (vLLM's layout)."""
    regions, halves = [], []
    for t in memory.layers:
        for half in (t[0], t[1]):
            regions.append(Region.from_tensor(half, heads=int(t.shape[3]), groups=int(t.shape[2])))
            halves.append(half)
    return BlockSpace.of_tensors(regions, halves)


class KvownLink:
    """``Link`` (``kvown.apps.serve.link``) over kvown. ``role`` is "prefill" (sender) or "decode" (receiver)."""

    def __init__(
        self,
        name: str,
        memory: KVMemory,
        *,
        on_returned: Callable[[int, tuple[int, ...], str], None],
        etcd: str,
        cluster: str,
        rank: int,
        role: str,
        rank_of: Callable[[str], int | None],
        publish_timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        transfer_timeout_s: float = 30.0,
        slow_writes_ms: int = 0,
        lease_ttl_s: int = 3,
    ) -> None:
        self.name, self.memory, self.address = name, memory, ""
        self._on_returned, self._rank_of = on_returned, rank_of
        self._publish_timeout_s, self._connect_timeout_s = publish_timeout_s, connect_timeout_s
        wrap = None
        if slow_writes_ms:  # the hidden test knob ``--link-pace-ms``: WRITEs that finish late
            from kvown.testing.faults import fault_wrapper

            wrap = fault_wrapper(f"slow-writer:nth=0:ms={slow_writes_ms}")
        config = TransferConfig(transfer_timeout_s=transfer_timeout_s, aux_slot_nbytes=64)
        self.rt = connect_registry(
            etcd, job=f"serve-{cluster}", rank=rank, memory=memory_space(memory), config=config,
            on_returned=self._destination_back, roles={"sender" if role == "prefill" else "receiver"},
            ttl_s=lease_ttl_s, wrap_transport=wrap,
        )
        self._lock = threading.Lock()
        self._dests: dict[int, RecvHandle] = {}
        self._sends: dict[int, SendHandle] = {}
        self._expiry: list[tuple[float, int]] = []  # (deadline, request id): sends nobody published
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self.counters = {name: 0 for name in ("landed", "recv_cancelled", "recv_failed", "sent", "send_cancelled",
                                              "send_expired", "send_failed", "bytes_in", "bytes_out")}
        self.pace_s = 0.0  # the loopback link's test knob; here slow_writes_ms does it
        self._timer = threading.Thread(target=self._expire_loop, name=f"kvownlink-expiry-{name}", daemon=True)
        self._timer.start()

    # ---- decode side ----------------------------------------------------------------------------

    def receive(self, request_id: int, blocks: Sequence[int], writer: str) -> RecvHandle:
        """Lend ``blocks`` and publish them to ``writer`` (rule 2). Raises as ``Link.receive``."""
        rank = self._writer_rank(writer)
        handle = RecvHandle(request_id, tuple(blocks), writer)
        with self._lock:
            if request_id in self._dests:
                raise LocalProtocolError("request id already has a destination", request_id=request_id)
            self._dests[request_id] = handle
        try:
            kv = self.rt.receiver.receive(request_id, None, (rank,), blocks=tuple(blocks), aux=True,
                                          timeout_s=self._connect_timeout_s)
        except KvownError as exc:
            with self._lock:
                del self._dests[request_id]
            raise TransferFailed("refused", writer=writer, error=str(exc)) from None
        kv.outcome.add_done_callback(lambda f, h=handle, k=kv: self._concluded(h, k, f))
        return handle

    def _writer_rank(self, writer: str) -> int:
        """Rule 2: a name the directory does not know fails at once; a known one that kvown has not
        loaded yet (its record is on its way through etcd) is waited for, bounded."""
        rank = self._rank_of(writer)
        if rank is None:
            raise TransferFailed("writer_unknown", writer=writer)
        try:
            self.rt.wait_for_peers((rank,), self._connect_timeout_s)
        except KvownError:
            raise TransferFailed("writer_not_loaded", writer=writer, rank=rank) from None
        return rank

    def _concluded(self, handle: RecvHandle, kv: Any, outcome: concurrent.futures.Future) -> None:
        """kvown's engine thread: the outcome was committed (rule 4)."""
        error = outcome.exception()
        if error is None and outcome.result() is Outcome.COMPLETED:
            handle.state = "landed"
            self.counters["landed"] += 1
            self.counters["bytes_in"] += len(kv.blocks) * self.memory.block_nbytes
            handle.landed.set_result(self.rt.receiver.read_aux(kv).rstrip(b"\0"))
            return
        reason = "cancelled" if error is None and outcome.result() is Outcome.CANCELLED else "failed"
        self.counters["recv_cancelled" if reason == "cancelled" else "recv_failed"] += 1
        handle.state = "held"
        handle.outcome = reason if error is None else f"refused: {error}"
        if not handle.landed.done():
            handle.landed.set_exception(TransferFailed(reason, request_id=handle.request_id))

    def _destination_back(self, request_id: int, blocks: tuple[int, ...]) -> None:
        """kvown retired the destination (rule 1): the blocks are the server's again."""
        with self._lock:
            handle = self._dests.pop(request_id, None)
        outcome = "completed" if handle is not None and handle.state == "landed" else (
            handle.outcome if handle is not None and handle.outcome else "cancelled")
        self._on_returned(request_id, blocks, outcome)
        if handle is not None:
            handle.returned.set()

    def release(self, request_id: int) -> None:
        self.rt.receiver.release(request_id)

    def cancel(self, request_id: int) -> None:
        self.rt.receiver.cancel(request_id)

    def peer_gone(self, writer: str) -> None:
        """Rule 3: nothing to do; kvown's own evidence or deadline decides."""

    # ---- prefill side ---------------------------------------------------------------------------

    def send(self, request_id: int, blocks: Sequence[int], aux: bytes = b"") -> SendHandle:
        """Lend source blocks; they come back once no WRITE can read them (rule 1)."""
        handle = SendHandle(request_id, tuple(blocks), aux, time.monotonic() + self._publish_timeout_s)
        self.rt.sender.send(request_id, tuple(blocks), aux=aux, on_done=lambda k, h=handle: self._sent(h, k))
        with self._lock:
            self._sends[request_id] = handle
            heapq.heappush(self._expiry, (handle.deadline_s, request_id))
            self._wake.notify()
        return handle

    def _sent(self, handle: SendHandle, kv: Any) -> None:
        """kvown's engine thread: the source blocks are free of WRITEs."""
        error = kv.outcome.exception() if kv.outcome.done() else None
        result = None if error is not None or not kv.outcome.done() else kv.outcome.result()
        outcome = "completed" if result is Outcome.COMPLETED else ("cancelled" if result else "failed")
        self.counters["sent" if outcome == "completed" else f"send_{outcome}"] += 1
        if outcome == "completed":
            self.counters["bytes_out"] += len(handle.blocks) * self.memory.block_nbytes
        with self._lock:
            self._sends.pop(handle.request_id, None)
        self._on_returned(handle.request_id, handle.blocks, outcome)
        handle.done.set_result(outcome)

    def _published(self, request_id: int) -> bool:
        """Has a decode server published to this send yet (or did it end already)?"""
        return self.rt.sender.status(request_id).phase is not SendPhase.OPEN

    def abort_send(self, request_id: int) -> None:
        self.rt.sender.cancel(request_id)

    def _expire_loop(self) -> None:
        """A send that nobody publishes within the timeout has no kvown clock: give it up here."""
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                while self._expiry and self._expiry[0][0] <= now:
                    _, rid = heapq.heappop(self._expiry)
                    if rid in self._sends and not self._published(rid):
                        self.counters["send_expired"] += 1
                        self.rt.sender.cancel(rid)
                self._wake.wait(min(1.0, self._expiry[0][0] - now) if self._expiry else 1.0)

    # ---- both -----------------------------------------------------------------------------------

    def statistics(self) -> dict[str, int]:
        stats = self.rt.statistics()
        with self._lock:
            sending = sum(len(h.blocks) for h in self._sends.values())
        return {**self.counters, "owned": stats.pool.owned, "held": stats.pool.held, "sending": sending,
                "protocol_errors": stats.rejected_frames}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify()
        self.rt.close()

