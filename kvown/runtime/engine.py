"""The engine: one thread per rank that owns the protocol cores and drives every adapter.

Owns: this rank's SenderCore and/or ReceiverCore, the NIXL endpoint, the ordered control streams,
the write handles in flight, the write-ready tokens not yet signalled, and the API handles waiting
for outcomes.

Rules:
  1. Single writer. Only the engine thread mutates the cores, the pool and the endpoint. API threads
     put commands on the inbox; the retirement watchdog reads ``check_fatal`` under ``lock``, which
     the engine holds only while a core handles one event (never during I/O).
  2. Adapters translate: every NIXL status, notification and ready token becomes exactly one core
     event; every core action becomes one adapter call (or one API handle update).
  3. Nothing escapes the loop: an exception in the engine thread becomes FailStop(ENGINE_CRASH),
     executed by the fail-stop executor on its own thread. A FailStop from a core goes the same way,
     and the engine then parks (it keeps every root alive and touches nothing).
  4. A write handle that reported ERROR is never released: it is polled until DONE (late settlement)
     or until the world dies.
  5. Bad peer input (forged, malformed, replayed, misaddressed frames) is dropped and counted in
     ``statistics()``; it changes no core state.

Invariants:
  INV-E1: PostWrite is executed only as the core emits it, so no WRITE is posted before its piece's
          write-ready token reported ready (the core's INV-S1).
  INV-E2: blocks go back to the pool only on RetireBlocks.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from kvown.adapters import codec
from kvown.adapters.nixl import MemKind, XferStatus
from kvown.cache.pool import KVPool
from kvown.core.actions import (
    Action,
    AdmissionRefused,
    Conclude,
    Deliver,
    FailStop,
    FatalReason,
    Outcome,
    PieceKind,
    PostWrite,
    ReleaseSource,
    RetireBlocks,
    SendControl,
)
from kvown.core.errors import AdapterError, KvownError, LocalProtocolError, PeerProtocolError
from kvown.core.events import (
    CancelRequested,
    Event,
    LocalCompletionDone,
    LocalCompletionPending,
    MessageReceived,
    OpenReceive,
    PublicationSent,
    ReleaseRequested,
    SourceReady,
    Tick,
    WatermarkSet,
    WriteCompleted,
    WriteFailed,
    WriteNotSubmitted,
    WriteSubmitFailed,
    WriteSubmitted,
)
from kvown.core.machine import RankCore
from kvown.core.messages import CancelSession, RequestData, Watermark
from kvown.core.receiver import ReceiverCore
from kvown.core.sender import SenderCore
from kvown.core.streams import InboundStreams, OutboundStreams
from kvown.runtime.config import PeerInfo, TransferConfig
from kvown.runtime.flight import FlightRecorder


class AdmissionError(KvownError):
    """A session was refused (fail-stop latched, receiver quarantined, stale epoch). Nothing was created."""


@dataclass
class SendHandle:
    """Returned by ``Sender.send``. ``released`` is set when no WRITE can still read the source blocks."""

    request_id: int
    outcome: Future = field(default_factory=Future)
    released: threading.Event = field(default_factory=threading.Event)
    opened_ns: int = 0
    released_ns: int = 0


@dataclass
class ReceiveHandle:
    """Returned by ``Receiver.receive``. ``landed``: the KV may be read; ``retired``: blocks are back."""

    request_id: int
    blocks: tuple[int, ...] = ()
    aux_slot: int = -1
    outcome: Future = field(default_factory=Future)
    landed: threading.Event = field(default_factory=threading.Event)
    retired: threading.Event = field(default_factory=threading.Event)
    opened_ns: int = 0
    landed_ns: int = 0
    cancelled_ns: int = 0
    released_ns: int = 0
    retired_ns: int = 0


@dataclass(frozen=True)
class ReceiveSpec:
    """What ``Receiver.receive`` asks the engine for (blocks are allocated on the engine thread)."""

    request_id: int
    num_blocks: int
    writers: tuple[int, ...]
    num_slices: int = 1
    aux: bool = False


@dataclass
class _SendState:
    handle: SendHandle
    tokens: list[Any]  # per piece: a ReadyToken, or None once reported ready
    aux_slot: int  # local aux staging slot, -1 if none


class Engine:
    """One rank's engine. Build it with ``kvown.runtime.bootstrap``; start it with ``start()``."""

    def __init__(
        self,
        *,
        rank: int,
        peers: dict[int, PeerInfo],
        endpoint: Any,
        pool: KVPool,
        aux: Any,
        key: bytes,
        config: TransferConfig,
        sender: bool,
        receiver: bool,
        recorder: FlightRecorder,
        fail_stop: Callable[[FailStop], None],
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.rank = rank
        self.peers = peers
        self.endpoint = endpoint
        self.pool = pool
        self.aux = aux  # uint8 tensor of aux_slots * aux_slot_nbytes
        self.key = key
        self.config = config
        self.recorder = recorder
        self.clock = clock
        self._fail_stop = fail_stop
        core_config = config.core_config(rank, tuple(sorted(peers)))
        self.sender = SenderCore(core_config) if sender else None
        self.receiver = ReceiverCore(core_config) if receiver else None
        self.lock = threading.Lock()
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.out = OutboundStreams(rank)
        self.inn = InboundStreams(rank)
        self._rank_of_agent = {p.agent_name: r for r, p in peers.items()}
        self._events: collections.deque[tuple[RankCore, Event]] = collections.deque()
        self._writes: dict[int, Any] = {}  # op_id -> XferHandle (posted, not yet DONE)
        self._in_doubt: set[int] = set()  # op ids whose handle reported ERROR (rule 4)
        self._sends: dict[int, _SendState] = {}
        self._local_copies: dict[int, tuple[int, Any]] = {}  # token id -> (request id, ready token)
        self._next_local = 0
        self._recvs: dict[int, ReceiveHandle] = {}
        self._aux_free = list(range(config.aux_slots - 1, -1, -1))
        self.stats = collections.Counter()
        self.fatal: FailStop | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by submit(): ends an idle nap at once
        self._local_prep: Any = None  # prepped descriptor lists of whole blocks: ours, and per peer
        self._remote_preps: dict[int, Any] = {}
        self._stuck_ops: set[int] = set()  # fault injection: never polled again
        self._slow_ops: dict[int, int] = {}  # fault injection: op id -> instant before which it is not polled
        self._late_frames: list[tuple[int, str, bytes]] = []  # fault injection: (due_ns, agent, frame)
        self._fault = _parse_fault(config.fault, rank)
        # Optional checks run on the engine thread (the demo's canaries): called with the block ids
        # right after they retire, and right after they are allocated (before anything is published).
        self.on_retire: Callable[[tuple[int, ...]], None] | None = None
        self.on_allocate: Callable[[tuple[int, ...]], None] | None = None
        self.thread = threading.Thread(target=self._run, name=f"kvown-engine-r{rank}", daemon=True)
        self._mem = MemKind.VRAM if pool.device.type == "cuda" else MemKind.DRAM

    # ---- API side (any thread) ----------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def submit(self, command: tuple) -> None:
        """Queue a command for the engine thread. Called: by API facades, any thread."""
        self.inbox.put(command)
        self._wake.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop (orderly shutdown after every session retired). Called: once, any thread."""
        self._stop.set()
        self.thread.join(timeout_s)

    def call(self, fn: Callable[[Engine], Any], timeout_s: float = 10.0) -> Any:
        """Run ``fn(engine)`` on the engine thread and return its result (tests, diagnostics, faults)."""
        future: Future = Future()
        self.submit(("call", fn, future))
        return future.result(timeout_s)

    def inject_fault(self, text: str) -> None:
        """Arm faults at the NIXL seam (see ``_parse_fault``). Called: by tests, any thread."""
        self.call(lambda engine: engine._fault.update(_parse_fault(text, engine.rank)))

    def check_fatal(self, now_ns: int) -> FailStop | None:
        """Pure: the fail-stop either core latched or would latch at ``now_ns``.

        Called: by the retirement watchdog every <= 10 ms, with ``lock`` held.
        """
        for core in (self.sender, self.receiver):
            fatal = core.check_fatal(now_ns) if core is not None else None
            if fatal is not None:
                return fatal
        return None

    def next_deadline_ns(self) -> int | None:
        """The earliest deadline of either core (the watchdog sleeps at most until then). Lock held."""
        deadlines = [d for d in (c.next_deadline_ns() for c in (self.sender, self.receiver) if c) if d is not None]
        return min(deadlines, default=None)

    def fail_stopping(self) -> FailStop | None:
        """The fail-stop this rank latched or is due to latch now, if any. Called: any thread."""
        if self.fatal is not None:
            return self.fatal
        with self.lock:
            return self.check_fatal(self.clock())

    def allocate_aux(self) -> int:
        """Take an aux slot (engine thread or before start)."""
        return self._aux_free.pop() if self._aux_free else -1

    def statistics(self) -> dict[str, Any]:
        """A snapshot for dashboards and tests (sessions, held blocks, fences, counters)."""
        with self.lock:
            pool = self.pool.statistics()
            out: dict[str, Any] = {
                "rank": self.rank,
                "pool": {"total": pool.total, "free": pool.free, "owned": pool.owned, "held": pool.held},
                "writes_in_flight": len(self._writes),
                "writes_in_doubt": len(self._in_doubt),
                "fatal": None if self.fatal is None else self.fatal.detail,
                "counters": {**self.stats, "duplicate_frames": self.inn.duplicates},
            }
            for name, core in (("sender", self.sender), ("receiver", self.receiver)):
                if core is not None:
                    out[name] = {
                        "sessions": len(core.sessions),
                        "sessions_by_state": core.sessions_by_state(),
                        "fences": len(core.fence),
                        "oldest_fail_stop_deadline_ns": core.nearest_fail_stop_ns(),
                        "counters": dict(core.counters),
                    }
            if self.receiver is not None:
                out["receiver"]["blocks_awaiting_proof"] = pool.held
                out["receiver"]["quarantined"] = self.receiver.quarantined
                out["receiver"]["acks_pending"] = {
                    rid: [w.rank for w in s.writers.values() if not w.settled]
                    for rid, s in self.receiver.sessions.items()
                    if s.outcome is not None
                }
            return out

    # ---- the loop (engine thread) ---------------------------------------------------------------

    def _run(self) -> None:
        """Poll everything; after ``spin_s`` without progress, nap ``idle_sleep_s`` (woken by commands).

        NIXL without a progress thread offers no wake-up for incoming notifications, so an engine that
        naps sees a peer's frame only when the nap ends: spinning (with ``sched_yield``, which hands
        the core to any other runnable thread) for a while after the last progress keeps a protocol
        round trip at poll speed, and napping afterwards keeps an idle rank cheap.
        """
        try:
            spin_ns = int(self.config.spin_s * 1e9)
            last_progress_ns = self.clock()
            while not self._stop.is_set():
                moved = self._step()
                if self.fatal is not None:
                    return self._park()
                if moved:
                    last_progress_ns = self.clock()
                elif not self.config.idle_sleep_s or self.clock() - last_progress_ns < spin_ns:
                    os.sched_yield()
                else:
                    self._wake.wait(self.config.idle_sleep_s)
                    self._wake.clear()
        except BaseException as exc:  # rule 3: nothing escapes as log-and-continue
            self.recorder.record("engine_crash", None, error=repr(exc))
            self.fatal = FailStop(FatalReason.ENGINE_CRASH, None, f"engine thread raised {exc!r}")
            self._fail_stop(self.fatal)
            self._park()

    def _park(self) -> None:
        roots = (self.sender, self.receiver, self.endpoint, self.pool, self._writes)
        while roots and not self._stop.is_set():
            time.sleep(0.05)

    def _step(self) -> bool:
        moved = False
        while True:
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                break
            moved = True
            self._command(command)
        for sender_agent, frame in self._arrived_frames():
            moved = True
            self._frame(sender_agent, frame)
        moved |= self._poll_writes()
        moved |= self._poll_ready()
        for core in (self.sender, self.receiver):
            if core is not None:
                deadline = core.next_deadline_ns()
                if deadline is not None and self.clock() >= deadline:
                    self._events.append((core, Tick()))
        moved |= bool(self._events)
        self._pump()
        return moved

    def _pump(self) -> None:
        """Feed queued events to their core, executing each batch of actions before the next event."""
        while self._events and self.fatal is None:
            core, event = self._events.popleft()
            with self.lock:
                try:
                    actions = core.handle(event, self.clock())
                except PeerProtocolError as exc:  # rule 5: dropped, counted, state unchanged
                    self.stats["rejected_peer_input"] += 1
                    self.recorder.record("peer_protocol_error", getattr(event, "request_id", None), error=str(exc))
                    continue
                except LocalProtocolError as exc:  # API misuse (unknown request, release before delivery)
                    self.stats["local_protocol_errors"] += 1
                    self.recorder.record("local_protocol_error", getattr(event, "request_id", None), error=str(exc))
                    continue
            self._execute(core, actions)

    # ---- inputs --------------------------------------------------------------------------------

    def _command(self, command: tuple) -> None:
        kind = command[0]
        now = self.clock()
        if kind == "send":
            _, event, handle, tokens, aux_bytes = command
            aux_slot = -1
            if aux_bytes is not None:
                aux_slot = self.allocate_aux()
                if aux_slot >= 0:
                    self._aux_view(aux_slot)[: len(aux_bytes)] = _as_uint8(aux_bytes)
            handle.opened_ns = now
            self._sends[event.request_id] = _SendState(handle, list(tokens), aux_slot)
            self.recorder.record("open_send", event.request_id, pieces=event.num_pieces)
            self._events.append((self._core("sender"), event))
        elif kind == "receive":
            _, event, handle, allocated = command
            try:
                handle.blocks = self.pool.allocate(event.num_blocks, owner=event.request_id)
            except KvownError as exc:
                allocated.set_exception(exc)
                return
            handle.aux_slot = self.allocate_aux() if event.aux else -1
            if self.on_allocate is not None:
                self.on_allocate(handle.blocks)
            allocated.set_result(handle)
            handle.opened_ns = now
            self._recvs[event.request_id] = handle
            event = OpenReceive(event.request_id, handle.blocks, event.writers, event.num_slices, handle.aux_slot)
            self.recorder.record("open_receive", event.request_id, writers=list(event.writers))
            self._events.append((self._core("receiver"), event))
        elif kind == "cancel":
            _, role, request_id = command
            handle = self._recvs.get(request_id) if role == "receiver" else None
            if handle is not None and not handle.cancelled_ns:
                handle.cancelled_ns = now
            self.recorder.record("cancel", request_id, role=role)
            self._events.append((self._core(role), CancelRequested(request_id)))
        elif kind == "release":
            _, request_id = command
            handle = self._recvs.get(request_id)
            if handle is not None:
                handle.released_ns = now
            self._events.append((self._core("receiver"), ReleaseRequested(request_id)))
        elif kind == "local_copy":
            _, request_id, token = command
            self._next_local += 1
            self._local_copies[self._next_local] = (request_id, token)
            self._events.append((self._core("receiver"), LocalCompletionPending(request_id, self._next_local)))
        elif kind == "watermark":
            _, epoch = command
            for core in (self.sender, self.receiver):
                if core is not None:
                    self._events.append((core, WatermarkSet(epoch)))
        elif kind == "call":  # run a function on the engine thread (tests, diagnostics)
            _, fn, future = command
            try:
                future.set_result(fn(self))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
        else:
            raise LocalProtocolError("unknown engine command", field="command", command=kind)
        self._pump()

    def _core(self, role: str) -> RankCore:
        core = self.sender if role == "sender" else self.receiver
        if core is None:
            raise LocalProtocolError(f"this rank has no {role} role", field="role", rank=self.rank)
        return core

    def _frame(self, agent: str, frame: bytes) -> None:
        src = self._rank_of_agent.get(agent)
        try:
            if src is None:
                raise PeerProtocolError("notification from an unknown agent", field="agent", agent=agent[:40])
            envelope = codec.decode(frame, self.key)
            if envelope.src_rank != src:
                raise PeerProtocolError("frame claims another source rank", field="src_rank",
                                        got=envelope.src_rank, transport=src)
            delivered = self.inn.deliver(envelope)
        except PeerProtocolError as exc:
            self.stats["rejected_frames"] += 1
            self.stats[f"rejected_{getattr(exc, 'field', 'frame')}"] += 1
            self.recorder.record("frame_rejected", None, agent=agent[:40], error=str(exc))
            return
        for env in delivered:
            self.recorder.record("recv", getattr(env.message, "request_id", None), msg=env.message.KIND.name,
                                 src=env.src_rank, seq=env.seq)
            message = env.message
            if isinstance(message, Watermark):
                for core in (self.sender, self.receiver):
                    if core is not None:
                        self._events.append((core, MessageReceived(env)))
                continue
            role = "sender" if isinstance(message, (RequestData, CancelSession)) else "receiver"
            core = self.sender if role == "sender" else self.receiver
            if core is None:
                self.stats["rejected_frames"] += 1
                self.recorder.record("frame_rejected", None, error=f"{message.KIND.name} for a rank without {role}")
                continue
            self._events.append((core, MessageReceived(env)))

    def _arrived_frames(self) -> list[tuple[str, bytes]]:
        """Notifications from NIXL, in arrival order; the ``slow-control`` fault delivers them late."""
        frames = self.endpoint.drain_notifs()
        slow = self._fault.get("slow-control")
        if slow is None and not self._late_frames:
            return frames
        now = self.clock()
        delay_ns = (slow or {}).get("ms", 20) * 1_000_000
        self._late_frames.extend((now + delay_ns, agent, frame) for agent, frame in frames)
        due = 0
        while due < len(self._late_frames) and self._late_frames[due][0] <= now:
            due += 1
        ready, self._late_frames[:] = self._late_frames[:due], self._late_frames[due:]
        return [(agent, frame) for _, agent, frame in ready]

    def _poll_writes(self) -> bool:
        moved = False
        sender = self.sender
        for op_id, handle in list(self._writes.items()):
            if op_id in self._stuck_ops or self._slow_ops.get(op_id, 0) > self.clock():
                continue  # fault injection: a stuck writer never reports; a slow one reports late
            status = self.endpoint.poll(handle)
            if status is XferStatus.IN_PROGRESS:
                continue
            if status is XferStatus.DONE:
                moved = True
                del self._writes[op_id]
                self._in_doubt.discard(op_id)
                self.endpoint.release(handle)
                self._events.append((sender, WriteCompleted(op_id)))
            elif op_id not in self._in_doubt:  # ERROR: in doubt; keep polling the same handle (rule 4)
                moved = True
                self._in_doubt.add(op_id)
                self._events.append((sender, WriteFailed(op_id, repr(handle.error))))
        return moved

    def _poll_ready(self) -> bool:
        moved = False
        for token_id, (request_id, token) in list(self._local_copies.items()):
            if token.query():  # the event recorded after the local copy completed: evidence
                del self._local_copies[token_id]
                moved = True
                self._events.append((self.receiver, LocalCompletionDone(request_id, token_id)))
        for request_id, state in list(self._sends.items()):
            for piece, token in enumerate(state.tokens):
                if token is not None and token.query():
                    state.tokens[piece] = None
                    moved = True
                    self._events.append((self.sender, SourceReady(request_id, piece)))
        return moved

    # ---- actions -------------------------------------------------------------------------------

    def _execute(self, core: RankCore, actions: list[Action]) -> None:
        published: dict[int, set[int]] = {}
        for action in actions:
            if isinstance(action, SendControl):
                ok = self._send(action.dst_rank, action.message)
                if isinstance(action.message, RequestData):
                    failed = published.setdefault(action.message.request_id, set())
                    if not ok:
                        failed.add(action.dst_rank)
            elif isinstance(action, PostWrite):
                self._post(action)
            elif isinstance(action, Deliver):
                handle = self._recvs.get(action.request_id)
                if handle is not None:
                    handle.landed_ns = self.clock()
                    handle.landed.set()
            elif isinstance(action, Conclude):
                self.recorder.record("conclude", action.request_id, outcome=action.outcome.value, reason=action.reason)
                self.stats[f"{'send' if core is self.sender else 'recv'}_{action.outcome.value}"] += 1
                handle = (self._sends.get(action.request_id) if core is self.sender else None)
                target = handle.handle if handle is not None else self._recvs.get(action.request_id)
                if core is self.receiver and action.outcome is not Outcome.COMPLETED and target is not None:
                    self.pool.hold(target.blocks)  # OWNED -> HELD: awaiting proof that writers quiesced
                if target is not None and not target.outcome.done():
                    target.outcome.set_result(action.outcome)
            elif isinstance(action, RetireBlocks):
                self._retire(action.request_id)
            elif isinstance(action, ReleaseSource):
                state = self._sends.pop(action.request_id, None)
                if state is not None:
                    if state.aux_slot >= 0:
                        self._aux_free.append(state.aux_slot)
                    state.handle.released_ns = self.clock()
                    state.handle.released.set()
            elif isinstance(action, AdmissionRefused):
                self.stats["admission_refused"] += 1
                self._refuse(core, action)
            elif isinstance(action, FailStop):
                self.fatal = action
                self.recorder.record("fail_stop", action.request_id, reason=action.reason.value, detail=action.detail)
                self._fail_stop(action)
                return
        for request_id, failed in published.items():
            self._events.append((core, PublicationSent(request_id, frozenset(failed))))

    def _send(self, dst_rank: int, message: Any) -> bool:
        envelope = self.out.stamp(dst_rank, message)
        self.recorder.record("send", getattr(message, "request_id", None), msg=message.KIND.name,
                             dst=dst_rank, seq=envelope.seq)
        try:
            self.endpoint.send_notif(self.peers[dst_rank].agent_name, codec.encode(envelope, self.key))
        except AdapterError:
            if isinstance(message, RequestData):
                return False  # never delivered: the writer is not published
            raise  # a hole in an ordered stream cannot be repaired: fail-stop (rule 3)
        self.stats["control_sent"] += 1
        return True

    def _post(self, action: PostWrite) -> None:
        """Execute one PostWrite and feed back exactly one of the submit events."""
        state = self._sends.get(action.request_id)
        if action.kind is PieceKind.AUX and (state is None or state.aux_slot < 0):
            self._events.append((self.sender, WriteNotSubmitted(action.op_id, "no aux payload")))
            return
        try:
            handle = self._submit(action, state)
        except (AdapterError, LocalProtocolError) as exc:  # e.g. a peer's block id beyond its pool
            if getattr(exc, "posted", False) is None:  # transfer() itself raised: in doubt until DONE
                self._writes[action.op_id] = exc.handle  # rooted and polled
                self._in_doubt.add(action.op_id)
                self._events.append((self.sender, WriteSubmitFailed(action.op_id, str(exc))))
            else:  # refused before anything was posted
                self._events.append((self.sender, WriteNotSubmitted(action.op_id, str(exc))))
            return
        self._writes[action.op_id] = handle
        self.stats["bytes_written"] += handle.nbytes
        if "stuck-writer" in self._fault and self._fault_fires("stuck-writer"):
            self._stuck_ops.add(action.op_id)
            self.recorder.record("fault_stuck_writer", action.request_id, op_id=action.op_id)
        if "slow-writer" in self._fault and self._fault_fires("slow-writer"):
            self._slow_ops[action.op_id] = self.clock() + self._fault["slow-writer"].get("ms", 300) * 1_000_000
            self.recorder.record("fault_slow_writer", action.request_id, op_id=action.op_id)
        self._events.append((self.sender, WriteSubmitted(action.op_id)))

    def _submit(self, action: PostWrite, state: _SendState | None) -> Any:
        """Post the WRITE: the aux slot, whole blocks (prepped lists), or one head slice per block."""
        peer = self.peers[action.receiver_rank]
        if action.kind is PieceKind.AUX:
            nbytes = self.config.aux_slot_nbytes
            local = [(self._aux_addr(state.aux_slot), nbytes)]  # type: ignore[union-attr]
            remote = [(peer.aux_addr + action.aux_slot * nbytes, nbytes)]
        elif action.num_slices == 1:
            local_prep, remote_prep = self._preps(action.receiver_rank)
            return self.endpoint.post_write_blocks(peer.agent_name, local_prep, action.src_blocks,
                                                   remote_prep, action.dst_blocks)
        else:
            local, remote = self._kv_ranges(action, peer)
        return self.endpoint.post_write(peer.agent_name, local, remote, self._mem, MemKind(peer.mem_kind))

    def _preps(self, peer_rank: int) -> tuple[Any, Any]:
        """Descriptor lists of whole blocks, prepped once per side (NIXL merges contiguous runs)."""
        nbytes = self.pool.layout.block_nbytes
        if self._local_prep is None:
            self._local_prep = self.endpoint.prep_blocks(self.pool.base_addr, nbytes, self.pool.layout.num_blocks,
                                                         self._mem)
        remote = self._remote_preps.get(peer_rank)
        if remote is None:
            peer = self.peers[peer_rank]
            remote = self._remote_preps[peer_rank] = self.endpoint.prep_blocks(
                peer.pool_addr, nbytes, peer.pool_nbytes // nbytes, MemKind(peer.mem_kind), peer=peer.agent_name)
        return self._local_prep, remote

    def _kv_ranges(self, action: PostWrite, peer: PeerInfo) -> tuple[list, list]:
        """Byte ranges of one head slice of every block (fan-in: each writer owns a slice)."""
        layout = self.pool.layout
        base, remote_base = self.pool.base_addr, peer.pool_addr
        local, remote = [], []
        for src, dst in zip(action.src_blocks, action.dst_blocks):
            for off, n in layout.head_slice_ranges(src, action.slice_index, action.num_slices):
                local.append((base + off, n))
            for off, n in layout.head_slice_ranges(dst, action.slice_index, action.num_slices):
                remote.append((remote_base + off, n))
        return local, remote

    def _retire(self, request_id: int) -> None:
        handle = self._recvs.pop(request_id, None)
        if handle is None:
            return
        self.pool.retire(handle.blocks, owner=request_id)
        if self.on_retire is not None:
            self.on_retire(handle.blocks)
        if handle.aux_slot >= 0:
            self._aux_free.append(handle.aux_slot)
        handle.retired_ns = self.clock()
        self.recorder.record("retire", request_id, blocks=len(handle.blocks))
        handle.retired.set()

    def _refuse(self, core: RankCore, action: AdmissionRefused) -> None:
        error = AdmissionError("session refused", request_id=action.request_id, reason=action.reason)
        if core is self.sender:
            state = self._sends.pop(action.request_id, None)
            if state is not None:
                state.handle.outcome.set_exception(error)
                state.handle.released.set()
        else:
            handle = self._recvs.pop(action.request_id, None)
            if handle is not None:
                self.pool.retire(handle.blocks, owner=action.request_id)  # nothing was ever published
                handle.outcome.set_exception(error)
                handle.retired.set()

    # ---- helpers -------------------------------------------------------------------------------

    def _aux_view(self, slot: int) -> Any:
        n = self.config.aux_slot_nbytes
        return self.aux[slot * n : (slot + 1) * n]

    def _aux_addr(self, slot: int) -> int:
        return self.aux.data_ptr() + slot * self.config.aux_slot_nbytes

    def _fault_fires(self, name: str) -> bool:
        spec = self._fault[name]
        spec["seen"] = spec.get("seen", 0) + 1
        return spec.get("nth", 1) in (0, spec["seen"])


def _parse_fault(text: str, rank: int) -> dict[str, dict[str, int]]:
    """Fault injection at the NIXL seam, for tests and ``kvown demo --fault``.

    ``KVOWN_FAULT="stuck-writer:rank=0:nth=3"``: on rank 0 the 3rd posted WRITE never reports DONE.
    ``"slow-writer:rank=0:nth=1:ms=300"``: the 1st posted WRITE reports DONE only after 300 ms
    (``nth=0`` means every WRITE). ``"slow-control:rank=0:ms=20"``: every control frame reaches rank 0
    20 ms late (a slow network; order is kept). Entries are comma-separated.
    """
    faults: dict[str, dict[str, int]] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, *opts = item.split(":")
        spec = {k: int(v) for k, v in (o.split("=", 1) for o in opts)}
        if spec.pop("rank", rank) == rank:
            faults[name] = spec
    return faults


def _as_uint8(data: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


__all__ = ["AdmissionError", "Engine", "ReceiveHandle", "ReceiveSpec", "SendHandle"]
