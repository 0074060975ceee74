"""The simulated world's oracles, one checker class each (TigerBeetle-style), usable by any stepped world.

Owns: what each oracle remembers between checks (frames seen, fences seen, drain starts). Each checker
watches the state it names and hands a typed ``Violation`` (its tag (a)..(g), its own class name, what
broke, fields) to the ``Report`` it was built with: ``SimWorld`` raises it as an ``InvariantViolation``
with the seed and decision log; ``Tally`` records it for a caller that counts.

Rules:
  1. An oracle reads state directly (raw attributes, the fake fabric, the bytes in the pools), never
     through core methods a mutant may patch.
  2. An oracle changes nothing it watches; the only state it writes is its own memory.
  3. ``Facts`` is what the embedding servers did (exposures, conclusions, ready pieces, local copies,
     reopened fenced ids): the world's workload writes it, the oracles only read it.
What each tag means: docs/design.md section 13 ("The simulator's oracles").
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvown.adapters import codec
from kvown.adapters.transport import Role
from kvown.core.actions import FailStop, FatalReason, Outcome
from kvown.core.errors import KvownError
from kvown.core.ids import split_request_id
from kvown.core.messages import RequestData
from kvown.core.sender import LIVE


@dataclass(frozen=True)
class Violation:
    """One broken invariant: ``tag`` (a)..(g), the ``oracle`` class that saw it, ``what`` broke, fields."""

    tag: str
    oracle: str
    what: str
    fields: dict[str, Any] = field(default_factory=dict)


Report = Callable[[Violation], None]


class Tally:
    """A ``Report`` that records every violation instead of raising (for worlds that count them)."""

    def __init__(self) -> None:
        self.violations: list[Violation] = []

    def __call__(self, violation: Violation) -> None:
        self.violations.append(violation)

    def count(self, tag: str | None = None) -> int:
        return sum(1 for v in self.violations if tag is None or v.tag == tag)


class RankView(Protocol):
    """What the oracles read of one rank: ``SimWorld``'s ranks and ``DriverPair.views()`` provide it."""

    rank: int
    role: Role
    agent: str  # its name on the fake fabric
    driver: Any  # kvown.runtime.driver.Driver
    pool: Any  # kvown.cache.pool.KVPool
    aux: Any  # the aux-slot tensor (or None)
    recorder: Any  # kvown.runtime.flight.FlightRecorder
    faulty: Any  # the FaultyTransport wrapping its transport, or None
    fatal: FailStop | None


@dataclass
class Facts:
    """What the embedding servers did, as the workload records it (keys are (rank, request id))."""

    opened: dict[tuple[int, int], int] = field(default_factory=dict)  # exposure time (receive opened)
    concluded: dict[tuple[int, int], int] = field(default_factory=dict)  # first conclusion seen
    local_copies: dict[tuple[int, int], list[tuple[int, Any]]] = field(
        default_factory=lambda: collections.defaultdict(list))  # (queued at, ready token)
    born_fenced: set[tuple[int, int]] = field(default_factory=set)  # sessions reopened for a fenced id
    ready: set[tuple[int, int, int]] = field(default_factory=set)  # (writer, rid, piece) signalled
    src_owner: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)  # (writer, block) -> (rid, piece)


class Oracle:
    """Base: ``tag`` and a ``report``; ``fail`` hands a ``Violation`` naming this class to it."""

    tag = "?"

    def __init__(self, report: Report) -> None:
        self.report = report

    def fail(self, what: str, tag: str | None = None, **fields: Any) -> None:
        self.report(Violation(tag or self.tag, type(self).__name__, what, fields))


def fence_tables(driver: Any) -> dict[int, dict[int, int]]:
    """The raw fence tables of a rank's core (epoch -> seq -> state); read, never through ``is_fenced``."""
    return (driver.sender or driver.receiver).fence._tables  # type: ignore[no-any-return]


def fenced_raw(tables: Mapping[int, Mapping[int, int]], rid: int, split: tuple[int, int] | None = None) -> bool:
    epoch, seq = split or split_request_id(rid)
    table = tables.get(epoch)
    return table is not None and table.get(seq) != 0


class NoInvariantFailStop(Oracle):
    """(e) no rank fail-stops on an invariant (broken canary, pool bookkeeping). True: the rank latched."""

    tag = "e"

    def check(self, rank: int, fatal: FailStop | None) -> bool:
        if fatal is not None and fatal.reason is FatalReason.INVARIANT:
            self.fail(f"rank {rank} fail-stopped on an invariant: {fatal.detail[:300]}")
        return fatal is not None


class WatchdogAgrees(Oracle):
    """(b) the watchdog's question and the engine's answer agree for a rank just stepped at ``now``."""

    tag = "b"

    def check(self, rank: int, driver: Any, now: int) -> None:
        if driver.check_fatal(now) is not None:
            self.fail(f"rank {rank} was stepped at t={now} yet check_fatal says fatal: "
                      f"{driver.check_fatal(now).detail[:200]}")


class EvidenceOnce(Oracle):
    """(c) each (src, seq) reaches a rank's cores once; honest evidence is never disputed (the insiders of
    the simulator forge acks on their own streams, which the core refuses without a dispute)."""

    tag = "c"

    def __init__(self, report: Report) -> None:
        super().__init__(report)
        self.cursor: dict[int, int] = collections.defaultdict(int)  # rank -> recorder events scanned
        self.seen: dict[int, set[Any]] = collections.defaultdict(set)

    def check(self, rank: int, recorder: Any, say: Callable[[str], None]) -> bool:
        """Scan the rank's new recorder events (each one logged through ``say``). True: there were some."""
        self.cursor[rank], new = recorder.events_since(self.cursor[rank])
        seen = self.seen[rank]
        for _, kind, rid, detail in new:
            say(f"r{rank} {kind} {rid} {_brief(detail)}")
            if kind in ("recv", "recv_carried"):  # a frame position (and message in it), or a carried report
                key = ((detail["src"], detail["seq"], detail["index"]) if kind == "recv"
                       else ("carried", detail["src"], rid, detail["msg"], detail["piece"]))
                if key in seen:
                    self.fail(f"rank {rank}: message {key} delivered twice")
                seen.add(key)
            elif kind == "disputed":
                self.fail(f"rank {rank} disputed honest evidence for {rid}: {detail['reason']}")
        return bool(new)


class SessionBounds(Oracle):
    """(b) the drain start never moves; no claim outlives its bound. (d) a session opened for a fenced id
    is born cancelled: no live core session for it after the step that opened it, and a CANCELLED outcome."""

    tag = "b"

    def __init__(self, report: Report, facts: Facts) -> None:
        super().__init__(report)
        self.facts = facts
        self.drain_seen: dict[tuple[int, int, int], int] = {}

    def check(self, rank: int, role: Role, driver: Any, now: int) -> None:
        core = driver.receiver or driver.sender
        grace, timeout = core.config.grace_ns, core.config.timeout_ns
        facts = self.facts
        for rid, s in core.sessions.items():
            if (rank, rid) in facts.born_fenced:  # (d) at once, not only when it concludes
                self.fail(f"rank {rank} opened a live session for fenced id {rid}", tag="d", rid=rid)
            key = (rank, rid, id(s.clock))
            started = s.clock.drain_started_ns
            if started is not None and self.drain_seen.setdefault(key, started) != started:
                self.fail(f"drain of {rid} on rank {rank} moved (INV-D2)")
            if role is not Role.RECEIVER or (rank, rid) not in facts.opened:
                continue
            exposed = facts.opened[(rank, rid)]
            trigger = min(facts.concluded.get((rank, rid), exposed + timeout), exposed + timeout)
            writer_claims = bool(s.disputed) or any(
                not ((w.stream_ended or w.acked) and not w.in_doubt) for w in s.writers.values())
            bounds = [trigger + grace] if writer_claims else []
            bounds += [t + grace for t, token in facts.local_copies.get((rank, rid), []) if not token.query()]
            if bounds and now > min(bounds):
                self.fail(f"session {rid} on rank {rank} still has claims at t={now} > "
                          f"bound {min(bounds)} without a fail-stop", rid=rid)

    def concluded(self, rank: int, rid: int, outcome: Outcome) -> None:
        """(d) a session reopened for a fenced id concluded: it must have been born cancelled."""
        if (rank, rid) in self.facts.born_fenced and outcome is not Outcome.CANCELLED:
            self.fail(f"a session for fenced id {rid} on rank {rank} was not born cancelled", tag="d")


class FencesNeverReopen(Oracle):
    """(d) a fence once seen never disappears (raw tables: a mutant may patch ``is_fenced``). Fences are
    installed only while the rank records events, so new ones are looked for only then."""

    tag = "d"

    def __init__(self, report: Report, ids: Iterable[int]) -> None:
        super().__init__(report)
        self.split = {rid: split_request_id(rid) for rid in ids}  # the ids to watch
        self.seen: dict[int, set[int]] = collections.defaultdict(set)

    def fenced(self, tables: Mapping[int, Mapping[int, int]], rid: int) -> bool:
        return fenced_raw(tables, rid, self.split.get(rid))

    def check(self, rank: int, tables: Mapping[int, Mapping[int, int]], changed: bool) -> None:
        seen = self.seen[rank]
        for rid in seen:
            if not self.fenced(tables, rid):
                self.fail(f"fence for {rid} on rank {rank} reopened")
        if changed:
            seen.update(rid for rid in self.split if rid not in seen and self.fenced(tables, rid))


class PoolAccounting(Oracle):
    """(e) a pool's accounting ``total == free + owned + held`` (raw counters)."""

    tag = "e"

    def check(self, rank: int, pool: Any) -> None:
        if pool._num_free + pool._num_owned + pool._num_held != pool.layout.num_blocks:
            self.fail(f"pool accounting broken on rank {rank}")


class WritesAfterReady(Oracle):
    """(f) every WRITE posted since the last check reads only source pieces whose token was signalled."""

    tag = "f"

    def __init__(self, report: Report, fabric: Any, facts: Facts, block_nbytes: int) -> None:
        super().__init__(report)
        self.fabric, self.facts, self.block_nbytes = fabric, facts, block_nbytes

    def check(self, pools: Mapping[int, Any]) -> None:
        """``pools``: writer rank -> its pool; a WRITE's source agent name ends in ``r<rank>``."""
        for src, pieces in self.fabric.take_posted():
            w = int(src.rsplit("r", 1)[1])
            pool = pools[w]
            base, bs = pool.base_addr, self.block_nbytes
            for laddr, _, _ in pieces:
                if base <= laddr < base + pool.layout.pool_nbytes:
                    owner = self.facts.src_owner.get((w, (laddr - base) // bs))
                    if owner is not None and (w, owner[0], owner[1]) not in self.facts.ready:
                        self.fail(f"rank {w} posted a WRITE of request {owner[0]} piece {owner[1]} "
                                  "before its ready token", rid=owner[0])


class NoStreamHoles(Oracle):
    """(g) a frame whose send raised unsent must be sent again within the resend budget."""

    tag = "g"

    def __init__(self, report: Report, budget_ns: int) -> None:
        super().__init__(report)
        self.budget_ns = budget_ns

    def check(self, rank: int, faulty: Any, now: int) -> None:
        for frame, since in faulty.raised.items():
            if now - since > self.budget_ns + 1:
                self.fail(f"rank {rank} left a hole in a control stream: a frame whose send "
                          f"raised at t={since} was never sent again and the rank did not fail-stop")


class RetirementProof(Oracle):
    """(a) at the moment of retirement nothing may still write into these blocks: no unfinished WRITE
    targets them, no REQUEST_DATA for the request is on its way to a live writer, and no live writer's
    core still holds an operation or a publication for it."""

    tag = "a"

    def __init__(self, report: Report, fabric: Any, key: bytes, block_nbytes: int) -> None:
        super().__init__(report)
        self.fabric, self.key, self.block_nbytes = fabric, key, block_nbytes

    def check(self, rx: RankView, rid: int, handle: Any, writers: Iterable[int], ranks: Mapping[int, RankView],
              dead: Iterable[int] = ()) -> None:
        r, pool, bs = rx.rank, rx.pool, self.block_nbytes
        targets = [(pool.base_addr + b * bs, bs) for b in handle.blocks]
        if handle.aux_slot >= 0:
            targets.append((rx.aux.data_ptr() + 8 * handle.aux_slot, 8))
        for src, dst, pieces in self.fabric.unfinished_writes():
            if dst != rx.agent:
                continue
            for _, raddr, n in pieces:
                if any(a < raddr + n and raddr < a + size for a, size in targets):
                    self.fail(f"rank {r} retired request {rid} while a WRITE from {src} may still "
                              "touch its blocks", rid=rid)
        for w in writers:
            if w in dead:
                continue
            if self._request_data_in_flight(rx, ranks[w], rid):
                self.fail(f"rank {r} retired request {rid} while its REQUEST_DATA to writer {w} "
                          "is still on its way", rid=rid)
            core = ranks[w].driver.sender
            s = core.sessions.get(rid)
            stream = s.streams.get(r) if s is not None else None
            if stream is not None and any(op.state in LIVE for op in stream.ops):
                self.fail(f"rank {r} retired request {rid} while writer {w} still has an operation "
                          "that may write", rid=rid)
            if stream is None and r in core._saved.get(rid, {}) and not fenced_raw(fence_tables(ranks[w].driver), rid) \
                    and not core.poisoned:
                self.fail(f"rank {r} retired request {rid} while writer {w} holds its publication "
                          "and may still open a session", rid=rid)

    def _request_data_in_flight(self, rx: RankView, writer: RankView, rid: int) -> bool:
        frames: list[bytes] = []
        agent = self.fabric._agents.get(writer.agent)
        if agent is not None:
            frames += [item[2] for item in agent.inbox]
        if rx.faulty is not None:
            frames += [f for _, _, dst, f in rx.faulty._out if dst == writer.rank]
        if writer.faulty is not None:
            frames += [f for _, src, f in writer.faulty._in if src == rx.rank]
        pending = rx.driver.resend.pending.get(writer.rank)
        if pending is not None:
            frames += [f for f, _ in pending.frames]
        inbound = writer.driver.inn
        delivered_below = inbound._expected.get(rx.rank, 0)  # a copy of a frame already delivered is a dropped duplicate
        decoded = [codec.decode_frame(f, self.key) for f in frames if _authentic(f, self.key)]
        live = [f for f in decoded if not f.carried and f.seq >= delivered_below]
        live += list(inbound._held.get(rx.rank, {}).values())
        return any(isinstance(m, RequestData) and m.request_id == rid and f.src_rank == rx.rank
                   for f in live for m in getattr(f, "messages", (getattr(f, "message", None),)))


class LandedBytes(Oracle):
    """(e) the landed blocks hold exactly what the writers wrote; the aux slot its payload."""

    tag = "e"

    def __init__(self, report: Report, block_nbytes: int, expected: Callable[[int, int, int], Any]) -> None:
        """``expected(rid, index, nbytes)``: the bytes the producer wrote into block ``index`` of ``rid``."""
        super().__init__(report)
        self.block_nbytes, self.expected = block_nbytes, expected

    def check(self, rank: int, data: Any, rid: int, handle: Any, driver: Any) -> None:
        """``data``: the rank's pool bytes (a uint8 array); the aux slot is read through ``driver``."""
        bs = self.block_nbytes
        for j, b in enumerate(handle.blocks):
            if not np.array_equal(data[b * bs : (b + 1) * bs], self.expected(rid, j, bs)):
                self.fail(f"request {rid} landed on rank {rank} with wrong bytes in block {b} "
                          f"(index {j}): stale or foreign data", rid=rid)
        if handle.aux_slot >= 0 and driver.read_aux(handle) != rid.to_bytes(8, "little"):
            self.fail(f"request {rid} landed on rank {rank} with a wrong aux payload", rid=rid)


class EndState(Oracle):
    """At the end: live, non-fatal ranks have no sessions, every block free and every canary intact."""

    tag = "b"

    def check(self, view: RankView) -> None:
        r, core = view.rank, view.driver.sender or view.driver.receiver
        if core.sessions:
            rid, s = next(iter(core.sessions.items()))
            self.fail(f"rank {r} ended with {len(core.sessions)} live session(s), e.g. {rid} "
                      f"outcome={s.outcome} reason={s.reason!r}")
        if view.role is Role.RECEIVER:
            stats = view.pool.statistics()
            if stats.free != stats.total:
                self.fail(f"rank {r} ended with blocks not free: {stats}", tag="e")
            canaries = view.driver.canaries
            broken = canaries.check(tuple(range(stats.total))) if canaries is not None else []
            if broken:
                self.fail(f"rank {r}: a write landed after retirement: {broken[0]}", tag="e")


def _authentic(frame: bytes, key: bytes) -> bool:
    try:
        codec.decode_frame(frame, key)
    except KvownError:
        return False
    return True


def _brief(detail: dict[str, Any]) -> str:
    return " ".join(f"{k}={str(v)[:60]}" for k, v in detail.items())
