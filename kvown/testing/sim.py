"""A seeded, single-threaded simulated world that runs the real drivers (FoundationDB-style).

Owns: one ``Driver`` per rank with everything it runs on in production - the real embedding API
facades (``kvown.api``), commands, cores, streams, codec, ``KVTransport`` and ``NixlEndpoint`` code,
``KVPool`` with real bytes and retirement canaries - over the fake NIXL *library*
(``kvown.testing.fake_nixl``) and a fault-injecting transport wrapper (``kvown.testing.faults``).
Plus the simulated integer-ns clock, the embedding servers' behaviour (the workload) and the oracles.
Nothing here reads the real clock, sleeps or starts a thread; one ``random.Random(seed)`` makes
every decision, so a seed is a test case and replays exactly.

Rules:
  1. The code under test is the production code: the simulator only submits API calls, advances the
     clock, signals ready tokens, kills ranks and calls ``driver.step(now)``.
  2. Faults come from the wrapper (frames dropped, duplicated, corrupted, delayed and so reordered;
     sends that raise before or after sending; receives and releases that raise; WRITEs refused,
     in doubt, failing then finishing or never, slow or stuck) and from the fake library (bytes that
     land inside the post or at completion). Ranks die. Clients cancel on either side at any time,
     consumers are slow, local copies are queued after delivery, cancelled ids are opened again, and
     insiders forge acks for other writers.
  3. The clock jumps to the earliest of: the next workload event, a rank's core deadline, a rank's
     held frame, WRITE or nap becoming due. Ranks with work are stepped until quiet at each instant; a
     napping rank's frames wait until the nap ends or a command wakes it, then go first (as the engine's).
  4. The oracles (``kvown.testing.oracles``, one class each) run after every rank step and at the end;
     a violation raises ``InvariantViolation`` with its ``tag``, ``oracle``, the seed and the decision log.
"""

from __future__ import annotations

import collections
import heapq
import random
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kvown.adapters import codec
from kvown.adapters.transport import Role
from kvown.api import Receiver, Sender
from kvown.cache.layout import KVLayout
from kvown.cache.pool import KVPool
from kvown.core.actions import FailStop, Outcome
from kvown.core.errors import InvariantViolation, KvownError
from kvown.core.ids import make_request_id
from kvown.core.messages import SessionQuiesced
from kvown.runtime.commands import ReceiveHandle, SendHandle, Ticket
from kvown.runtime.config import TransferConfig
from kvown.runtime.flight import FlightRecorder
from kvown.runtime.stack import assemble, build_parts
from kvown.testing.fake_nixl import FakeFabric, FakeNixlEndpoint
from kvown.testing import oracles
from kvown.testing.faults import FaultProfile, FaultyTransport

JOB_KEY = b"kvown-sim-job-key-0123456789abcdef"
LOG_LINES = 40
NS = 1e-9  # TransferConfig speaks seconds; the simulated clock counts integer ns
SETTLE_ROUNDS = 10_000  # per instant: far above what a world of a dozen ranks needs


@dataclass(frozen=True)
class SimConfig:
    """One world's shape and fault rates. ``for_seed`` draws a profile so seeds explore differently."""

    num_senders: int = 6
    num_receivers: int = 2
    num_requests: int = 12
    num_blocks: int = 40
    aux_slots: int = 3
    timeout_ns: int = 600
    grace_ns: int = 400
    control_retry_ns: int = 150
    frame_delay_ns: tuple[int, int] = (1, 20)
    write_ns: tuple[int, int] = (1, 40)
    arrival_ns: int = 60  # mean gap between request arrivals
    p_slow: float = 0.02
    p_dup: float = 0.05
    p_drop: float = 0.0
    p_corrupt: float = 0.02
    p_send_raise: float = 0.01
    p_send_raise_after: float = 0.01
    p_receive_raise: float = 0.002
    p_release_raise: float = 0.01
    p_cancel: float = 0.35  # per request: one client cancel at a random time on a random side
    p_not_posted: float = 0.03
    p_post_raises: float = 0.015
    p_write_error: float = 0.02
    p_late_done: float = 0.6
    p_stall: float = 0.0
    p_land_at_post: float = 0.5
    p_reopen: float = 0.25  # a cancelled id is opened again at a rank (must be born cancelled)
    p_impostor: float = 0.0  # per request: an outsider forges a writer's ack
    p_slow_consumer: float = 0.1  # the consumer holds delivered blocks for up to 2 timeouts
    p_local_copy: float = 0.2  # the consumer queues a local copy into delivered blocks
    p_nap: float = 0.0  # a rank whose frames arrive naps through them, for 1..nap_ns
    p_burst: float = 0.0  # a request arrives with the one before, same pair, one piece (coalesced WRITEs)
    nap_ns: int = 40
    deaths: int = 0
    max_steps: int = 40000

    @classmethod
    def for_seed(cls, seed: int) -> SimConfig:
        r = random.Random(seed * 7919 + 17)
        faulty = r.random() < 0.35
        return cls(
            num_requests=r.randrange(8, 16),
            timeout_ns=r.randrange(200, 1500),
            grace_ns=r.randrange(80, 1200),
            p_slow=r.choice((0.0, 0.02, 0.06)),
            p_dup=r.choice((0.0, 0.05, 0.15)),
            p_drop=0.004 if r.random() < 0.06 else 0.0,
            p_corrupt=r.choice((0.0, 0.03)),
            p_send_raise=r.choice((0.0, 0.01, 0.05)),
            p_send_raise_after=r.choice((0.0, 0.01, 0.05)),
            p_not_posted=0.06 if faulty else 0.01,
            p_post_raises=0.03 if faulty else 0.0,
            p_write_error=0.04 if faulty else 0.0,
            p_stall=0.01 if faulty and r.random() < 0.3 else 0.0,
            p_impostor=0.3 if r.random() < 0.15 else 0.0,
            deaths=1 if r.random() < 0.12 else 0,
            p_nap=0.2 if r.random() < 0.5 else 0.0,  # drawn after the others: they keep their seeds' values
            p_burst=0.5 if r.random() < 0.3 else 0.0,  # last, for the same reason
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


class _Rank:
    """One simulated rank: the production stack over the fake library."""

    def __init__(self, world: SimWorld, rank: int, role: Role, layout: KVLayout) -> None:
        c = world.config
        self.rank = rank
        self.role = role
        config = TransferConfig(
            transfer_timeout_s=c.timeout_ns * NS, grace_s=c.grace_ns * NS, control_retry_s=c.control_retry_ns * NS,
            aux_slots=c.aux_slots, aux_slot_nbytes=8, canary=True, metrics_port=0,
        )
        self.agent = f"sim-r{rank}"  # its name on the fake fabric
        self.endpoint = FakeNixlEndpoint(self.agent, fabric=world.fabric)
        parts = build_parts(rank, frozenset({role}), self.endpoint, KVPool(layout), config=config,
                            geometry_digest=layout.geometry_digest())
        self.pool, self.aux, self.transport = parts.pool, parts.aux, parts.transport
        profile = FaultProfile(
            p_send_raise=c.p_send_raise, p_send_raise_after=c.p_send_raise_after, p_drop=c.p_drop, p_dup=c.p_dup,
            p_corrupt=c.p_corrupt, frame_delay_ns=c.frame_delay_ns, p_slow=c.p_slow, write_ns=c.write_ns,
            p_not_posted=c.p_not_posted, p_post_raises=c.p_post_raises, p_write_error=c.p_write_error,
            p_late_done=c.p_late_done, p_stall=c.p_stall, p_receive_raise=c.p_receive_raise,
            p_release_raise=c.p_release_raise,
        )
        rng = random.Random(world.seed * 1_000_003 + rank)
        self.recorder = FlightRecorder(rank, capacity=1 << 16, clock_ns=world.clock)
        self.fatal: FailStop | None = None
        stack = assemble(parts, peers=(), key=JOB_KEY, recorder=self.recorder, on_fail_stop=self._on_fail_stop,
                         clock=world.clock,
                         wrap_transport=lambda t, r: FaultyTransport(t, r, world.clock, profile=profile, rng=rng))
        self.faulty: FaultyTransport = stack.transport
        self.driver, self.engine = stack.driver, stack.engine  # the engine is never started
        self.api: Sender | Receiver | None = None
        self.bytes = self.pool.tensor.numpy()  # the pool's bytes, for the producer and the verifier
        self.wake: int | None = None  # cached: changes only when this rank is stepped, or starts a nap
        self.nap_until: int | None = None  # napping: frames wait until then or until a command
        self.tickets: dict[int, tuple[Ticket, int]] = {}  # rid -> (ticket, tries)
        self.recvs: dict[int, ReceiveHandle] = {}
        self.sends: dict[int, SendHandle] = {}
        self.fence_tables = oracles.fence_tables(self.driver)

    def _on_fail_stop(self, action: FailStop) -> None:
        self.fatal = self.fatal or action


class SimWorld:
    """``SimWorld(seed, config).run()`` -> summary dict of outcome and fault counts."""

    def __init__(self, seed: int, config: SimConfig | None = None) -> None:
        self.seed = seed
        self.config = c = config or SimConfig.for_seed(seed)
        self.rng = random.Random(seed)
        self.now = 0
        self.log: collections.deque[str] = collections.deque(maxlen=LOG_LINES)
        self.counts: collections.Counter[str] = collections.Counter()
        self.fabric = FakeFabric(rng=random.Random(seed + 1), p_land_at_post=c.p_land_at_post)
        self.layout = KVLayout.standard(num_layers=1, num_blocks=c.num_blocks, tokens_per_block=1, num_kv_heads=6,
                                        head_dim=2, dtype="uint8")
        self.senders = list(range(c.num_senders))
        self.receivers = list(range(c.num_senders, c.num_senders + c.num_receivers))
        self.ranks = {r: _Rank(self, r, Role.SENDER if r in self.senders else Role.RECEIVER, self.layout)
                      for r in self.senders + self.receivers}
        for rank in self.ranks.values():
            peers = {r: other.transport.info for r, other in self.ranks.items() if r != rank.rank}
            rank.transport.connect(peers)
            rank.driver.refresh_view()
            rank.api = (Sender if rank.role is Role.SENDER else Receiver)(rank.engine)
        self.dead: set[int] = set()
        self._queue: list[tuple[int, int, str, int | None, Callable[[], None]]] = []
        self._order = 0
        self.requests: dict[int, _Request] = {}
        self.src_free = {w: list(range(c.num_blocks)) for w in self.senders}
        self.src_blocks: dict[tuple[int, int], tuple[int, ...]] = {}  # (writer, rid) -> its source blocks
        self.facts = f = oracles.Facts()  # what the embedding servers did: the workload writes, oracles read
        self.opened, self.concluded, self.local_copies = f.opened, f.concluded, f.local_copies
        self.ready, self.src_owner, self._born_fenced = f.ready, f.src_owner, f.born_fenced
        self.verified: set[tuple[int, int]] = set()
        self.client_cancelled: set[tuple[int, int]] = set()  # (rank, rid) the embedding server cancelled
        self._plan()
        self._oracles()

    def _oracles(self) -> None:
        """One checker per invariant (``kvown.testing.oracles``); each reports to ``_raise``."""
        report, bs = self._raise, self.layout.block_nbytes
        self.no_invariant_fail_stop = oracles.NoInvariantFailStop(report)
        self.watchdog_agrees = oracles.WatchdogAgrees(report)
        self.evidence_once = oracles.EvidenceOnce(report)
        self.session_bounds = oracles.SessionBounds(report, self.facts)
        self.fences = oracles.FencesNeverReopen(report, self.requests)
        self.pool_accounting = oracles.PoolAccounting(report)
        self.writes_after_ready = oracles.WritesAfterReady(report, self.fabric, self.facts, bs)
        self.no_stream_holes = oracles.NoStreamHoles(report, self.config.control_retry_ns)
        self.retirement_proof = oracles.RetirementProof(report, self.fabric, JOB_KEY, bs)
        self.landed_bytes = oracles.LandedBytes(report, bs, _pattern)
        self.end_state = oracles.EndState(report)
        self._pools = {r: rank.pool for r, rank in self.ranks.items()}

    # ---- plumbing ---------------------------------------------------------------------------------

    def clock(self) -> int:
        return self.now

    def _at(self, t: int, label: str, rank: int | None, fn: Callable[[], None]) -> None:
        self._order += 1
        heapq.heappush(self._queue, (max(t, self.now), self._order, label, rank, fn))

    def _say(self, line: str) -> None:
        self.log.append(f"t={self.now} {line}")

    def violation(self, tag: str, what: str, **fields: Any) -> InvariantViolation:
        lines = "\n".join(self.log)
        return InvariantViolation(
            f"({tag}) {what}\n  seed={self.seed} (replay: pytest tests/sim --kvown-seed {self.seed})\n"
            f"  last {len(self.log)} decisions:\n{lines}",
            seed=self.seed, tag=tag, **fields,
        )

    def _raise(self, v: oracles.Violation) -> None:
        raise self.violation(v.tag, v.what, oracle=v.oracle, **v.fields)

    def _live(self, rank: int) -> bool:
        return rank not in self.dead and self.ranks[rank].fatal is None

    # ---- workload (the embedding servers) ----------------------------------------------------------

    def _plan(self) -> None:
        c, r = self.config, self.rng
        t, t_send, prev = 0, 0, None
        for i in range(c.num_requests):
            if prev is not None and c.p_burst and r.random() < c.p_burst:  # no draw when off: seeds keep paths
                req = prev = self._burst(prev, make_request_id(r.randrange(0, 3), i))
                self._schedule(req, t, t_send, "burst")
                continue
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
            req = prev = _Request(rid, r.choice(self.receivers), writers, slices,
                                  writers[g * slices : (g + 1) * slices], pieces, pieces + r.randint(0, 3),
                                  r.random() < 0.5, r.random() < 0.5)
            t_send = t + r.randint(0, 80) if req.gen_first else max(0, t - r.randint(0, 80))
            self._schedule(req, t, t_send, pattern)
        for _ in range(c.deaths):
            victim = r.choice(self.senders + self.receivers)
            self._at(r.randint(0, t + 200), "death", victim, lambda v=victim: self._kill(v))

    def _burst(self, lead: _Request, rid: int) -> _Request:
        """A request arriving with ``lead``: the same receiver and writers, one piece and no aux payload,
        so its WRITE may go in one transfer with its neighbours' (driver rule 3a)."""
        nblocks = self.rng.randint(1, 4)
        return _Request(rid, lead.receiver, lead.writers, lead.num_slices, lead.selected, 1, nblocks, False,
                        lead.gen_first)

    def _schedule(self, req: _Request, t: int, t_send: int, pattern: str) -> None:
        c, r = self.config, self.rng
        self.requests[req.rid] = req
        self.counts[f"pattern_{pattern}"] += 1
        self._at(t, "open_receive", req.receiver, lambda q=req: self._open_receive(q))
        for w in req.selected:
            self._at(t_send, "open_send", w, lambda q=req, w=w: self._open_send(q, w))
        if r.random() < c.p_cancel:
            side = r.choice((req.receiver, *req.writers))
            self._at(t + r.randint(0, c.timeout_ns), "client_cancel", side, lambda s=side, q=req.rid: self._cancel(s, q))
        if r.random() < c.p_impostor:
            self._at(t + r.randint(0, c.timeout_ns), "forge_ack", None, lambda q=req: self._forge_ack(q))

    def _open_receive(self, req: _Request, tries: int = 0) -> None:
        rank = self.ranks[req.receiver]
        try:
            ticket = rank.api.submit_receive(req.rid, req.nblocks, req.writers, num_slices=req.num_slices,  # type: ignore[union-attr]
                                             aux=req.aux)
        except KvownError as e:  # fail-stopping, or the previous session for this id is still live
            self._say(f"rank {rank.rank} receive({req.rid}) refused: {e.message}")
            return
        rank.tickets[req.rid] = (ticket, tries)

    def _open_send(self, req: _Request, w: int) -> None:
        free = self.src_free[w]
        if len(free) < req.nblocks or req.rid in self.ranks[w].sends:
            if len(free) < req.nblocks:
                self._at(self.now + 50, "open_send_retry", w, lambda: self._open_send(req, w))
            return
        blocks = tuple(free.pop(self.rng.randrange(len(free))) for _ in range(req.nblocks))
        tokens = [_Token() for _ in range(req.num_pieces)]
        aux = req.rid.to_bytes(8, "little") if req.aux else None
        try:
            handle = self.ranks[w].api.send(req.rid, blocks, ready=tokens, num_pieces=req.num_pieces, aux=aux)  # type: ignore[union-attr]
        except KvownError as e:
            free.extend(blocks)
            self._say(f"rank {w} send({req.rid}) refused: {e.message}")
            return
        self.ranks[w].sends[req.rid] = handle
        self.src_blocks[(w, req.rid)] = blocks
        for piece in range(req.num_pieces):
            for b in _piece_blocks(blocks, piece, req.num_pieces):
                self.src_owner[(w, b)] = (req.rid, piece)
            self._at(self.now + self.rng.randint(1, 60), "source_ready", w,
                     lambda p=piece, tok=tokens[piece]: self._source_ready(w, req, p, tok))

    def _source_ready(self, w: int, req: _Request, piece: int, token: _Token) -> None:
        """The prefill wrote this piece's KV (the pattern), then signals its ready token."""
        blocks = self.src_blocks.get((w, req.rid))
        if blocks is None or w in self.dead:
            return
        data, bs = self.ranks[w].bytes, self.layout.block_nbytes
        for j, b in enumerate(blocks):
            if _piece_of(j, len(blocks), req.num_pieces) == piece:
                data[b * bs : (b + 1) * bs] = _pattern(req.rid, j, bs)
        self.ready.add((w, req.rid, piece))
        token.signal()

    def _cancel(self, rank: int, rid: int) -> None:
        self.counts["client_cancels"] += 1
        self.client_cancelled.add((rank, rid))
        if any(dst == f"sim-r{self.requests[rid].receiver}" for _, dst, _ in self.fabric.unfinished_writes()):
            self.counts["cancel_mid_transfer"] += 1
        self.ranks[rank].api.cancel(rid)  # type: ignore[union-attr]

    def _release(self, rank: int, rid: int) -> None:
        handle = self.ranks[rank].recvs.get(rid)
        if handle is not None and handle.landed.is_set() and not handle.retired.is_set():
            self.ranks[rank].api.release(rid)  # type: ignore[union-attr]

    def _local_copy(self, rank: int, rid: int) -> None:
        handle = self.ranks[rank].recvs.get(rid)
        if handle is None or handle.retired.is_set() or handle.closing:
            return
        token = _Token()
        try:
            self.ranks[rank].api.local_copy(rid, token)  # type: ignore[union-attr]
        except KvownError:
            return
        self.counts["local_copies"] += 1
        self.local_copies[(rank, rid)].append((self.now, token))
        slow = self.rng.random() < 0.1
        hold = self.rng.randint(1, 3 * self.config.grace_ns) if slow else self.rng.randint(1, 30)
        self._at(self.now + hold, "local_copy_done", rank, token.signal)

    def _kill(self, rank: int) -> None:
        if rank in self.dead:
            return
        self.dead.add(rank)
        self.ranks[rank].wake = None
        self.counts["deaths"] += 1
        self.fabric._agents.pop(f"sim-r{rank}", None)  # frames to it are lost; its WRITEs may still land
        self._say(f"rank {rank} DIES")

    def _forge_ack(self, req: _Request) -> None:
        """An insider (holds the job key, is not a writer of this request) forges a writer's ack."""
        outsiders = [r for r in self.senders if r not in req.writers and self._live(r)]
        if not outsiders or not self._live(req.receiver):
            return
        impostor = self.ranks[self.rng.choice(outsiders)]
        envelope = impostor.driver.out.stamp(req.receiver, SessionQuiesced(req.writers[0], req.rid))
        impostor.transport.send(req.receiver, codec.encode(envelope, JOB_KEY))
        self.counts["forged_sent"] += 1

    def _reopen(self, rank: int, rid: int) -> None:
        """The embedding server schedules the same (concluded, not completed) id again: born cancelled."""
        req = self.requests[rid]
        if not self._live(rank):
            return
        self.counts["reopened"] += 1
        if rank in self.receivers:
            self._open_receive(req)
        else:
            self._open_send(req, rank)

    # ---- after each step: what the embedding servers see --------------------------------------------

    def _observe(self, r: int) -> None:
        """Follow the handles of rank ``r`` after a step: tickets, landings, conclusions, releases."""
        rank = self.ranks[r]
        for rid, (ticket, tries) in list(rank.tickets.items()):
            if not ticket.future.done():
                continue
            del rank.tickets[rid]
            if ticket.future.exception() is not None:
                if tries < 20:
                    self._at(self.now + 50, "open_receive_retry", r,
                             lambda q=self.requests[rid], n=tries + 1: self._open_receive(q, n))
                else:
                    self.counts["pool_exhausted"] += 1
                continue
            rank.recvs[rid] = ticket.future.result()
            self.opened[(r, rid)] = self.now
        for rid, handle in list(rank.recvs.items()):
            self._observe_outcome(r, rid, handle)
            if handle.landed.is_set() and (r, rid) not in self.verified:
                self.verified.add((r, rid))
                self._consume(r, rid, handle)
            if handle.retired.is_set():
                del rank.recvs[rid]
                self.counts["retired"] += 1
                self.retirement_proof.check(rank, rid, handle, self.requests[rid].writers, self.ranks, self.dead)
        for rid, handle in list(rank.sends.items()):
            self._observe_outcome(r, rid, handle)
            if handle.released.is_set():
                del rank.sends[rid]
                self.counts["released_sources"] += 1
                for b in self.src_blocks.pop((r, rid), ()):
                    self.src_owner.pop((r, b), None)
                    self.src_free[r].append(b)

    def _consume(self, r: int, rid: int, handle: ReceiveHandle) -> None:
        """A landing, seen once: verify its bytes, then maybe a local copy, and a release later."""
        if handle.retired.is_set() and (r, rid) in self.client_cancelled:
            # one step landed it and then took the client's older cancel, which gave the blocks back (a
            # napping rank reads frames first): nothing was left for the consumer to read
            self.counts["landed_then_cancelled"] += 1
            return
        self._verify_landed(r, rid, handle)
        if self.rng.random() < self.config.p_local_copy:
            self._at(self.now + self.rng.randint(0, 20), "local_copy", r, lambda q=rid: self._local_copy(r, q))
        slow = self.rng.random() < self.config.p_slow_consumer
        hold = self.rng.randint(1, 2 * self.config.timeout_ns) if slow else self.rng.randint(1, 40)
        self._at(self.now + hold, "consumer_release", r, lambda q=rid: self._release(r, q))

    def _observe_outcome(self, rank: int, rid: int, handle: SendHandle | ReceiveHandle) -> None:
        if not handle.outcome.done() or (rank, rid) in self.concluded:
            return
        self.concluded[(rank, rid)] = self.now
        error = handle.outcome.exception()
        if error is not None:
            self.counts["admission_refused"] += 1
            return
        outcome = handle.outcome.result()
        self.counts[f"outcome_{outcome.value}"] += 1
        self.session_bounds.concluded(rank, rid, outcome)
        if outcome is not Outcome.COMPLETED and self.rng.random() < self.config.p_reopen:
            self._at(self.now + self.rng.randint(20, 200), "reopen", rank, lambda k=rank, q=rid: self._reopen_after(k, q))

    def _reopen_after(self, rank: int, rid: int) -> None:
        live = self.ranks[rank].recvs.get(rid) or self.ranks[rank].sends.get(rid)
        if live is not None:  # the first session has not finished yet: try later
            self._at(self.now + 100, "reopen", rank, lambda k=rank, q=rid: self._reopen_after(k, q))
            return
        self.concluded.pop((rank, rid), None)
        if self._fenced_raw(rank, rid):
            self._born_fenced.add((rank, rid))
            self.counts["born_cancelled_checked"] += 1
        self._reopen(rank, rid)

    def _verify_landed(self, rank: int, rid: int, handle: ReceiveHandle) -> None:
        """(e) the landed blocks hold exactly what the writers wrote; the aux slot its payload."""
        self.landed_bytes.check(rank, self.ranks[rank].bytes, rid, handle, self.ranks[rank].driver)
        self.counts["verified_landings"] += 1

    # ---- the step loop ------------------------------------------------------------------------------

    def _wake_ns(self, rank: _Rank) -> int | None:
        if not self._live(rank.rank):
            return None
        dues = [d for d in (rank.driver.next_deadline_ns(), rank.faulty.next_due_ns()) if d is not None]
        if rank.driver.retry_due():
            dues.append(self.now + 1)  # a failed send or release is retried on the next step
        return min(dues, default=None)

    def step(self) -> bool:
        """Run one workload event or one instant of due rank work; check the oracles. False when done."""
        wake = min(((rank.wake, r) for r, rank in self.ranks.items() if rank.wake is not None), default=None)
        head = self._queue[0][0] if self._queue else None
        if wake is None and head is None:
            return False
        if head is not None and (wake is None or head < wake[0]):
            t, _, label, rank, fn = heapq.heappop(self._queue)
            self.now = max(self.now, t)
            self._say(f"workload {label} rank {rank}")
            if rank is not None and not self._live(rank) and label != "death":
                return True
            fn()
            dirty = {rank} if rank is not None else set(self.receivers)
        else:
            self.now = max(self.now, wake[0])
            dirty = {r for r, rank in self.ranks.items() if rank.wake is not None and rank.wake <= self.now}
        self._settle(dirty)
        return True

    def _settle(self, dirty: set[int]) -> None:
        """Step ranks with work at ``now`` until every live rank is quiet (rule 3), checking each step."""
        pending = set(dirty)
        inboxes = [(r, agent) for r in self.ranks if (agent := self.fabric._agents.get(f"sim-r{r}")) is not None]
        for _ in range(SETTLE_ROUNDS):
            pending.update(r for r, agent in inboxes if agent.inbox and not self._naps(r, pending))
            gone = {r for r in pending if not self._live(r)}
            for r in gone:
                self.ranks[r].wake = None  # dead or fail-stopped, mid-nap too: never stepped again
            pending -= gone
            if not pending:
                return
            r = min(pending)
            pending.discard(r)
            rank = self.ranks[r]
            napped, rank.nap_until = rank.nap_until is not None, None
            self.counts["frames_before_commands"] += napped and bool(rank.driver.inbox)
            rank.driver.step(self.now, frames_first=napped)
            self.counts["steps"] += 1
            self._check_after_step(rank)
            self._observe(r)
            rank.wake = self._wake_ns(rank)
            if rank.wake is not None and rank.wake <= self.now:
                pending.add(r)
        raise self.violation("b", f"ranks did not go quiet at t={self.now} (livelock)")

    def _naps(self, r: int, pending: set[int]) -> bool:
        """True while rank ``r`` naps through the frames in its inbox; a rank with no step due may be drawn
        to start a nap now (``p_nap``). Its wake is then the nap's end at the latest."""
        rank = self.ranks[r]
        if rank.nap_until is not None:
            return rank.nap_until > self.now
        if r in pending or not self._live(r) or not self.config.p_nap or self.rng.random() >= self.config.p_nap:
            return False
        rank.nap_until = self.now + self.rng.randint(1, self.config.nap_ns)
        rank.wake = rank.nap_until if rank.wake is None else min(rank.wake, rank.nap_until)
        self.counts["naps"] += 1
        self._say(f"rank {r} naps until t={rank.nap_until}")
        return True

    def run(self, steps: int | None = None) -> dict[str, int]:
        """Run to the end (or ``steps`` steps), then the end-of-run checks. Returns the counts."""
        limit = steps if steps is not None else self.config.max_steps
        n = 0
        for _ in range(3):
            while n < limit and self.step():
                n += 1
            if n >= limit or not self._end_phase_cancels():
                break
        self.counts["events"] = n
        if steps is None:
            if n >= limit:
                raise self.violation("b", "the world did not settle within max_steps")
            self.check_end()
        self._collect_counts()
        return dict(self.counts)

    def _end_phase_cancels(self) -> bool:
        """Send sessions whose publication never came have no clock; the embedding server gives up."""
        gave_up = False
        for w, rid, handle in [(w, rid, h) for w, rank in self.ranks.items() for rid, h in rank.sends.items()]:
            if self._live(w) and not handle.released.is_set():
                core = self.ranks[w].driver.sender
                s = core.sessions.get(rid) if core is not None else None
                if s is not None and s.clock.exposed_ns is None:
                    self.counts["end_phase_cancels"] += 1
                    self._at(self.now + 1, "server_gives_up", w, lambda r=w, q=rid: self._cancel(r, q))
                    gave_up = True
        return gave_up

    def _collect_counts(self) -> None:
        for rank in self.ranks.values():
            self.counts.update({f"fault_{k}": v for k, v in rank.faulty.counts.items()})
            stats = rank.driver.stats
            for name in ("control_resent", "release_failures", "receive_errors", "rejected_frames",
                         "rejected_peer_input", "admission_refused", "writes_coalesced"):
                self.counts[name] += stats.get(name, 0)
            self.counts["duplicates_dropped"] += rank.driver.inn.duplicates
            core = rank.driver.sender or rank.driver.receiver
            self.counts["born_cancelled"] += core.counters.get("born_cancelled", 0)
            if rank.fatal is not None:
                self.counts["fatal"] += 1
                self.counts[f"fatal_{rank.fatal.reason.value}"] += 1

    # ---- oracles (kvown.testing.oracles), after every rank step and at the end ---------------------

    def _fenced_raw(self, rank: int, rid: int) -> bool:
        return self.fences.fenced(self.ranks[rank].fence_tables, rid)

    def _check_after_step(self, rank: _Rank) -> None:
        r, now = rank.rank, self.now
        if self.no_invariant_fail_stop.check(r, rank.fatal):
            self._say(f"rank {r} FAIL-STOP {rank.fatal.reason.value}: {rank.fatal.detail[:120]}")  # type: ignore[union-attr]
            return
        self.watchdog_agrees.check(r, rank.driver, now)
        fences_may_change = self.evidence_once.check(r, rank.recorder, self._say)
        self.session_bounds.check(r, rank.role, rank.driver, now)
        self.fences.check(r, rank.fence_tables, fences_may_change)
        self.pool_accounting.check(r, rank.pool)
        self.writes_after_ready.check(self._pools)
        self.no_stream_holes.check(r, rank.faulty, now)

    def check_end(self) -> None:
        """At the end: live, non-fatal ranks have no sessions, every block free and every canary intact."""
        for r, rank in self.ranks.items():
            if self._live(r):
                self.end_state.check(rank)


class _Token:
    """A host ready token the simulated producer signals (``threading.Event``-free: no locks needed)."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False

    def signal(self) -> None:
        self.done = True

    def query(self) -> bool:
        return self.done


_PATTERNS: dict[tuple[int, int, int], np.ndarray] = {}


def _pattern(rid: int, index: int, nbytes: int) -> np.ndarray:
    """The bytes the simulated prefill writes into block ``index`` of request ``rid`` (cached)."""
    key = (rid, index, nbytes)
    out = _PATTERNS.get(key)
    if out is None:
        seed = (rid * 0x9E3779B1 + index * 0x85EBCA6B + 1) & 0xFFFFFFFF
        out = _PATTERNS[key] = ((np.arange(nbytes, dtype=np.uint64) * 2654435761 + seed) >> 7).astype(np.uint8)
        if len(_PATTERNS) > 1 << 16:
            _PATTERNS.clear()
    return out


def _piece_of(index: int, nblocks: int, pieces: int) -> int:
    """Which piece block ``index`` belongs to (the sender core splits blocks evenly into pieces)."""
    for p in range(pieces):
        if p * nblocks // pieces <= index < (p + 1) * nblocks // pieces:
            return p
    raise ValueError(index)


def _piece_blocks(blocks: tuple[int, ...], piece: int, pieces: int) -> tuple[int, ...]:
    n = len(blocks)
    return blocks[piece * n // pieces : (piece + 1) * n // pieces]


def run_seed(seed: int, config: SimConfig | None = None) -> dict[str, int]:
    """Convenience for embedding projects and tests: one seeded run to the end."""
    return SimWorld(seed, config).run()
