"""Fault injection at the transport seam: a wrapper around any ``Transport`` (real NIXL or the fake).

Owns: ``FaultyTransport`` (the wrapper), ``FaultProfile`` (per-call probabilities, drawn from a seeded
``random.Random`` by the simulator), ``parse_plan`` (deterministic "n-th call" faults from a plan text)
and ``fault_wrapper`` / ``fault_wrapper_from_env`` (``wrap_transport=`` for ``kvown.rank.connect_*``;
only tests, the demo, the soak and qualification pass one, and only they read ``KVOWN_FAULT``).
The production loop has no fault code. Faults: control frames that raise, drop, duplicate, delay or
arrive late; WRITEs refused, raising while on the wire, ERROR then DONE or never, late or stuck; a
release that fails; and crashes at named protocol points (``CRASH_POINTS``). The plan syntax and the
crash points are in docs/design.md section 13.

Rules:
  1. Time comes from the injected ``clock``; nothing here sleeps or starts a thread. Held frames and
     late completions are released when the wrapper is next called at or after their due time.
  2. A fault never lies about safety-relevant physics: a WRITE reported DONE really completed below,
     and a "post raised" WRITE is really on the wire.
  3. A WRITE's notification (a carried result) follows the WRITE's injected fate, as NIXL's does
     (``kvown.adapters.nixl`` rule 7): the wrapper sends it itself when it first reports DONE for that
     handle - never for a WRITE that is stuck, reported ERROR, or whose post "raised".
"""

from __future__ import annotations

import collections
import heapq
import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvown.adapters.transport import InDoubt, NotPosted, Posted, Transport, WriteOutcome, WriteStatus
from kvown.core.actions import PostWrite
from kvown.core.errors import AdapterError, ConfigError
from kvown.core.messages import FRAME_BATCH, TAG_NBYTES, ControlKind

CRASH_POINTS = ("before-publish", "request-data", "write-posted", "write-done", "kv-result-sent",
                "cancel-sent", "quiesced-sent", "retire")
PLAN_NAMES = ("stuck-writer", "slow-writer", "slow-control", "send-raise", "send-raise-after", "drop-frame",
              "late-frame", *(f"crash-{p}" for p in CRASH_POINTS))
_DEFAULT_MS = {"slow-writer": 300, "slow-control": 20, "late-frame": 1000}
# frame kind -> (crash point before the send, crash point after it)
_SEND_POINTS = {
    ControlKind.REQUEST_DATA: ("before-publish", "request-data"),
    ControlKind.KV_RESULT: (None, "kv-result-sent"),
    ControlKind.CANCEL_SESSION: (None, "cancel-sent"),
    ControlKind.SESSION_QUIESCED: (None, "quiesced-sent"),
}


def sigkill_self(point: str) -> None:
    """The default crash action: die at once, as a power cut or the OOM killer would."""
    os.kill(os.getpid(), signal.SIGKILL)


def frame_kinds(frame: bytes) -> tuple[ControlKind, ...]:
    """The kinds of the messages in one of our own sealed frames, single or batch (read from the msgpack
    body; the tag is not checked). Empty for a body that does not parse."""
    import msgpack

    try:
        obj = msgpack.unpackb(frame[:-TAG_NBYTES], raw=False)
        if obj[0] == FRAME_BATCH:
            return tuple(ControlKind(item[0]) for item in obj[5:])
        return (ControlKind(obj[1]),)
    except (ValueError, TypeError, IndexError, KeyError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError):
        return ()


def _points(kinds: tuple[ControlKind, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A frame's crash points before the send and after it: each point its messages name, once, in
    message order (a batch of a KV_RESULT and a SESSION_QUIESCED passes both after-points)."""
    points = [_SEND_POINTS[k] for k in kinds if k in _SEND_POINTS]
    return (tuple(dict.fromkeys(b for b, _ in points if b)), tuple(dict.fromkeys(a for _, a in points if a)))


def _kinds_label(kinds: tuple[ControlKind, ...]) -> str:
    return "+".join(dict.fromkeys(k.name for k in kinds)) or "?"  # each kind once, in order


@dataclass(frozen=True)
class FaultProfile:
    """Per-call fault probabilities and latencies (integer ns of the injected clock)."""

    p_send_raise: float = 0.0  # raise before sending (the frame did not leave)
    p_send_raise_after: float = 0.0  # raise after sending (it did leave)
    p_drop: float = 0.0  # silently lost
    p_dup: float = 0.0  # delivered twice
    p_corrupt: float = 0.0  # an extra copy with one bit flipped (the HMAC must refuse it)
    frame_delay_ns: tuple[int, int] = (0, 0)  # uniform latency per frame: frames overtake each other
    p_slow: float = 0.0  # a frame or a WRITE takes 10x its latency
    write_ns: tuple[int, int] = (0, 0)  # uniform WRITE latency before DONE can be seen
    p_not_posted: float = 0.0
    p_post_raises: float = 0.0  # in doubt, though really posted
    p_write_error: float = 0.0  # ERROR first ...
    p_late_done: float = 0.6  # ... then DONE later (else never: in doubt for good)
    p_stall: float = 0.0  # never reports
    p_receive_raise: float = 0.0
    p_release_raise: float = 0.0


@dataclass
class PlanEntry:
    name: str
    nth: int = 1
    ms: int = 0
    pct: int | None = None  # fire on this percentage of calls (from the nth on) instead of once
    seen: int = 0

    def fires(self, rng: random.Random | None = None) -> bool:
        self.seen += 1
        if self.pct is not None:
            return self.seen >= max(self.nth, 1) and (rng or random).random() * 100 < self.pct
        return self.nth in (0, self.seen)


def parse_plan(text: str, rank: int) -> dict[str, PlanEntry]:
    """The entries of ``text`` that apply to ``rank``. Raises ``ConfigError`` naming a bad entry."""
    plan: dict[str, PlanEntry] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, *opts = item.split(":")
        if name not in PLAN_NAMES:
            raise ConfigError("unknown fault", field="fault", value=name, fix=f"use one of {PLAN_NAMES}")
        try:
            spec = {k: int(v) for k, v in (o.split("=", 1) for o in opts)}
        except ValueError:
            raise ConfigError("fault options are key=integer", field="fault", value=item) from None
        if set(spec) - {"rank", "nth", "ms", "pct"}:
            raise ConfigError("fault options are rank, nth, ms and pct", field="fault", value=item)
        if not 0 <= spec.get("pct", 0) <= 100 or spec.get("nth", 1) < 0 or spec.get("ms", 0) < 0:
            raise ConfigError("pct is 0..100, nth and ms are >= 0", field="fault", value=item)
        if spec.get("rank", rank) == rank:
            ms = spec.get("ms", _DEFAULT_MS.get(name, 0))
            plan[name] = PlanEntry(name, spec.get("nth", 1), ms, spec.get("pct"))
    return plan



def fault_wrapper(plan: str | None) -> Callable[[Any, int], FaultyTransport] | None:
    """``wrap_transport=`` for ``kvown.rank.connect_*``: each rank's transport in a ``FaultyTransport`` with
    the entries of ``plan`` for that rank (``""``: the wrapper with no fault yet, for ``rt.inject_fault``);
    None for ``plan=None`` (no wrapper). Raises ``ConfigError`` naming a bad entry."""
    if plan is None:
        return None
    if not isinstance(plan, str):
        raise ConfigError("fault must be a plan text or None", field="fault", value=plan)
    parse_plan(plan, -1)  # a bad entry fails here, before any rank is built

    def wrap(transport: Any, rank: int) -> FaultyTransport:
        return FaultyTransport(transport, rank, time.monotonic_ns, plan=parse_plan(plan, rank))

    return wrap


def fault_wrapper_from_env(environ: Any = None) -> Callable[[Any, int], FaultyTransport] | None:
    """``fault_wrapper($KVOWN_FAULT)``: how test worlds and the demo's ranks read the plan (production never does)."""
    return fault_wrapper((os.environ if environ is None else environ).get("KVOWN_FAULT"))

@dataclass
class _Write:
    due_ns: int
    stuck: bool = False
    error_until_ns: int | None = None  # report ERROR until then ...
    settles: bool = True  # ... then DONE (if the inner handle finishes), else ERROR for good
    inner_error: bool = False  # the real transfer below reported ERROR: nothing here will change it
    notif: tuple[int, bytes] | None = None  # (receiver rank, frame) to send at DONE (rule 3)


@dataclass
class FaultyTransport:
    """A ``Transport`` that injects faults into ``inner``. Called: from the owning driver's thread."""

    inner: Transport
    rank: int
    clock: Callable[[], int]
    plan: dict[str, PlanEntry] = field(default_factory=dict)
    profile: FaultProfile = field(default_factory=FaultProfile)
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    _out: list[tuple[int, int, int, bytes]] = field(default_factory=list)  # heap of (due, order, dst, frame)
    _in: collections.deque[tuple[int, int | None, bytes]] = field(default_factory=collections.deque)
    _writes: dict[int, _Write] = field(default_factory=dict)  # id(handle) -> its injected fate
    _order: int = 0
    raised: dict[bytes, int] = field(default_factory=dict)  # frames whose send raised unsent -> when (oracles)
    crash_action: Callable[[str], None] = sigkill_self  # what a crash point does (tests may replace it)
    crashed_at: list[str] = field(default_factory=list)  # crash points that fired, in order

    def __post_init__(self) -> None:
        self._frame_points = self._names_frame_points()

    def _names_frame_points(self) -> bool:
        return any(f"crash-{p}" in self.plan for points in _SEND_POINTS.values() for p in points if p)

    def set_plan(self, text: str) -> None:
        """Replace the deterministic plan. Called: by tests through ``Engine.call`` (engine thread)."""
        self.plan = parse_plan(text, self.rank)
        self._frame_points = self._names_frame_points()

    def _crash(self, point: str | None) -> None:
        entry = self.plan.get(f"crash-{point}") if point is not None else None
        if entry is not None and entry.fires(self.rng):
            self.counts[entry.name] += 1
            self.crashed_at.append(point)  # type: ignore[arg-type]
            self.crash_action(point)  # type: ignore[arg-type]

    def probe(self, what: str, request_id: int | None) -> None:
        """The driver's probe hook (``Driver.probe``): names the points no transport call shows."""
        self._crash(what)

    def next_due_ns(self) -> int | None:
        """When something held here next changes (rule 1), or None. A time in the past means "poll now"."""
        now = self.clock()
        dues = [self._out[0][0]] if self._out else []
        if self._in:
            dues.append(self._in[0][0])
        for w in self._writes.values():
            if w.stuck or w.inner_error:
                continue  # never reports, or only the library below can change it
            if w.error_until_ns is None or now < w.due_ns:
                dues.append(w.due_ns)
            elif w.settles:
                dues.append(w.error_until_ns)  # ERROR until then, DONE after
        return min(dues, default=None)

    # ---- control --------------------------------------------------------------------------------

    def _fires(self, name: str, p: float) -> bool:
        entry = self.plan.get(name)
        hit = (entry is not None and entry.fires(self.rng)) or (p > 0 and self.rng.random() < p)
        if hit:
            self.counts[name] += 1
        return hit

    def _latency(self, bounds: tuple[int, int]) -> int:
        lo, hi = bounds
        if hi <= 0:
            return 0
        d = self.rng.randint(lo, hi)
        return d * 10 if self.profile.p_slow and self.rng.random() < self.profile.p_slow else d

    def send(self, rank: int, frame: bytes) -> None:
        self._flush_out()
        p = self.profile
        before, after = _points(frame_kinds(frame)) if self._frame_points else ((), ())
        for point in before:
            self._crash(point)
        if self._fires("send-raise", p.p_send_raise):
            self.raised.setdefault(frame, self.clock())
            raise AdapterError("injected: send_notif raised before sending", op="send_notif", peer=rank)
        self.raised.pop(frame, None)
        if self._lost_or_late(rank, frame):
            return
        copies = [frame, frame] if self._fires("dup", p.p_dup) else [frame]
        if self._fires("corrupt", p.p_corrupt):
            i = self.rng.randrange(len(frame))
            copies.append(frame[:i] + bytes([frame[i] ^ (1 << self.rng.randrange(8))]) + frame[i + 1 :])
        for frame in copies:
            delay = self._latency(p.frame_delay_ns)
            if delay:
                self._order += 1
                heapq.heappush(self._out, (self.clock() + delay, self._order, rank, frame))
            else:
                self.inner.send(rank, frame)
        for point in after:
            self._crash(point)
        if self._fires("send-raise-after", p.p_send_raise_after):
            raise AdapterError("injected: send_notif raised after sending", op="send_notif", peer=rank)

    def _lost_or_late(self, rank: int, frame: bytes) -> bool:
        """``drop-frame`` / ``late-frame`` for one notification, ordered or carried by a WRITE: True when
        it was lost, or held back to leave ``ms`` later."""
        if self._fires("drop-frame", self.profile.p_drop):
            self.counts[f"dropped_{_kinds_label(frame_kinds(frame))}"] += 1
            return True
        late = self.plan.get("late-frame")
        if late is not None and late.fires(self.rng):
            self.counts[f"late_{_kinds_label(frame_kinds(frame))}"] += 1
            self._order += 1
            heapq.heappush(self._out, (self.clock() + late.ms * 1_000_000, self._order, rank, frame))
            return True
        return False

    def _send_notif(self, rank: int, frame: bytes) -> None:
        """A WRITE's notification: lost or late as a control frame can be, with a frame's latency (NIXL
        orders it against no other notification) and, with ``p_dup``, delivered twice (a replay: the
        receiver must count it once)."""
        p = self.profile
        if self._lost_or_late(rank, frame):
            return
        copies = 2 if self._fires("dup-carried", p.p_dup) else 1
        for _ in range(copies):
            delay = self._latency(p.frame_delay_ns)
            if delay:
                self._order += 1
                heapq.heappush(self._out, (self.clock() + delay, self._order, rank, frame))
            else:
                try:
                    self.inner.send(rank, frame)
                except AdapterError:
                    self.counts["notif-lost"] += 1
        if self._frame_points:
            for point in _points(frame_kinds(frame))[1]:  # a carried KV_RESULT was just sent
                self._crash(point)

    def _flush_out(self) -> None:
        now = self.clock()
        while self._out and self._out[0][0] <= now:
            _, _, rank, frame = heapq.heappop(self._out)
            self.inner.send(rank, frame)

    def receive(self) -> list[tuple[int | None, bytes]]:
        self._flush_out()
        if self._fires("receive-raise", self.profile.p_receive_raise):
            raise AdapterError("injected: get_new_notifs raised", op="get_new_notifs")
        arrived = self.inner.receive()
        slow = self.plan.get("slow-control")
        if slow is None and not self._in:
            return arrived
        now = self.clock()
        delay_ns = slow.ms * 1_000_000 if slow is not None else 0
        self._in.extend((now + delay_ns, src, frame) for src, frame in arrived)
        out = []
        while self._in and self._in[0][0] <= now:  # the order of arrival is kept
            _, src, frame = self._in.popleft()
            out.append((src, frame))
        return out

    # ---- writes ---------------------------------------------------------------------------------

    def write(self, actions: Sequence[PostWrite], local_aux_slot: int, notif: bytes | None = None) -> WriteOutcome:
        self._flush_out()
        p, now = self.profile, self.clock()
        if self._fires("not-posted", p.p_not_posted):
            return NotPosted("injected: refused before posting")
        fate = _Write(now + self._latency(p.write_ns))
        slow = self.plan.get("slow-writer")
        if slow is not None and slow.fires(self.rng):
            self.counts["slow-writer"] += 1
            delay_ms = self.rng.uniform(0, slow.ms) if slow.pct is not None else slow.ms
            fate.due_ns = now + int(delay_ms * 1_000_000)
        if self._fires("stuck-writer", p.p_stall):
            fate.stuck = True
        elif self._fires("write-error", p.p_write_error):
            fate.error_until_ns = fate.due_ns + self._latency(p.write_ns) * 4
            fate.settles = self.rng.random() < p.p_late_done
        raises = self._fires("post-raises", p.p_post_raises)
        outcome = self.inner.write(actions, local_aux_slot)  # rule 3: the notification is ours to send
        if isinstance(outcome, NotPosted):
            return outcome
        if notif is not None and not (fate.stuck or fate.error_until_ns is not None or raises):
            fate.notif = (actions[0].receiver_rank, notif)
        self._writes[id(outcome.handle)] = fate
        if isinstance(outcome, Posted) and raises:
            return InDoubt(outcome.handle, "injected: transfer() raised after posting")
        if isinstance(outcome, Posted):
            self._crash("write-posted")
        return outcome

    def poll(self, handle: Any) -> WriteStatus:
        fate = self._writes.get(id(handle))
        if fate is None:
            return self.inner.poll(handle)
        now = self.clock()
        if fate.stuck or now < fate.due_ns:
            return WriteStatus.IN_FLIGHT
        if fate.error_until_ns is not None and (now < fate.error_until_ns or not fate.settles):
            return WriteStatus.IN_DOUBT
        status = self.inner.poll(handle)  # rule 2: DONE only when it is really done below
        if status is WriteStatus.DONE:
            del self._writes[id(handle)]
            if fate.notif is not None:  # rule 3: the WRITE's notification leaves when it is seen done
                self._send_notif(*fate.notif)
            self._crash("write-done")
        elif status is WriteStatus.IN_DOUBT:
            fate.inner_error = True
        return status

    def release(self, handle: Any) -> None:
        if self._fires("release-raise", self.profile.p_release_raise):
            raise AdapterError("injected: release_xfer_handle raised", op="release_xfer_handle")
        self.inner.release(handle)

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()

    def __getattr__(self, name: str) -> Any:  # peers, info, endpoint, ...: the inner transport's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
