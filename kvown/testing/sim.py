"""A seeded, single-threaded simulated world for the protocol core (FoundationDB-style).

Owns: a set of ``SenderCore`` and ``ReceiverCore`` ranks, the simulated integer-ns clock, an in-memory
control bus, a fake RDMA fabric, a simple block pool per receiver, and a workload of requests. Nothing
here touches the real clock, threads or sockets; one ``random.Random(seed)`` makes every decision, so
a seed is a test case and replays exactly.

Rules:
  1. The real protocol code runs: every control frame goes through ``OutboundStreams.stamp``, the real
     codec (``kvown.adapters.codec.encode``/``decode`` with HMAC) and ``InboundStreams.deliver``.
  2. The bus delays (and so reorders), duplicates, corrupts (an extra, bit-flipped copy) and, in some
     seeds, drops frames. A dropped frame leaves a permanent gap in its stream: everything after it is
     held, so the sessions it serves must end in a fail-stop, never in a retirement.
  3. The fabric turns ``PostWrite`` into a write that later completes (DONE), is refused
     (NOT_SUBMITTED), raises while posting (in doubt) or fails (in doubt); an in-doubt write either
     lands later (late DONE on the same op) or never does, and then may touch memory forever. A write
     of a dead rank never reports again and may touch memory forever.
  4. The clock jumps to the next queued event or the earliest ``next_deadline_ns()`` of a live rank,
     whichever is first (deadlines first on a tie), and never goes backwards.
  5. An exception from a core on an honest input is a finding (``InvariantViolation``); only frames
     the simulator forged on purpose (impostor acks, corrupted copies) may be rejected.

Invariants checked after every step (``InvariantViolation`` carries the seed and the decision log):
  (a) no RetireBlocks while a published writer may still write: no fabric write that may touch the
      destination, no REQUEST_DATA to a live writer still on the bus or held in its stream, and no
      sender core that ``may_write(rid, receiver)``;
  (b) a rank handed a time past min(first drain trigger, exposure + timeout) + grace has fail-stopped
      or no longer has claims for that session; the drain start never moves (INV-D2); at the end every
      session of a live, non-fatal rank is gone (retired / released);
  (c) no evidence counted twice: each (src, dst, seq) frame and each (writer, request, piece, status)
      result reaches a core at most once;
  (d) fences never reopen, and a session opened for a fenced id is born cancelled;
  (e) pool accounting ``total == free + owned + held``; a write that lands on a block not owned by its
      request is reported as corruption;
  (f) a write is posted only after its source piece's write-ready event (INV-S1).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import heapq
import random
from dataclasses import dataclass, field
from typing import Any, Callable

from kvown.adapters import codec
from kvown.core.actions import (
    Action,
    AdmissionRefused,
    Conclude,
    Deliver,
    FailStop,
    Outcome,
    PieceKind,
    PostWrite,
    ReleaseSource,
    RetireBlocks,
    SendControl,
)
from kvown.core.errors import InvariantViolation, KvownError, PeerProtocolError
from kvown.core.events import (
    CancelRequested,
    Event,
    MessageReceived,
    OpenReceive,
    OpenSend,
    PublicationSent,
    ReleaseRequested,
    SourceReady,
    Tick,
    WriteCompleted,
    WriteFailed,
    WriteNotSubmitted,
    WriteSubmitFailed,
    WriteSubmitted,
)
from kvown.core.fence import CancelOrigin
from kvown.core.ids import make_request_id
from kvown.core.machine import CoreConfig
from kvown.core.messages import CancelSession, KvResult, AuxResult, RequestData, SessionQuiesced
from kvown.core.receiver import ReceiverCore
from kvown.core.sender import SenderCore
from kvown.core.streams import InboundStreams, OutboundStreams

JOB_KEY = b"kvown-sim-job-key-0123456789abcdef"
LOG_LINES = 40


@dataclass(frozen=True)
class SimConfig:
    """One world's shape and fault rates. ``for_seed`` draws a profile so seeds explore differently."""

    num_senders: int = 6
    num_receivers: int = 2
    num_requests: int = 12
    blocks_per_receiver: int = 40
    aux_slots: int = 3
    timeout_ns: int = 600
    grace_ns: int = 400
    max_delay_ns: int = 20
    arrival_ns: int = 60  # mean gap between request arrivals
    p_slow: float = 0.02  # a frame or completion takes 10x longer
    p_dup: float = 0.05
    p_drop: float = 0.0
    p_corrupt: float = 0.02
    p_cancel: float = 0.35  # per request: one client cancel at a random time on a random side
    p_not_submitted: float = 0.03
    p_submit_raise: float = 0.015
    p_write_failed: float = 0.02
    p_late_done: float = 0.6
    p_pub_fail: float = 0.03
    p_cancel_publishing: float = 0.05  # cancel between OpenReceive and PublicationSent
    p_reopen: float = 0.25  # a cancelled id is opened again at a rank (must be born cancelled)
    p_impostor: float = 0.0  # per CANCEL_SESSION: another rank forges the writer's ack
    p_late_tick: float = 0.2  # the driver handles a queued event before an overdue deadline tick
    p_slow_consumer: float = 0.1  # the consumer holds delivered blocks for up to 2 timeouts
    deaths: int = 0
    max_steps: int = 40000

    @classmethod
    def for_seed(cls, seed: int) -> SimConfig:
        r = random.Random(seed * 7919 + 17)
        faulty = r.random() < 0.35
        timeout = r.randrange(150, 1500)
        return cls(
            num_requests=r.randrange(8, 16),
            timeout_ns=timeout,
            grace_ns=r.randrange(60, 1200),
            p_slow=r.choice((0.0, 0.02, 0.06)),
            p_dup=r.choice((0.0, 0.05, 0.15)),
            p_drop=0.004 if r.random() < 0.06 else 0.0,
            p_corrupt=r.choice((0.0, 0.03)),
            p_not_submitted=0.06 if faulty else 0.01,
            p_submit_raise=0.03 if faulty else 0.0,
            p_write_failed=0.04 if faulty else 0.0,
            p_impostor=0.3 if r.random() < 0.15 else 0.0,
            deaths=1 if r.random() < 0.12 else 0,
        )


@dataclass
class _Request:
    rid: int
    receiver: int
    writers: tuple[int, ...]
    num_slices: int
    selected: tuple[int, ...]  # the writers that open a send session (one cohort)
    num_pieces: int
    nblocks: int
    aux: bool
    gen_first: bool


@dataclass
class _WriteOp:
    sender: int
    op_id: int
    rid: int
    receiver: int
    blocks: tuple[int, ...]
    aux_slot: int
    may_touch: bool = True  # until DONE or NOT_SUBMITTED; forever if lost


@dataclass
class _Pool:
    """FREE/OWNED/HELD per block (the sim's own tiny pool; blocks carry their owning request)."""

    total: int
    owner: list[int | None] = field(default_factory=list)
    held: set[int] = field(default_factory=set)
    by_rid: dict[int, tuple[int, ...]] = field(default_factory=dict)
    aux_owner: dict[int, int | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.owner = [None] * self.total

    def counts(self) -> tuple[int, int, int]:
        free = sum(1 for o in self.owner if o is None)
        held = len(self.held)
        return free, self.total - free - held, held


class SimWorld:
    """``SimWorld(seed, config).run()`` -> summary dict of outcome and fault counts."""

    def __init__(self, seed: int, config: SimConfig | None = None) -> None:
        self.seed = seed
        self.config = config or SimConfig.for_seed(seed)
        self.rng = random.Random(seed)
        self.now = 0
        self.log: collections.deque[str] = collections.deque(maxlen=LOG_LINES)
        self.counts: collections.Counter[str] = collections.Counter()
        c = self.config
        self.senders = list(range(c.num_senders))
        self.receivers = list(range(c.num_senders, c.num_senders + c.num_receivers))
        self.cores: dict[int, SenderCore | ReceiverCore] = {}
        for rank in self.senders + self.receivers:
            cfg = CoreConfig(rank=rank, timeout_ns=c.timeout_ns, grace_ns=c.grace_ns)
            self.cores[rank] = SenderCore(cfg) if rank in self.senders else ReceiverCore(cfg)
        self.outbound = {r: OutboundStreams(r) for r in self.cores}
        self.inbound = {r: InboundStreams(r) for r in self.cores}
        self.dead: set[int] = set()
        self.fatal: set[int] = set()
        self.pools = {r: _Pool(c.blocks_per_receiver) for r in self.receivers}
        for pool in self.pools.values():
            pool.aux_owner = {slot: None for slot in range(c.aux_slots)}
        self._queue: list[tuple[int, int, str, int | None, Callable[[], None]]] = []
        self._order = 0
        self.requests: dict[int, _Request] = {}
        self.ops: dict[tuple[int, int], _WriteOp] = {}  # (sender, op_id)
        self.published: dict[tuple[int, int], set[int]] = {}  # (receiver, rid) -> published writers
        self.ready: dict[tuple[int, int], set[int]] = collections.defaultdict(set)  # (sender, rid) -> pieces
        self.exposed: dict[tuple[int, int], int] = {}  # (rank, rid) -> first exposure
        self.trigger: dict[tuple[int, int], int] = {}  # (rank, rid) -> first Conclude time
        self.drain_seen: dict[tuple[int, int, int], int] = {}  # (rank, rid, id(clock)) -> drain start
        self.known: dict[int, set[int]] = collections.defaultdict(set)  # rank -> rids it heard of
        self.fenced: dict[int, set[int]] = collections.defaultdict(set)  # rank -> rids seen fenced
        self.cancelled_at: dict[int, set[int]] = collections.defaultdict(set)  # rank -> rids ended cancelled
        self.in_transit: set[tuple[int, int, int]] = set()  # (writer, rid, receiver): REQUEST_DATA on the bus
        self.frames_seen: set[tuple[int, int, int]] = set()
        self.results_seen: set[tuple[Any, ...]] = set()
        self.forged: set[tuple[int, int, int]] = set()  # (src, dst, seq) of deliberately forged frames
        self.seen_time: dict[int, int] = {}  # rank -> the latest now it was handed
        self._plan()

    # ---- plumbing ---------------------------------------------------------------------------------

    def _at(self, t: int, label: str, rank: int | None, fn: Callable[[], None]) -> None:
        self._order += 1
        heapq.heappush(self._queue, (max(t, self.now), self._order, label, rank, fn))

    def _delay(self, scale: int = 1) -> int:
        d = self.rng.randint(1, self.config.max_delay_ns) * scale
        return d * 10 if self.rng.random() < self.config.p_slow else d

    def _say(self, line: str) -> None:
        self.log.append(f"t={self.now} {line}")

    def violation(self, what: str, **fields: Any) -> InvariantViolation:
        lines = "\n".join(self.log)
        return InvariantViolation(
            f"{what}\n  seed={self.seed} (replay: pytest tests/sim --kvown-seed {self.seed})\n"
            f"  last {len(self.log)} decisions:\n{lines}",
            seed=self.seed, **fields,
        )

    # ---- workload ---------------------------------------------------------------------------------

    def _plan(self) -> None:
        c, r = self.config, self.rng
        t = 0
        for i in range(c.num_requests):
            t += r.randint(1, 2 * c.arrival_ns)
            rid = make_request_id(r.randrange(0, 3), i)
            pattern = r.choice(("single", "fan_in", "broadcast"))
            if pattern == "single":
                slices, groups = 1, 1
            elif pattern == "fan_in":
                slices, groups = r.randint(2, 3), 1
            else:
                slices, groups = r.randint(1, 2), r.randint(2, 3)
            writers = tuple(r.sample(self.senders, slices * groups))
            g = r.randrange(groups)
            pieces = r.randint(1, 3)
            req = _Request(
                rid, r.choice(self.receivers), writers, slices, writers[g * slices : (g + 1) * slices],
                pieces, pieces + r.randint(0, 3), r.random() < 0.5, r.random() < 0.5,
            )
            self.requests[rid] = req
            self.counts[f"pattern_{pattern}"] += 1
            t_recv = t
            t_send = t + r.randint(0, 80) if req.gen_first else max(0, t - r.randint(0, 80))
            self._at(t_recv, "open_receive", req.receiver, lambda q=req: self._open_receive(q, tries=0))
            for w in req.selected:
                self._at(t_send, "open_send", w, lambda q=req, w=w: self._open_send(q, w))
            if r.random() < c.p_cancel:
                side = r.choice((req.receiver, *req.writers))
                when = t + r.randint(0, c.timeout_ns)
                self._at(when, "client_cancel", side, lambda s=side, q=rid: self._cancel(s, q))
        for _ in range(c.deaths):
            victim = r.choice(self.senders + self.receivers)
            self._at(r.randint(0, t + 200), "death", victim, lambda v=victim: self._kill(v))

    def _open_receive(self, req: _Request, tries: int) -> None:
        rank, pool = req.receiver, self.pools[req.receiver]
        free = [b for b, o in enumerate(pool.owner) if o is None]
        if len(free) < req.nblocks:
            if tries < 20:
                self._at(self.now + 50, "open_receive_retry", rank, lambda: self._open_receive(req, tries + 1))
            else:
                self.counts["pool_exhausted"] += 1
                for w in req.selected:
                    self._cancel(w, req.rid)
            return
        blocks = tuple(self.rng.sample(free, req.nblocks))
        aux_slot = -1
        if req.aux:
            slots = [s for s, o in pool.aux_owner.items() if o is None]
            aux_slot = self.rng.choice(slots) if slots else -1
        self._reopen_receive(req, blocks, aux_slot)

    def _reopen_receive(self, req: _Request, blocks: tuple[int, ...], aux_slot: int) -> None:
        rank, pool, rid = req.receiver, self.pools[req.receiver], req.rid
        for b in blocks:
            pool.owner[b] = rid
        pool.by_rid[rid] = blocks
        if aux_slot >= 0:
            pool.aux_owner[aux_slot] = rid
        event = OpenReceive(rid, blocks, req.writers, req.num_slices, aux_slot)
        born_fenced = rid in self.fenced[rank]
        actions = self._handle(rank, event)
        if actions is None:
            return
        self._check_born_cancelled(rank, rid, born_fenced, actions)
        publications = [a for a in actions if isinstance(a, SendControl) and isinstance(a.message, RequestData)]
        if not publications:  # born cancelled or refused: nothing was published
            self._execute(rank, actions)
            return
        failed = frozenset(a.dst_rank for a in publications if self.rng.random() < self.config.p_pub_fail)
        self.published[(rank, rid)] = set(req.writers) - failed
        self.exposed[(rank, rid)] = self.now
        self._execute(rank, [a for a in actions if not (isinstance(a, SendControl) and a.dst_rank in failed)])
        if self.rng.random() < self.config.p_cancel_publishing:
            self.counts["cancel_while_publishing"] += 1
            self._cancel(rank, rid)
        self._at(self.now, "publication_sent", rank, lambda: self._deliver_event(rank, PublicationSent(rid, failed)))

    def _open_send(self, req: _Request, w: int) -> None:
        born_fenced = req.rid in self.fenced[w]
        actions = self._handle(w, OpenSend(req.rid, tuple(range(req.nblocks)), req.num_pieces, 1))
        if actions is None:
            return
        self._check_born_cancelled(w, req.rid, born_fenced, actions)
        self._execute(w, actions)
        for piece in range(req.num_pieces):
            self._at(self.now + self._delay(3), "source_ready", w, lambda p=piece: self._source_ready(w, req.rid, p))

    def _source_ready(self, w: int, rid: int, piece: int) -> None:
        if w in self.dead:
            return
        self.ready[(w, rid)].add(piece)
        self._deliver_event(w, SourceReady(rid, piece))

    def _cancel(self, rank: int, rid: int) -> None:
        if rank in self.dead:
            return
        if any(op.may_touch and op.rid == rid for op in self.ops.values()):
            self.counts["cancel_mid_transfer"] += 1
        self._deliver_event(rank, CancelRequested(rid, CancelOrigin.CLIENT))

    def _kill(self, rank: int) -> None:
        if rank not in self.dead:
            self.dead.add(rank)
            self.counts["deaths"] += 1
            self._say(f"rank {rank} DIES")

    # ---- driving a core -----------------------------------------------------------------------------

    def _deliver_event(self, rank: int, event: Event) -> None:
        actions = self._handle(rank, event)
        if actions is not None:
            self._execute(rank, actions)

    def _handle(self, rank: int, event: Event, *, forged: bool = False) -> list[Action] | None:
        """Feed one event to a live rank's core. Returns None when the rank is dead or rejected it."""
        if rank in self.dead:
            return None
        rid = getattr(event, "request_id", None)
        if rid is not None:
            self.known[rank].add(rid)
        core = self.cores[rank]
        self.seen_time[rank] = self.now
        try:
            actions = core.handle(event, self.now)
        except PeerProtocolError as e:
            if forged:
                self.counts["forged_rejected"] += 1
                self._say(f"rank {rank} rejected forged {_fmt(event)}: {e.message}")
                return None
            raise self.violation(f"core rank {rank} rejected an honest input: {e}", rank=rank) from e
        except InvariantViolation:
            raise
        except KvownError as e:
            raise self.violation(f"core rank {rank} raised on an honest input: {e}", rank=rank) from e
        self._say(f"rank {rank} <- {_fmt(event)} -> {', '.join(_fmt(a) for a in actions) or '-'}")
        return actions

    def _execute(self, rank: int, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, SendControl):
                self._send(rank, action.dst_rank, action.message)
                if isinstance(action.message, CancelSession) and self.rng.random() < self.config.p_impostor:
                    self._forge_ack(rank, action.dst_rank, action.message.request_id)
            elif isinstance(action, PostWrite):
                self._post(rank, action)
            elif isinstance(action, Conclude):
                self._on_conclude(rank, action)
            elif isinstance(action, Deliver):
                self.counts["delivered"] += 1
                slow = self.rng.random() < self.config.p_slow_consumer
                hold = self.rng.randint(1, 2 * self.config.timeout_ns) if slow else self._delay(2)
                self._at(self.now + hold, "consumer_release", rank,
                         lambda r=action.request_id: self._release(rank, r))
            elif isinstance(action, RetireBlocks):
                self._retire(rank, action.request_id)
            elif isinstance(action, ReleaseSource):
                self.counts["released_sources"] += 1
            elif isinstance(action, AdmissionRefused):
                self.counts["admission_refused"] += 1
                self._free_unpublished(rank, action.request_id)
            elif isinstance(action, FailStop):
                self.fatal.add(rank)
                self.counts["fatal"] += 1
                self._say(f"rank {rank} FAIL-STOP: {action.detail[:120]}")

    def _release(self, rank: int, rid: int) -> None:
        core = self.cores[rank]
        if rank not in self.dead and rid in core.sessions and core.sessions[rid].outcome is Outcome.COMPLETED:
            self._deliver_event(rank, ReleaseRequested(rid))

    def _on_conclude(self, rank: int, action: Conclude) -> None:
        rid = action.request_id
        self.counts[f"outcome_{action.outcome.value}"] += 1
        self.trigger.setdefault((rank, rid), self.now)
        if action.outcome is not Outcome.COMPLETED:
            self.cancelled_at[rank].add(rid)
            if rank in self.pools:
                pool = self.pools[rank]
                pool.held.update(b for b in pool.by_rid.get(rid, ()) if pool.owner[b] == rid)
            if self.rng.random() < self.config.p_reopen:
                self._at(self.now + self._delay(20), "reopen", rank, lambda: self._reopen(rank, rid))

    def _reopen(self, rank: int, rid: int) -> None:
        """The embedding server schedules the same (cancelled) id again on this rank: born cancelled."""
        core, req = self.cores[rank], self.requests[rid]
        if rank in self.dead or rid in core.sessions:
            return
        self.counts["reopened"] += 1
        if rank in self.pools:
            free = [b for b, o in enumerate(self.pools[rank].owner) if o is None]
            if len(free) >= req.nblocks and rid not in self.pools[rank].by_rid:
                self._reopen_receive(req, tuple(free[: req.nblocks]), -1)
        else:
            self._open_send(req, rank)

    def _free_unpublished(self, rank: int, rid: int) -> None:
        """AdmissionRefused: nothing was created or published for this open; its blocks go back."""
        pool = self.pools.get(rank)
        if pool is not None and rid not in self.cores[rank].sessions:
            self._free(pool, rid)

    def _free(self, pool: _Pool, rid: int) -> None:
        for b in pool.by_rid.pop(rid, ()):
            if pool.owner[b] == rid:
                pool.owner[b] = None
                pool.held.discard(b)
        for slot, owner in pool.aux_owner.items():
            if owner == rid:
                pool.aux_owner[slot] = None

    # ---- invariant (a): retirement ------------------------------------------------------------------

    def _retire(self, rank: int, rid: int) -> None:
        for op in self.ops.values():
            if op.receiver == rank and op.rid == rid and op.may_touch:
                raise self.violation(
                    f"(a) RetireBlocks({rid}) on rank {rank} while writer {op.sender}'s op {op.op_id} may still "
                    "touch the destination", rid=rid, rank=rank,
                )
        for w in self.published.get((rank, rid), ()):
            core = self.cores[w]
            assert isinstance(core, SenderCore)
            if (w, rid, rank) in self.in_transit and w not in self.dead:
                raise self.violation(
                    f"(a) RetireBlocks({rid}) on rank {rank} while its REQUEST_DATA to writer {w} is still in transit",
                    rid=rid, rank=rank,
                )
            if core.may_write(rid, rank):
                raise self.violation(
                    f"(a) RetireBlocks({rid}) on rank {rank} while published writer {w} may still write",
                    rid=rid, rank=rank,
                )
        self.counts["retired"] += 1
        self._free(self.pools[rank], rid)

    # ---- control bus --------------------------------------------------------------------------------

    def _send(self, src: int, dst: int, message: Any, *, forged: bool = False) -> None:
        if src in self.dead:
            return
        envelope = self.outbound[src].stamp(dst, message)
        frame = codec.encode(envelope, JOB_KEY)
        if forged:
            self.forged.add((src, dst, envelope.seq))
        c = self.config
        if self.rng.random() < c.p_drop:
            self.counts["drops"] += 1
            self._say(f"bus DROPS {src}->{dst} seq {envelope.seq} {_fmt(message)}")
            return
        if isinstance(message, RequestData):
            self.in_transit.add((dst, message.request_id, src))
        self._at(self.now + self._delay(), "frame", dst, lambda: self._receive(dst, frame))
        if self.rng.random() < c.p_dup:
            self._at(self.now + self._delay(4), "frame_dup", dst, lambda: self._receive(dst, frame))
        if self.rng.random() < c.p_corrupt:
            i = self.rng.randrange(len(frame))
            bad = frame[:i] + bytes([frame[i] ^ (1 << self.rng.randrange(8))]) + frame[i + 1 :]
            self._at(self.now + self._delay(), "frame_corrupt", dst, lambda: self._receive(dst, bad))

    def _forge_ack(self, receiver: int, writer: int, rid: int) -> None:
        outsiders = [r for r in self.senders if r not in self.requests[rid].writers and r not in self.dead]
        if outsiders:
            impostor = self.rng.choice(outsiders)
            self.counts["forged_sent"] += 1
            self._send(impostor, receiver, SessionQuiesced(writer, rid), forged=True)

    def _receive(self, dst: int, frame: bytes) -> None:
        if dst in self.dead:
            return
        try:
            envelope = codec.decode(frame, JOB_KEY)
        except PeerProtocolError:
            self.counts["corrupt_rejected"] += 1
            return
        inbound = self.inbound[dst]
        before = inbound.duplicates
        ready = inbound.deliver(envelope)
        if inbound.duplicates > before:
            self.counts["duplicates_dropped"] += 1
        elif not ready:
            self.counts["reordered"] += 1
        for env in ready:
            key = (env.src_rank, env.dst_rank, env.seq)
            if key in self.frames_seen:
                raise self.violation(f"(c) frame {key} delivered twice by the streams", frame=key)
            self.frames_seen.add(key)
            m = env.message
            if isinstance(m, RequestData):
                self.in_transit.discard((dst, m.request_id, env.src_rank))
            if isinstance(m, (KvResult, AuxResult)):
                rkey = (dst, m.writer_rank, m.request_id, type(m).__name__, m.piece, m.status)
                if rkey in self.results_seen:
                    raise self.violation(f"(c) result {rkey} reached the ledger twice", result=rkey)
                self.results_seen.add(rkey)
            actions = self._handle(dst, MessageReceived(env), forged=key in self.forged)
            if actions is not None:
                self._execute(dst, actions)

    # ---- fabric -------------------------------------------------------------------------------------

    def _post(self, rank: int, action: PostWrite) -> None:
        rid, piece = action.request_id, action.piece
        ready = self.ready[(rank, rid)]
        req = self.requests[rid]
        if (action.kind is PieceKind.AUX and len(ready) < req.num_pieces) or (
            action.kind is PieceKind.KV and piece not in ready
        ):
            raise self.violation(f"(f) PostWrite op {action.op_id} for piece {piece} before its source was ready")
        self.exposed.setdefault((rank, rid), self.now)
        op = _WriteOp(rank, action.op_id, rid, action.receiver_rank, action.dst_blocks, action.aux_slot)
        self.ops[(rank, action.op_id)] = op
        c, r = self.config, self.rng
        x = r.random()
        t1 = self.now + self._delay()
        t2 = t1 + self._delay(2)
        t3 = t2 + self._delay(8)
        if x < c.p_not_submitted:
            self._fab(t1, op, WriteNotSubmitted(op.op_id, "sim: refused"), settles=True)
        elif x < c.p_not_submitted + c.p_submit_raise:
            self.counts["in_doubt_writes"] += 1
            self._fab(t1, op, WriteSubmitFailed(op.op_id, "sim: post raised"), settles=False)
            if r.random() < c.p_late_done:
                self._fab(t3, op, WriteCompleted(op.op_id), settles=True, late=True)
        elif x < c.p_not_submitted + c.p_submit_raise + c.p_write_failed:
            self.counts["in_doubt_writes"] += 1
            self._fab(t1, op, WriteSubmitted(op.op_id), settles=False)
            self._fab(t2, op, WriteFailed(op.op_id, "sim: status error"), settles=False)
            if r.random() < c.p_late_done:
                self._fab(t3, op, WriteCompleted(op.op_id), settles=True, late=True)
        else:
            self._fab(t1, op, WriteSubmitted(op.op_id), settles=False)
            self._fab(t2, op, WriteCompleted(op.op_id), settles=True)

    def _fab(self, t: int, op: _WriteOp, event: Event, *, settles: bool, late: bool = False) -> None:
        def fire() -> None:
            if op.sender in self.dead:
                return  # a dead rank's write never reports; it may touch memory forever
            if isinstance(event, WriteCompleted):
                self._land(op)
                if late:
                    self.counts["late_settlements"] += 1
            if settles:
                op.may_touch = False
            self._deliver_event(op.sender, event)

        self._at(t, "fabric", op.sender, fire)

    def _land(self, op: _WriteOp) -> None:
        """(e) the bytes land: every target must still belong to the writing request."""
        pool = self.pools[op.receiver]
        for b in op.blocks:
            if pool.owner[b] != op.rid:
                raise self.violation(
                    f"(e) CORRUPTION: op {op.op_id} of request {op.rid} landed on block {b} owned by {pool.owner[b]}",
                    rid=op.rid,
                )
        if op.aux_slot >= 0 and pool.aux_owner.get(op.aux_slot) != op.rid:
            raise self.violation(f"(e) CORRUPTION: aux write of request {op.rid} landed on a reused aux slot")

    # ---- the step loop ------------------------------------------------------------------------------

    def _next_deadline(self) -> tuple[int, int] | None:
        best = None
        for rank, core in self.cores.items():
            if rank in self.dead:
                continue
            d = core.next_deadline_ns()
            if d is not None and (best is None or d < best[0]):
                best = (d, rank)
        return best

    def step(self) -> bool:
        """Run one event or one deadline tick; check the invariants. False when nothing is left."""
        deadline = self._next_deadline()
        head = self._queue[0][0] if self._queue else None
        if deadline is None and head is None:
            return False
        late = head is not None and self.rng.random() < self.config.p_late_tick  # time applied by handle()
        if deadline is not None and (head is None or deadline[0] <= head) and not late:
            self.now = max(self.now, deadline[0])
            rank = deadline[1]
            self._deliver_event(rank, Tick())
            self.counts["ticks"] += 1
        else:
            t, _, label, rank, fn = heapq.heappop(self._queue)
            self.now = t
            if rank is not None and rank in self.dead and label != "death":
                pass
            else:
                fn()
        self.check(rank)
        return True

    def run(self, steps: int | None = None) -> dict[str, int]:
        """Run to the end (or ``steps`` steps), then the end-of-run checks. Returns the counts."""
        limit = steps if steps is not None else self.config.max_steps
        n = 0
        for phase in range(3):
            while n < limit and self.step():
                n += 1
            if n >= limit or not self._end_phase_cancels():
                break
        self.counts["steps"] = n
        if steps is None:
            if n >= limit:
                raise self.violation("the world did not settle within max_steps")
            self.check_end()
        return dict(self.counts)

    def _end_phase_cancels(self) -> bool:
        """Send sessions that never got their publication (the receiver refused, died or failed to
        publish) have no clock; the embedding server gives up on them. Returns True if any was cancelled."""
        any_ = False
        for rank in self.senders:
            core = self.cores[rank]
            if rank in self.dead or rank in self.fatal:
                continue
            for rid, s in list(core.sessions.items()):
                if len(s.streams) < s.num_receivers and (rank, rid) not in self.exposed:
                    self.counts["end_phase_cancels"] += 1
                    self._at(self.now + 1, "server_gives_up", rank, lambda r=rank, q=rid: self._cancel(r, q))
                    any_ = True
        return any_

    # ---- invariant checks ---------------------------------------------------------------------------

    def check(self, rank: int | None) -> None:
        """After every step: (b) deadlines, (d) fences, (e) pool accounting."""
        for r, core in self.cores.items():
            if r in self.dead or r in self.fatal:
                continue
            for rid, s in core.sessions.items():
                key = (r, rid, id(s.clock))
                started = s.clock.drain_started_ns
                if started is not None:
                    first = self.drain_seen.setdefault(key, started)
                    if first != started:
                        raise self.violation(f"(b) drain of {rid} on rank {r} moved from {first} to {started} (INV-D2)")
                open_claims = s.has_claims() if isinstance(core, ReceiverCore) else bool(s.live_ops())
                exposed = self.exposed.get((r, rid))
                if not open_claims or exposed is None:
                    continue
                trigger = min(self.trigger.get((r, rid), exposed + core.config.timeout_ns), exposed + core.config.timeout_ns)
                bound = trigger + core.config.grace_ns
                if self.seen_time.get(r, -1) > bound:  # it saw a time past the bound and did not stop
                    raise self.violation(
                        f"(b) session {rid} on rank {r} still has claims at t={self.now} > bound {bound} "
                        "without a FailStop", rid=rid, rank=r,
                    )
        if rank is None or rank in self.dead:
            return
        core = self.cores[rank]
        for rid in self.known[rank]:
            if core.fence.is_fenced(rid):
                self.fenced[rank].add(rid)
            elif rid in self.fenced[rank] and core.fence.admissible(rid):
                raise self.violation(f"(d) fence for {rid} on rank {rank} reopened", rid=rid, rank=rank)
        if rank in self.pools:
            pool = self.pools[rank]
            free, owned, held = pool.counts()
            if free + owned + held != pool.total or owned < 0:
                raise self.violation(f"(e) pool accounting broken on rank {rank}: {free}+{owned}+{held}")

    def _check_born_cancelled(self, rank: int, rid: int, was_fenced: bool, actions: list[Action]) -> None:
        if not was_fenced:
            return
        ok = any(isinstance(a, AdmissionRefused) or (isinstance(a, Conclude) and a.outcome is Outcome.CANCELLED)
                 for a in actions)
        if not ok:
            raise self.violation(f"(d) a session for fenced id {rid} on rank {rank} was not born cancelled")
        self.counts["born_cancelled"] += 1

    def check_end(self) -> None:
        """(b) at the end: every session of a live, non-fatal rank ended; (e) pools drained."""
        for r, core in self.cores.items():
            if r in self.dead or r in self.fatal:
                continue
            if core.sessions:
                rid, s = next(iter(core.sessions.items()))
                raise self.violation(
                    f"(b) rank {r} ended with {len(core.sessions)} live session(s), e.g. {rid}: {_session_summary(s)}",
                    rank=r,
                )
            if r in self.pools:
                free, owned, held = self.pools[r].counts()
                if free != self.pools[r].total:
                    raise self.violation(f"(e) rank {r} ended with blocks not free: owned={owned} held={held}")


def _session_summary(s: Any) -> str:
    state = getattr(s, "state", None)
    return f"state={getattr(state, 'value', state)} outcome={s.outcome} reason={s.reason!r}"


def _fmt(obj: Any) -> str:
    if isinstance(obj, MessageReceived):
        e = obj.envelope
        return f"{e.src_rank}->{e.dst_rank}#{e.seq} {_fmt(e.message)}"
    if isinstance(obj, SendControl):
        return f"send {obj.dst_rank} {_fmt(obj.message)}"
    name = type(obj).__name__
    if isinstance(obj, PostWrite):
        return f"PostWrite(op {obj.op_id} rid {obj.request_id} -> {obj.receiver_rank} {obj.kind.value}{obj.piece})"
    if isinstance(obj, FailStop):
        return f"FailStop({obj.request_id})"
    if not dataclasses.is_dataclass(obj):
        return name
    body = ", ".join(_short(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.name not in ("dst_blocks", "src_blocks"))
    return f"{name}({body})"[:110]


def _short(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return value.name
    return repr(value)


def run_seed(seed: int, config: SimConfig | None = None) -> dict[str, int]:
    """Convenience for embedding projects and tests: one seeded run to the end."""
    return SimWorld(seed, config).run()
