"""The driver: all the work between one rank's protocol cores and its adapters, with no thread of its own.

Owns: the rank's cores, control streams and resends, WRITEs in flight, unreported tokens and local copies,
API handles, aux slots, canaries, counters. Engine and simulator run the same ``step`` (docs/design.md s. 14).

Rules:
  1. ``step`` turns all that arrived into core events, running each batch of actions before the next; it never
     blocks, reads ``clock`` only to stamp handles. ``frames_first``: frames older than the commands go first.
  2. One adapter call or handle update per action; ``SendControl`` queues a frame per peer (commands' go first).
  3. No stream keeps a hole: a frame whose send raised is resent as is (CONTROL_LOST: ``control_retry_s``).
  3a. A ``PostWrite``'s ``result`` is carried: its WRITE's notification (unordered). Whole-block ones wait for
      the pump to run dry, then go as one transfer per peer with every report (``coalesce_writes``).
  4. A WRITE whose poll answered IN_DOUBT, or whose post raised, is never released: polled until DONE.
  5. Bad peer input is dropped and counted. 6. A FailStop (core, resends, canary, InvariantViolation) latches
     ``fatal`` once, then all stays held; a core's LocalProtocolError in ``step`` is our bug (6a: INVARIANT).
  7. Other threads call ``submit`` and pure readers only (``check_fatal``, ``next_deadline_ns``, ``view``,
     ``statistics``, ``earliest_deadline_ns``, ``quiet``); cores are touched under ``lock``, held per event.
  7a. Late or refused inputs are settled here (counted no-ops: closes of retired receives, a watermark under
     a live session); a close's ready token waits first. A send's tokens ready at once ride on its open.
  8. The hot path formats nothing and scans nothing that does not move. 9. ``probe`` is the one test hook.
  10. Callbacks (``on_landed``, ``on_done``) run after their event and outcome; what they raise is counted.

Invariants: INV-DR1 a PostWrite is executed only as the core emits it. INV-DR2 blocks return to the pool
only on RetireBlocks, or AdmissionRefused of an unpublished session. INV-DR3 every stamped frame is sent.
"""

from __future__ import annotations

import collections
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any, ContextManager, NoReturn

import torch

from kvown.adapters.codec import FrameCodec
from kvown.adapters.transport import InDoubt, NotPosted, Posted, Role, Transport, WriteStatus
from kvown.cache.canary import Canaries
from kvown.cache.lent import LentBlocks
from kvown.cache.pool import KVPool
from kvown.core.actions import (
    Action,
    AdmissionRefused,
    Conclude,
    Deliver,
    Disputed,
    FailStop,
    FatalReason,
    Outcome,
    PieceKind,
    PostWrite,
    ReleaseSource,
    RetireBlocks,
    SendControl,
)
from kvown.core.errors import AdapterError, InvariantViolation, KvownError, LocalProtocolError, PeerProtocolError
from kvown.core.events import (
    CancelRequested,
    Event,
    LocalCompletionDone,
    LocalCompletionPending,
    MessageReceived,
    OpenReceive,
    OpenSend,
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
from kvown.core.messages import MAX_BATCH, MAX_CARRIED, Message
from kvown.core.receiver import ReceiverCore
from kvown.core.routing import Drop, Router
from kvown.core.sender import SenderCore
from kvown.core.streams import InboundStreams, OutboundStreams
from kvown.runtime.commands import (
    AdmissionError,
    Call,
    Cancel,
    Command,
    LocalCopy,
    Receive,
    Release,
    Send,
    SetWatermark,
)
from kvown.runtime.config import TransferConfig
from kvown.runtime.flight import FlightRecorder, event_code
from kvown.runtime.handles import ReceiveHandle, SendHandle
from kvown.runtime.resend import ResendQueue
from kvown.runtime.statistics import Audit, PoolCounts, ReceiverStatistics, RoleStatistics, Statistics, frozen
from kvown.runtime.view import RankView, ViewCell, frozen_peers

# Flight-recorder event codes of the hot path (module rule 8); the field names appear only in dumps.
EV_SEND = event_code("send", "dst", "seq", "msgs")
EV_RECV = event_code("recv", "msg", "src", "seq", "index")
EV_RECV_CARRIED = event_code("recv_carried", "msg", "src", "piece")
EV_POST = event_code("post", "op", "dst", "carried")
EV_POST_RETURNED = event_code("post_returned", "op")
EV_OPEN_SEND = event_code("open_send", "pieces")
EV_OPEN_RECEIVE = event_code("open_receive", "writers")
EV_CANCEL = event_code("cancel", "role")
EV_RELEASE = event_code("release", "ready_token")
EV_CONCLUDE = event_code("conclude", "outcome", "reason")
EV_RETIRE = event_code("retire", "blocks")
_OUTCOME_NAMES = {o: o.value for o in Outcome}  # a member's .value is a Python property: read once here
_MAY_PUBLISH = (MessageReceived, OpenSend)  # the inputs that can attach a publication to a send session
FRAME_BUDGET_NBYTES = 256 * 1024  # a batch is split below this (MAX_FRAME_NBYTES is 1 MiB)
NO_DEADLINE_NS = 1 << 62  # ``earliest_deadline_ns`` when no core runs a clock
TOKEN_POLL_BUDGET = 256  # pending sends whose ready tokens one step queries (round robin, rule 8)


class _SendState:
    __slots__ = ("handle", "tokens", "aux_slot")

    def __init__(self, handle: SendHandle, tokens: list[Any], aux_slot: int) -> None:
        self.handle = handle
        self.tokens = tokens  # per piece: a ReadyToken, or None once reported ready
        self.aux_slot = aux_slot


class Driver:
    """One rank's driver. See the module header for the rules; ``Engine`` runs it on a thread."""

    def __init__(
        self,
        *,
        rank: int,
        peers: tuple[int, ...],
        roles: frozenset[Role],
        transport: Transport,
        pool: KVPool | LentBlocks,
        aux: torch.Tensor,
        key: bytes,
        config: TransferConfig,
        recorder: FlightRecorder,
        on_fail_stop: Callable[[FailStop], None],
        clock: Callable[[], int],
        lock: ContextManager[Any] | None = None,
    ) -> None:
        self.rank = rank
        self._stamp = clock  # rule 1: handle timestamps only
        self.transport = transport
        self.pool = pool
        self.aux = aux  # uint8 tensor: aux_slots * aux_slot_nbytes
        self.key = key
        self.config = config
        self.recorder = recorder
        self.on_fail_stop = on_fail_stop
        # a real lock even alone (the simulator): acquiring it is C, a nullcontext is two Python calls
        self.lock: ContextManager[Any] = lock if lock is not None else threading.Lock()
        self.codec = FrameCodec(key)
        core_config = config.core_config(rank, peers)
        self.sender = SenderCore(core_config, carry_results=config.carry_results) if Role.SENDER in roles else None
        self.receiver = ReceiverCore(core_config) if Role.RECEIVER in roles else None
        self._core_list: list[RankCore[Any]] = [c for c in (self.sender, self.receiver) if c is not None]
        self.inbox: collections.deque[Command] = collections.deque()  # append/popleft are atomic
        self.out = OutboundStreams(rank)
        self.inn = InboundStreams(rank)
        self.stats: collections.Counter[str] = collections.Counter()
        self.router = Router(rank, self.sender, self.receiver, self.inn)  # routing and carried reports (rule 3a)
        self.resend = ResendQueue(transport, retry_s=config.control_retry_s, stats=self.stats, recorder=recorder)
        self.fatal: FailStop | None = None
        # rule 7: written by each step; no core deadline, so no fail-stop, falls before it (0: unknown)
        self.earliest_deadline_ns = 0
        # lent memory has no canaries (kvown.rank refuses the pair with a ConfigError naming ``canary``)
        self.canaries = Canaries.of_pool(pool) if config.canary and isinstance(pool, KVPool) else None
        self._now_ns = 0
        self._events: collections.deque[tuple[RankCore[Any], Event]] = collections.deque()
        self._outbox: dict[int, list[Message]] = {}  # dst -> messages of this step (rule 2)
        self.batch_frames = True  # rule 2; False sends one frame per message (benchmarks compare the two)
        self._writes: dict[Any, list[int]] = {}  # transfer handle -> op ids it writes; posted, not yet DONE
        self.coalesce_writes = config.coalesce_writes  # rule 3a
        self._coalesced: list[PostWrite] = []  # carried WRITEs of this pump, held back to go as one per peer
        self._in_doubt: set[int] = set()  # op ids whose post raised or whose handle reported ERROR
        self._unreleased: list[Any] = []  # DONE handles whose release failed: retried each step
        self._sends: dict[int, _SendState] = {}
        self._pending_tokens: dict[int, _SendState] = {}  # sends with a piece not yet ready (rule 8)
        self._recvs: dict[int, ReceiveHandle] = {}
        self._local_copies: dict[int, tuple[int, Any]] = {}  # token id -> (request id, ready token)
        self._next_local = 0
        self._aux_free = list(range(config.aux_slots - 1, -1, -1))
        self._unpublished: dict[int, SendHandle] = {}  # sends no receiver has published to yet
        self.probe: Callable[[str, int], None] | None = None  # rule 9: tests only
        self._roles = roles
        self.views = ViewCell(self._make_view(0))

    # ---- any thread ---------------------------------------------------------------------------

    def submit(self, command: Command) -> None:
        """Queue a command. Called: by API facades, any thread (a deque append is atomic)."""
        self.inbox.append(command)

    def check_fatal(self, now_ns: int) -> FailStop | None:
        """Pure: the fail-stop this rank latched or would latch at ``now_ns``. Lock held by the caller."""
        if self.fatal is not None:
            return self.fatal
        for core in self._cores():
            fatal = core.check_fatal(now_ns)
            if fatal is not None:
                return fatal
        return None

    def next_deadline_ns(self) -> int | None:
        """Pure: the earliest deadline of either core. Called: by the retirement watchdog (under ``lock``) to
        time its next check, and by the simulator to choose its next instant; the engine never naps on it
        (it ticks due cores inside ``step`` and naps ``config.idle_sleep_s``)."""
        deadlines = [d for d in (c.next_deadline_ns() for c in self._cores()) if d is not None]
        return min(deadlines, default=None)

    def quiet(self) -> bool:
        """Pure: nothing open, queued or owed - no command waits and every table ``audit`` counts is empty.
        Called: by the engine thread before a nap; only a quiet rank naps longer (engine rule 3), so all it
        can meet late is a peer's first frame."""
        return not self.inbox and not any(size for _, size in self._tables())

    def retry_due(self) -> bool:
        """Pure: a frame whose send raised, or a DONE handle whose release raised, is retried on the next
        step (rules 3 and 4). The simulator's next instant for an otherwise idle rank."""
        return bool(self.resend) or bool(self._unreleased)

    def _tables(self) -> Iterator[tuple[str, int]]:
        """(table, entries) for every table that must be empty on a quiet rank, each sized only when
        reached, so ``quiet`` stops at the first that is not. Pure."""
        sender, cores = self.sender, self._core_list
        yield "sessions", sum(len(c.sessions) for c in cores)
        yield "receive_handles", len(self._recvs)
        yield "send_states", len(self._sends)
        yield "writes_in_flight", len(self._writes)
        yield "writes_in_doubt", len(self._in_doubt)
        yield "unreleased_handles", len(self._unreleased)
        yield "unsent_frames", self.resend.frames()
        yield "local_copies", len(self._local_copies)
        yield "aux_slots_used", self.config.aux_slots - len(self._aux_free)
        yield "saved_publications", sender.saved_publications() if sender is not None else 0
        yield "held_frames", self.inn.held_count()

    def statistics(self) -> Statistics:
        """A frozen snapshot for dashboards, benchmarks and checks. Called: any thread (takes ``lock``)."""
        with self.lock:
            pool = self.pool.statistics()
            sender = receiver = None
            if self.sender is not None:
                sender = RoleStatistics(**self._role_figures(self.sender))
            if self.receiver is not None:
                rx = self.receiver
                pending = {rid: tuple(w.rank for w in s.writers.values() if not w.settled)
                           for rid, s in list(rx.sessions.items()) if s.outcome is not None}
                receiver = ReceiverStatistics(**self._role_figures(rx), blocks_awaiting_proof=pool.held,
                                              quarantined=rx.quarantined, acks_pending=frozen(pending))
            return Statistics(
                rank=self.rank,
                pool=PoolCounts(pool.total, pool.free, pool.owned, pool.held),
                writes_in_flight=len(self._writes),
                writes_in_doubt=len(self._in_doubt),
                control_unsent=self.resend.frames(),
                fatal=None if self.fatal is None else self.fatal.detail,
                counters=frozen({**self.stats, "duplicate_frames": self.inn.duplicates}),
                sender=sender,
                receiver=receiver,
                faults=frozen(getattr(self.transport, "counts", {})),
            )

    def audit(self, *, check_canaries: bool = True, restamp: bool = False) -> Audit:
        """The tables that must be empty on a quiet rank, fence figures, and the canaries of every free
        block (``restamp``: stamp broken ones again, so a long run counts each once). Engine thread."""
        cores = self._core_list
        tables = dict(self._tables())
        free = tuple(self.pool.free_blocks()) if isinstance(self.pool, KVPool) else ()
        broken: list[Any] = []
        if check_canaries and self.canaries is not None and free:
            broken = self.canaries.check(free)
            if restamp and broken:
                self.canaries.fill(tuple(b.block for b in broken))
        return Audit(
            tables=frozen(tables), fences=sum(len(c.fence) for c in cores),
            fence_nbytes=sum(c.fence.nbytes() for c in cores),
            fences_compacted=sum(c.counters.get("fences_compacted", 0) for c in cores),
            free_blocks=self.pool.statistics().free,
            canary_broken=tuple((b.block, b.epoch, b.offset) for b in broken),
        )

    def open_sessions(self) -> list[dict[str, Any]]:
        """Every live session of both cores as plain values (the flight recorder's post-mortem). Pure; safe
        from the dump thread while the engine is parked, and it never raises for a table changing."""
        out: list[dict[str, Any]] = []
        for core in self._core_list:
            out += core.open_sessions()  # type: ignore[attr-defined]
        return out

    @staticmethod
    def _role_figures(core: RankCore[Any]) -> dict[str, Any]:
        return {"sessions": len(core.sessions), "sessions_by_state": frozen(core.sessions_by_state()),
                "fences": len(core.fence), "oldest_fail_stop_deadline_ns": core.nearest_fail_stop_ns(),
                "counters": frozen(core.counters)}

    @property
    def view(self) -> RankView:
        """The current immutable view (rule 7). Called: any thread."""
        return self.views.view

    def _make_view(self, version: int) -> RankView:
        pool, config = self.pool, self.config
        return RankView(
            rank=self.rank, roles=self._roles, peers=frozen_peers(getattr(self.transport, "peers", {})),
            num_blocks=pool.num_blocks, num_kv_heads=pool.heads(),
            block_nbytes=sum(r.chunk_nbytes for r in pool.space().regions),
            aux_slots=config.aux_slots, aux_slot_nbytes=config.aux_slot_nbytes, lent=isinstance(pool, LentBlocks),
            version=version,
        )

    def refresh_view(self) -> RankView:
        """Publish a new view after the transport's peers changed. Called: engine thread, or before the
        engine starts (start-up, the simulator's wiring)."""
        return self.views.publish(self._make_view)

    def connect_peers(self, peers: dict[int, Any]) -> RankView:
        """Load peers that joined (``transport.connect``) and publish the new view. Engine thread."""
        self.transport.connect(peers)  # type: ignore[attr-defined]
        return self.refresh_view()

    # ---- the step (engine thread) ---------------------------------------------------------------

    def step(self, now_ns: int, frames_first: bool = False) -> bool:
        """Do everything that is due at ``now_ns``; True if anything happened (rule 1).

        ``frames_first``: the engine's first step after a nap, whose frames arrived before the command that
        woke it (a publication and its cancel before the ``send``, which is then born cancelled and posts
        no WRITE). Otherwise commands go first: a spinning engine's commands are the newer, and their
        messages should not wait for this step's frames. Either order is one the frames' timing allows.
        Called: by the engine thread in a loop, or by the simulator. After error: an exception other
        than ``InvariantViolation`` escapes (the engine turns it into an ENGINE_CRASH fail-stop).
        """
        if self.fatal is not None:
            return False
        self._now_ns = now_ns
        try:
            moved = False
            if frames_first and self._take_frames():
                moved = True
                self._pump()
            if self.inbox:
                moved |= self._take_commands()
            if self._outbox:  # rule 2: a command's messages (a publication, a cancel) do not wait for the
                self._flush_outbox()  # frames this step reads, nor for the WRITEs those may post
            if not frames_first:
                moved |= self._take_frames()
            if self._writes or self._unreleased:
                moved |= self._poll_writes()
            if self._pending_tokens or self._local_copies:
                moved |= self._poll_tokens()
            if self.resend:
                moved |= self._resend()
            due_ns = NO_DEADLINE_NS
            for core in self._core_list:
                deadline = core.next_deadline_ns()
                if deadline is not None:
                    if now_ns >= deadline:
                        self._events.append((core, Tick()))
                    due_ns = min(due_ns, deadline)
            self.earliest_deadline_ns = due_ns
            if self._events:
                moved = True
                self._pump()
            if self._outbox:
                self._flush_outbox()
        except InvariantViolation as exc:  # rule 6
            self._fail_stop(_invariant_fail_stop(exc))
            return True
        return moved

    def _cores(self) -> list[RankCore[Any]]:
        return self._core_list

    def _pump(self) -> None:
        """Feed queued events to their core, executing each batch of actions before the next event; then post
        the carried WRITEs held back (rule 3a), whose submit events pump again."""
        while True:
            while self._events and self.fatal is None:
                core, event = self._events.popleft()
                actions = self._handle(core, event)
                if actions is None:
                    continue
                if core is self.sender and type(event) in _MAY_PUBLISH and self._unpublished:
                    self._note_publication(event)  # before the actions: one may post (posted_ns after it)
                self._execute(core, actions)
            if not self._coalesced or self.fatal is not None:
                return
            self._post_coalesced()

    def _handle(self, core: RankCore[Any], event: Event) -> list[Action] | None:
        """One event into its core under ``lock`` (rule 7); None: a peer's bad input, dropped (rule 5)."""
        with self.lock:
            try:
                return core.handle(event, self._now_ns)
            except PeerProtocolError as exc:  # rule 5: dropped, counted, state unchanged
                self.stats["rejected_peer_input"] += 1
                self.recorder.record("peer_protocol_error", getattr(event, "request_id", None), error=str(exc))
                return None
            except LocalProtocolError as exc:
                self._core_bug(event, exc)  # raises (rule 6a)

    def _core_bug(self, event: Event, exc: LocalProtocolError) -> NoReturn:
        """Rule 6a: a core refused a local input inside the engine - our bug, never a race between API
        calls (rule 7a settles those before the core) - so it is an INVARIANT fail-stop (rule 6)."""
        rid = getattr(event, "request_id", None)
        self.stats["local_protocol_errors"] += 1
        self.recorder.record("local_protocol_error", rid, error=str(exc))
        raise InvariantViolation("a core refused a local input inside the engine (our bug)",
                                 request_id=rid, event=type(event).__name__, error=str(exc)) from exc

    def _note_publication(self, event: Event) -> None:
        """Stamp ``published_ns`` on a send's handle once a receiver's publication attached to it (an
        arriving REQUEST_DATA, or a saved one when the session opened)."""
        source = event.envelope.message if type(event) is MessageReceived else event
        rid: int | None = getattr(source, "request_id", None)
        if rid is None or self.sender is None:  # a WATERMARK or HELLO names no request: nothing to stamp
            return
        handle = self._unpublished.get(rid)
        if handle is not None and self.sender.published(rid):
            del self._unpublished[rid]
            handle.published_ns = self._stamp()

    # ---- commands ------------------------------------------------------------------------------

    def _take_commands(self) -> bool:
        moved = False
        while self.inbox and self.fatal is None:
            moved = True
            self._command(self.inbox.popleft())
            self._pump()  # each command's actions run before the next command is looked at
        return moved

    def _command(self, command: Command) -> None:
        # an isinstance chain over small functions: one name, one type (docs/design.md s. 17 rule 8)
        if isinstance(command, Send):
            self._open_send(command)
        elif isinstance(command, Receive):
            if not command.ticket.take():
                self.stats["receives_withdrawn"] += 1  # the caller gave up first: nothing is done
                return
            self._open_receive(command)
        elif isinstance(command, Cancel):
            self._cancel(command)
        elif isinstance(command, Release):
            self._release(command.request_id, command.issued_ns, command.ready)
        elif isinstance(command, LocalCopy):
            if command.request_id in self._recvs:
                self._local_copy(command.request_id, command.token)
            else:  # rule 7a: the session retired before the copy was declared
                self._late("late_local_copy", command.request_id)
        elif isinstance(command, SetWatermark):
            self._set_watermark(command.epoch)
        elif isinstance(command, Call):
            try:
                command.future.set_result(command.fn(self))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                command.future.set_exception(exc)
        else:
            raise LocalProtocolError("unknown command", field="command", command=type(command).__name__)

    def _open_send(self, command: Send) -> None:
        rid = command.request_id
        if self.sender is None or rid in self._sends:
            command.handle.outcome.set_exception(
                LocalProtocolError("request already has a live send session here", field="request_id",
                                   request_id=rid))
            self._finish(command.handle, command.handle.released)
            return
        aux_slot = self._take_aux() if command.aux is not None else -1
        if command.aux is not None and aux_slot < 0:
            self.stats["aux_exhausted"] += 1  # the AUX piece will be reported FAILED
        elif aux_slot >= 0:  # the whole slot: no bytes of its previous payload survive
            view = self._aux_view(aux_slot)
            view.zero_()
            view[: len(command.aux)] = torch.frombuffer(bytearray(command.aux), dtype=torch.uint8)  # type: ignore[arg-type]
        command.handle.opened_ns = self._stamp()
        state = self._sends[rid] = _SendState(command.handle, list(command.tokens), aux_slot)
        self._unpublished[rid] = command.handle
        self.recorder.note(EV_OPEN_SEND, rid, len(command.tokens))
        ready = self._ready_now(state)  # rule 8: a token ready now is never polled; it rides on the open
        self._events.append((self.sender, OpenSend(rid, command.src_blocks, len(command.tokens),
                                                    command.num_receivers, command.dst_suffix, ready)))
        if any(t is not None for t in state.tokens):
            self._pending_tokens[rid] = state

    def _cancel(self, command: Cancel) -> None:
        rid = command.request_id
        core = self.sender if command.role is Role.SENDER else self.receiver
        handle = self._recvs.get(rid) if command.role is Role.RECEIVER else None
        if handle is not None:
            if not handle.cancelled_ns:
                handle.cancelled_ns = command.issued_ns
            if command.ready is not None:  # rule 7a: the consumer may still be reading
                self._local_copy(rid, command.ready)
        self.recorder.note(EV_CANCEL, rid, command.role.value)
        if core is not None:
            self._events.append((core, CancelRequested(rid, notify=command.notify)))

    def _set_watermark(self, epoch: int) -> None:
        refusal = next((why for why in (c.watermark_refusal(epoch) for c in self._cores()) if why), "")
        if refusal:  # rule 7a: a watermark the cores would refuse is a counted no-op
            self.stats["watermark_refused"] += 1
            self.recorder.record("watermark_refused", None, epoch=epoch, reason=refusal)
            return
        for core in self._cores():
            self._events.append((core, WatermarkSet(epoch)))

    def _release(self, rid: int, issued_ns: int, ready: Any) -> None:
        """Rule 7a: release a delivered receive; a late release (retired, or concluded without
        delivery by a racing cancel or timeout) is a counted no-op."""
        handle = self._recvs.get(rid)
        if handle is None or handle.result() not in (None, Outcome.COMPLETED):  # concluded undelivered
            self._late("late_release", rid)
            return
        if not handle.released_ns:
            handle.released_ns = issued_ns
        self.recorder.note(EV_RELEASE, rid, ready is not None)
        if ready is not None:
            self._local_copy(rid, ready)
        self._events.append((self.receiver, ReleaseRequested(rid)))  # type: ignore[arg-type]

    def _local_copy(self, rid: int, token: Any) -> None:
        """A consumer's pending copy or read of a live receive: evidence retirement must wait for."""
        if token.query():  # done already: nothing to wait for (module rule 8)
            return
        self._next_local += 1
        self._local_copies[self._next_local] = (rid, token)
        self._events.append((self.receiver, LocalCompletionPending(rid, self._next_local)))  # type: ignore[arg-type]

    def _late(self, counter: str, rid: int) -> None:
        self.stats[counter] += 1
        self.recorder.record(counter, rid)

    def _open_receive(self, command: Receive) -> None:
        rid, ticket = command.request_id, command.ticket
        if self.receiver is None or rid in self._recvs:
            ticket.future.set_exception(LocalProtocolError("request already has a live receive session here",
                                                           field="request_id", request_id=rid))
            return
        aux_slot = self._take_aux() if command.aux else -1
        try:
            if command.aux and aux_slot < 0:
                from kvown.cache.pool import PoolExhausted

                raise PoolExhausted("no free aux slot", requested=1, free=0, owner=rid)
            if command.blocks:  # bring-your-own memory: the server lends these (kvown.cache.lent)
                if not isinstance(self.pool, LentBlocks):  # the API refuses it first (view.lent)
                    raise LocalProtocolError("this rank allocates its own blocks", field="blocks")
                blocks = self.pool.lend(command.blocks, owner=rid)
            else:
                blocks = self.pool.allocate(command.num_blocks, owner=rid)
        except KvownError as exc:  # PoolExhausted: back-pressure, nothing changed
            if aux_slot >= 0:
                self._aux_free.append(aux_slot)
            ticket.future.set_exception(exc)
            return
        if self.canaries is not None:
            try:
                self._verify_canaries(blocks, rid)
            except InvariantViolation as exc:  # rule 6, latched before the caller hears of it: its thread
                self._fail_stop(_invariant_fail_stop(exc))  # may die of the answer at once, and its exit
                ticket.future.set_exception(AdmissionError(  # hook must report this cause, not a crash
                    "this rank is fail-stopping", request_id=rid, reason=str(exc)))
                raise
        handle = ReceiveHandle(rid, blocks, aux_slot, opened_ns=self._stamp(), on_done=command.on_done,
                               on_landed=command.on_landed)
        self._recvs[rid] = handle
        ticket.future.set_result(handle)
        self.recorder.note(EV_OPEN_RECEIVE, rid, command.writers)
        self._events.append((self.receiver, OpenReceive(rid, blocks, command.writers, command.num_slices, aux_slot)))

    # ---- frames --------------------------------------------------------------------------------

    def _take_frames(self) -> bool:
        try:
            arrived = self.transport.receive()
        except AdapterError as exc:  # notifications may be lost: a gap then ends at a deadline
            self.stats["receive_errors"] += 1
            self.recorder.record("receive_error", None, error=str(exc))
            return True
        if not arrived:
            return False
        for src, data in arrived:
            self._frame(src, data)
        return True

    def _frame(self, src: int | None, data: bytes) -> None:
        try:
            if src is None:
                raise PeerProtocolError("notification from an unknown agent", field="agent")
            deliveries = self.router.frame(src, self.codec.decode(data))
        except PeerProtocolError as exc:  # rule 5
            self.stats["rejected_frames"] += 1
            self.stats[f"rejected_{getattr(exc, 'field', 'frame')}"] += 1
            self.recorder.record("frame_rejected", None, src=src, error=str(exc))
            return
        for d in deliveries:
            envelope = d.event.envelope
            message = envelope.message
            if d.event.carried:  # rule 3a: each report handed to the core once
                if d.drop is not None:
                    self.stats[d.drop.value] += 1
                    continue
                self.recorder.note(EV_RECV_CARRIED, message.request_id, message.KIND, envelope.src_rank,  # type: ignore[attr-defined]
                                   message.piece)  # type: ignore[attr-defined]
            else:
                self.recorder.note(EV_RECV, getattr(message, "request_id", None), message.KIND, envelope.src_rank,
                                   envelope.seq, d.index)
                if d.drop is Drop.NO_ROLE:
                    self.stats[d.drop.value] += 1
                    self.recorder.record("frame_rejected", None, error=f"{message.KIND.name} for a rank without that role")
                    continue
            for core in d.cores:
                self._events.append((core, d.event))

    # ---- control sends (rule 3) -----------------------------------------------------------------

    def _flush_outbox(self) -> None:
        """Rule 2: every peer's messages of this step leave as one frame (split below the frame cap)."""
        outbox, self._outbox = self._outbox, {}
        for dst, messages in outbox.items():
            if not self.batch_frames:
                for message in messages:
                    self._send_frame(dst, [message])
                continue
            start, size = 0, 0
            for i, message in enumerate(messages):
                size += FrameCodec.message_nbytes(message)
                if i > start and (size > FRAME_BUDGET_NBYTES or i - start >= MAX_BATCH):
                    self._send_frame(dst, messages[start:i])
                    start, size = i, FrameCodec.message_nbytes(message)
            self._send_frame(dst, messages[start:])

    def _send_frame(self, dst: int, messages: list[Message]) -> None:
        seq = self.out.next_seq(dst)
        frame = self.codec.encode(self.rank, dst, seq, messages)
        self.recorder.note(EV_SEND, getattr(messages[0], "request_id", None), dst, seq, len(messages))
        self.resend.send(dst, frame, seq, messages, self._now_ns)

    def _resend(self) -> bool:
        moved, verdict = self.resend.resend(self._now_ns)
        if verdict is not None:  # CONTROL_LOST (rule 3)
            self._fail_stop(verdict)
            return True
        return moved

    # ---- writes and tokens -------------------------------------------------------------------------

    def _poll_writes(self) -> bool:
        moved = False
        for handle in self._unreleased[:]:
            try:
                self.transport.release(handle)
                self._unreleased.remove(handle)
            except KvownError:
                self.stats["release_failures"] += 1
        for handle, op_ids in list(self._writes.items()):
            moved |= self._check_write(handle, op_ids)
        return moved

    def _check_write(self, handle: Any, op_ids: list[int]) -> bool:
        """Poll one transfer in flight; turn DONE or a first ERROR into one core event per op it writes."""
        status = self.transport.poll(handle)
        if status is WriteStatus.IN_FLIGHT:
            return False
        if status is WriteStatus.DONE:
            del self._writes[handle]
            try:
                self.transport.release(handle)
            except KvownError:  # NIXL kept the handle: it stays rooted there; try again later
                self.stats["release_failures"] += 1
                self._unreleased.append(handle)
            for op_id in op_ids:
                self._in_doubt.discard(op_id)
                self._events.append((self.sender, WriteCompleted(op_id)))  # type: ignore[arg-type]
            return True
        moved = False
        for op_id in op_ids:  # IN_DOUBT (NIXL's ERROR): keep polling the same handle (rule 4)
            if op_id not in self._in_doubt:
                self._in_doubt.add(op_id)
                self._events.append((self.sender, WriteFailed(op_id, repr(getattr(handle, "error", None)))))  # type: ignore[arg-type]
                moved = True
        return moved

    def _poll_tokens(self) -> bool:
        moved = False
        if self._local_copies:
            for token_id, (request_id, token) in list(self._local_copies.items()):
                if token.query():  # the event recorded after the local copy completed: evidence
                    del self._local_copies[token_id]
                    moved = True
                    self._events.append((self.receiver, LocalCompletionDone(request_id, token_id)))  # type: ignore[arg-type]
        pending = self._pending_tokens
        for _ in range(min(len(pending), TOKEN_POLL_BUDGET)):  # rule 8: round robin, bounded per step
            request_id = next(iter(pending))
            state = pending.pop(request_id)
            if self._sends.get(request_id) is not state:
                continue
            moved |= self._report_ready(request_id, state)
            if any(t is not None for t in state.tokens):
                pending[request_id] = state  # to the back of the line
        return moved

    def _report_ready(self, request_id: int, state: _SendState) -> bool:
        ready = self._ready_now(state)
        for piece in ready:
            self._events.append((self.sender, SourceReady(request_id, piece)))  # type: ignore[arg-type]
        return bool(ready)

    @staticmethod
    def _ready_now(state: _SendState) -> tuple[int, ...]:
        """The pieces whose ready token reports done now; their tokens are dropped (each is told once)."""
        ready = []
        for piece, token in enumerate(state.tokens):
            if token is not None and token.query():
                state.tokens[piece] = None
                ready.append(piece)
        return tuple(ready)

    # ---- actions -------------------------------------------------------------------------------

    def _execute(self, core: RankCore[Any], actions: list[Action]) -> None:
        for action in actions:
            if self.fatal is not None:
                return
            if isinstance(action, SendControl):
                queue = self._outbox.get(action.dst_rank)
                if queue is None:
                    self._outbox[action.dst_rank] = [action.message]
                else:
                    queue.append(action.message)
            elif isinstance(action, PostWrite):
                if self.coalesce_writes and action.result is not None and action.num_slices == 1 \
                        and action.kind is PieceKind.KV:
                    self._coalesced.append(action)  # rule 3a: posted when the pump runs dry
                else:
                    self._post([action])
            elif isinstance(action, Deliver):
                handle = self._recvs.get(action.request_id)
                if handle is not None:
                    handle.landed_ns = self._stamp()
                    handle.landed.set()
            elif isinstance(action, Conclude):
                self._conclude(core, action)
            elif isinstance(action, RetireBlocks):
                self._retire(action.request_id)
            elif isinstance(action, ReleaseSource):
                self._release_source(action.request_id)
            elif isinstance(action, AdmissionRefused):
                self.stats["admission_refused"] += 1
                self._refuse(core, action)
            elif isinstance(action, Disputed):
                self.stats["disputes"] += 1
                self.recorder.record("disputed", action.request_id, reason=action.reason)
            elif isinstance(action, FailStop):
                self._fail_stop(action)
            else:
                raise LocalProtocolError("unknown action", field="action", action=type(action).__name__)

    def _release_source(self, rid: int) -> None:
        state = self._sends.pop(rid, None)
        self._pending_tokens.pop(rid, None)
        self._unpublished.pop(rid, None)
        if state is not None:
            if state.aux_slot >= 0:
                self._aux_free.append(state.aux_slot)
            state.handle.released_ns = self._stamp()
            self._finish(state.handle, state.handle.released)

    def _post_coalesced(self) -> None:
        """Rule 3a: the pump's carried WRITEs, one transfer per peer (``MAX_CARRIED`` reports at most)."""
        held, self._coalesced = self._coalesced, []
        groups: dict[int, list[PostWrite]] = {}
        for action in held:
            group = groups.setdefault(action.receiver_rank, [])
            if len(group) == MAX_CARRIED:
                self._post(group)
                group = groups[action.receiver_rank] = []
            group.append(action)
        for group in groups.values():
            self._post(group)

    def _post(self, actions: list[PostWrite]) -> None:
        """One transport call for a PostWrite or a coalesced group; a submit event per action (rule 2)."""
        first = actions[0]
        state = self._sends.get(first.request_id)
        results = [a.result for a in actions if a.result is not None]
        notif = self.codec.encode_carried(self.rank, first.receiver_rank, results) if results else None
        for a in actions:
            self.recorder.note(EV_POST, a.request_id, a.op_id, a.receiver_rank, notif is not None)
        outcome = self.transport.write(actions, state.aux_slot if state is not None else -1, notif)
        op_ids = [a.op_id for a in actions]
        for a in actions:
            self.recorder.note(EV_POST_RETURNED, a.request_id, a.op_id)  # the copy ran inside (UCX cma)
        if isinstance(outcome, Posted):
            self._writes[outcome.handle] = op_ids
            self.stats["bytes_written"] += outcome.nbytes
            if len(op_ids) > 1:
                self.stats["writes_coalesced"] += len(op_ids)
            for a in actions:
                send = self._sends.get(a.request_id)
                if send is not None and not send.handle.posted_ns:
                    send.handle.posted_ns = self._stamp()
                self._events.append((self.sender, WriteSubmitted(a.op_id)))  # type: ignore[arg-type]
            # Done inside the post (UCX cma): reported in this step, with no library call. An unsettled
            # one waits for the next step's poll (polled at once it never was DONE: 1500 of 1500).
            if outcome.settled:
                self._check_write(outcome.handle, op_ids)
        elif isinstance(outcome, NotPosted):
            for op_id in op_ids:
                self._events.append((self.sender, WriteNotSubmitted(op_id, outcome.reason)))  # type: ignore[arg-type]
        elif isinstance(outcome, InDoubt):
            self._writes[outcome.handle] = op_ids  # rooted and polled until DONE (rule 4)
            self._in_doubt.update(op_ids)
            for op_id in op_ids:
                self._events.append((self.sender, WriteSubmitFailed(op_id, outcome.reason)))  # type: ignore[arg-type]

    def _conclude(self, core: RankCore[Any], action: Conclude) -> None:
        rid = action.request_id
        outcome = _OUTCOME_NAMES[action.outcome]
        self.recorder.note(EV_CONCLUDE, rid, outcome, action.reason)
        if core is self.sender:
            self.stats[f"send_{outcome}"] += 1
            state = self._sends.get(rid)
            handle: SendHandle | ReceiveHandle | None = state.handle if state is not None else None
        else:
            self.stats[f"recv_{outcome}"] += 1
            handle = self._recvs.get(rid)
            if handle is not None and action.outcome is not Outcome.COMPLETED:
                self.pool.hold(handle.blocks)  # OWNED -> HELD: awaiting proof that writers quiesced
        if handle is None or handle.outcome.done():
            return
        handle.outcome.set_result(action.outcome)
        if type(handle) is ReceiveHandle and handle.on_landed is not None and handle.landed.is_set():
            self._callback(handle.on_landed, handle, "on_landed")  # rule 10: landed, outcome committed

    def _retire(self, rid: int) -> None:
        self.router.forget(rid)
        handle = self._recvs.pop(rid, None)
        if handle is None:
            return
        self.pool.retire(handle.blocks, owner=rid)
        if self.probe is not None:  # rule 9
            self.probe("retire", rid)
        if self.canaries is not None:
            self.canaries.fill(handle.blocks)
        if handle.aux_slot >= 0:
            self._aux_free.append(handle.aux_slot)
        handle.retired_ns = self._stamp()  # after the canary fill: the blocks are back from here on
        self.recorder.note(EV_RETIRE, rid, len(handle.blocks))
        self._finish(handle, handle.retired)

    def _refuse(self, core: RankCore[Any], action: AdmissionRefused) -> None:
        error = AdmissionError("session refused", request_id=action.request_id, reason=action.reason)
        if core is self.sender:
            state = self._sends.pop(action.request_id, None)
            self._pending_tokens.pop(action.request_id, None)
            self._unpublished.pop(action.request_id, None)
            if state is not None:
                if state.aux_slot >= 0:
                    self._aux_free.append(state.aux_slot)
                state.handle.outcome.set_exception(error)
                self._finish(state.handle, state.handle.released)
            return
        handle = self._recvs.pop(action.request_id, None)
        if handle is not None:
            self.pool.retire(handle.blocks, owner=action.request_id)  # nothing was ever published
            if handle.aux_slot >= 0:
                self._aux_free.append(handle.aux_slot)
            handle.outcome.set_exception(error)
            self._finish(handle, handle.retired)

    def _verify_canaries(self, blocks: tuple[int, ...], rid: int) -> None:
        broken = self.canaries.check(blocks)  # type: ignore[union-attr]
        if broken:
            self.stats["canary_broken"] += len(broken)
            first = broken[0]
            raise InvariantViolation(
                f"a write landed after retirement: block {first.block} (epoch {first.epoch}) differs from its "
                f"canary at byte {first.offset}", request_id=rid, blocks=[b.block for b in broken[:8]],
            )

    def _fail_stop(self, action: FailStop) -> None:
        if self.fatal is not None:
            return
        self.fatal = action
        self.recorder.record("fail_stop", action.request_id, reason=action.reason.value, detail=action.detail)
        self.on_fail_stop(action)

    # ---- helpers -------------------------------------------------------------------------------

    def _finish(self, handle: SendHandle | ReceiveHandle, done: Any) -> None:
        """The handle's last word: its event, then its ``on_done`` (the embedding server's hand-back)."""
        done.set()
        if handle.on_done is not None:
            self._callback(handle.on_done, handle, "on_done")

    def _callback(self, fn: Callable[[Any], None], handle: SendHandle | ReceiveHandle, name: str) -> None:
        """Rule 10: a caller's callback, on this thread; what it raises is counted and recorded, never ours."""
        try:
            fn(handle)
        except Exception as exc:  # noqa: BLE001 - the caller's bug: kvown's state is already settled
            self.stats["callback_errors"] += 1
            self.recorder.record("callback_error", handle.request_id, callback=name, error=repr(exc))

    def _take_aux(self) -> int:
        return self._aux_free.pop() if self._aux_free else -1

    def _aux_view(self, slot: int) -> torch.Tensor:
        n = self.config.aux_slot_nbytes
        return self.aux[slot * n : (slot + 1) * n]

    def read_aux(self, handle: ReceiveHandle) -> bytes:
        """The aux payload of a landed request. Called: by the consumer after ``landed`` (any thread)."""
        return bytes(self._aux_view(handle.aux_slot).numpy())


def _invariant_fail_stop(exc: InvariantViolation) -> FailStop:
    """The INVARIANT fail-stop for ``exc``, with the traceback of the exception being handled."""
    return FailStop(FatalReason.INVARIANT, getattr(exc, "request_id", None), f"{exc}\n{traceback.format_exc()}")


__all__ = ["Driver"]
