"""In-process fake of the NIXL library, behind the real adapter, with fault injection.

Owns: ``FakeFabric`` (the shared "network" that connects fake agents by name, holds injected faults
and late "ghost" writes) and ``FakeNixlEndpoint`` (makes a ``NixlEndpoint`` whose library is a fake agent).
It replaces the *library*, not the adapter (contract tests run against both): docs/design.md section 13.

Rules:
  1. Addresses are real: a landing WRITE copies bytes (``ctypes.memmove``). DRAM only: registering VRAM
     fails as NIXL does without CUDA-aware UCX.
  2. Peer metadata is a snapshot, as in NIXL: memory a peer registers after ``metadata()`` is unknown
     to us until its metadata is loaded again.
  3. Completion is driven by the initiator's polls (``delay_polls``); late landings and delayed
     notifications are driven by *ticks*: every call on any fake agent of a fabric is one tick.
  4. A WRITE's notification is delivered only when the WRITE reports DONE (bytes landed), never for
     one that reported ERR or whose post raised, as NIXL's UCX backend does (``kvown.adapters.nixl``
     rule 7; real NIXL may deliver it one check earlier: safety never depends on the gap).
  5. Fault knobs (``WriteFault``, ``NotifFault``) are consumed in FIFO order by the first matching
     post / notification; each applies ``count`` times.
  6. What real NIXL does that a naive fake would not is reachable by a knob each (design.md 13).

Invariants:
  INV-FAKE-1  A write reported DONE has landed all its bytes and will never land again.
  INV-FAKE-2  A write whose fault says ``land_after_ticks=k`` lands exactly once, k ticks after its
              failure was first reported, even if its handle was released in between ("in doubt").
"""

from __future__ import annotations

import ctypes
import enum
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvown.adapters.nixl import NixlEndpoint
from kvown.core.errors import AdapterError, ConfigError

_MD_MAGIC = b"KVOWN-FAKE-NIXL/1\n"


class FaultPoint(enum.Enum):
    """Where an injected WRITE fault strikes."""

    NONE = "none"  # the post succeeds; ``outcome`` decides the polls
    PREP = "prep"  # initialize_xfer / make_prepped_xfer raise: nothing posted
    POST_RAISES = "post_raises"  # transfer() raises after handing the WRITE to the "wire": in doubt
    POST_ERR = "post_err"  # transfer() returns "ERR"; every poll says "ERR"


class FakeOutcome(enum.Enum):
    """What check_xfer_state says once ``delay_polls`` polls have returned "PROC"."""

    DONE = "done"
    ERR = "err"
    RAISE = "raise"  # check_xfer_state raises (each time)
    ERR_THEN_DONE = "err_then_done"  # "ERR" for ``err_polls`` polls, then "DONE" (bytes land then)


@dataclass
class WriteFault:
    """One injected WRITE behaviour. ``src``/``dst`` filter by agent name (None matches any).

    ``land_after_ticks``: for failing outcomes, when the bytes land anyway: None never, 0 at once when
    the failure is first reported, k > 0 that many fabric ticks later (even after release). An outcome
    of DONE always lands by the DONE poll.
    """

    src: str | None = None
    dst: str | None = None
    count: int = 1
    at: FaultPoint = FaultPoint.NONE
    delay_polls: int = 1
    outcome: FakeOutcome = FakeOutcome.DONE
    land_after_ticks: int | None = None
    err_polls: int = 1  # ERR_THEN_DONE: how many polls say "ERR" before "DONE"

    def __post_init__(self) -> None:
        if self.count < 1 or self.delay_polls < 0:
            raise ConfigError("WriteFault needs count >= 1 and delay_polls >= 0", field="count")
        if self.land_after_ticks is not None and self.land_after_ticks < 0:
            raise ConfigError("land_after_ticks must be None or >= 0", field="land_after_ticks")


@dataclass
class NotifFault:
    """One injected notification behaviour: drop it, hide it from ``delay_drains`` drains, deliver it
    twice, or make ``send_notif`` raise after delivering it (``raise_after``) or instead (``raise_before``).
    ``in_flight``: NIXL's genNotif returned but UCX has not sent it: it leaves only when the *sender* is
    progressed next (``get_new_notifs`` / ``check_xfer_state``: no progress thread), and dropping its
    peer first (``remove_remote_agent``, what ``close`` does) cancels it - UCX completes it with
    status -16, NIXL's callback only logs, the frame is lost (docs/design.md section 16)."""

    src: str | None = None
    dst: str | None = None
    count: int = 1
    drop: bool = False
    delay_drains: int = 0
    dup: bool = False
    raise_after: bool = False
    raise_before: bool = False
    in_flight: bool = False


class _Xfer:
    __slots__ = ("src", "dst", "pieces", "notif", "fault", "polls", "landed", "finished", "failed_seen", "err_seen")

    def __init__(self, src: str, dst: str, pieces: list[tuple[int, int, int]], notif: bytes,
                 fault: WriteFault) -> None:
        self.src, self.dst, self.pieces, self.notif, self.fault = src, dst, pieces, notif, fault
        self.polls = 0
        self.landed = False
        self.finished = False  # reported DONE
        self.failed_seen = False  # a failure was reported and its late landing scheduled
        self.err_seen = 0  # ERR_THEN_DONE: "ERR" answers given so far


class _Dlist:
    __slots__ = ("rows", "agent")

    def __init__(self, rows: list[tuple[int, int]], agent: str | None) -> None:
        self.rows, self.agent = rows, agent


class FakeFabric:
    """The in-process "network" shared by fake endpoints. Not thread-safe (like the endpoints).

    Called: created once per test / simulated world; knobs set by the test between steps.
    """

    def __init__(self, default_delay_polls: int = 1, *, rng: Any = None, p_land_at_post: float = 0.0,
                 record_posted: bool = True) -> None:
        self.default_delay_polls = default_delay_polls
        self.write_faults: list[WriteFault] = []
        self.notif_faults: list[NotifFault] = []
        self.ticks = 0
        self.fail_get_notifs = 0  # the next N get_new_notifs calls raise
        self.fail_release = 0  # the next N release_xfer_handle calls raise
        self.rng = rng  # with p_land_at_post: a WRITE's bytes land inside transfer() (UCX cma)
        self.p_land_at_post = p_land_at_post
        self._xfers: list[_Xfer] = []  # every posted WRITE not yet reported DONE (for oracles)
        self._xfers_pruned_len = 0  # len(_xfers) after its last pruning (amortized: never a leak)
        self.record_posted = record_posted  # False: nobody calls take_posted (a benchmark), keep none
        self._posted: list[_Xfer] = []  # WRITEs posted since the last take_posted() (for oracles)
        self._agents: dict[str, _FakeAgent] = {}
        self._ghosts: list[list[Any]] = []  # [ticks_left, _Xfer]: failed writes still to land
        self.canceled_notifs = 0  # in-flight notifications canceled by dropping their peer (UCX -16)
        self.notifs_per_progress: int | None = None  # in-flight notifications one progress call sends
        self.wall_ns_per_tick = 1_000_000  # > 1 ms: wall time passes faster than the endpoints' CPU time

    def clock_ns(self) -> int:
        """The fabric's own clock for the endpoints' bounded waits: every call on any agent is 1 ms of
        CPU and ``wall_ns_per_tick`` of wall time (more than 1 ms: the process is starved)."""
        return self.ticks * self.wall_ns_per_tick

    def cpu_clock_ns(self) -> int:
        """The endpoints' thread CPU clock: 1 ms per call on any agent."""
        return self.ticks * 1_000_000

    def agent(self, name: str) -> _FakeAgent:
        """The fake agent named ``name`` on this fabric (what an endpoint registered, for test oracles);
        ``KeyError`` when no endpoint of that name is open."""
        return self._agents[name]

    def inject_write(self, fault: WriteFault) -> None:
        self.write_faults.append(fault)

    def inject_notif(self, fault: NotifFault) -> None:
        self.notif_faults.append(fault)

    def unfinished_writes(self) -> list[tuple[str, str, list[tuple[int, int, int]]]]:
        """(src agent, dst agent, pieces) of every posted WRITE not reported DONE: each may still touch
        its destination (a failed one is in doubt, whatever its fate). For simulator oracles."""
        self._prune_xfers()
        return [(x.src, x.dst, x.pieces) for x in self._xfers]

    def take_posted(self) -> list[tuple[str, list[tuple[int, int, int]]]]:
        """(src agent, pieces) of every WRITE created since the last call. For simulator oracles."""
        posted, self._posted = self._posted, []
        return [(x.src, x.pieces) for x in posted]

    @property
    def tracked_writes(self) -> int:
        """Posted WRITEs the fabric still keeps: the unfinished ones, plus finished ones not yet pruned
        (pruned whenever the list doubles, so a long run holds O(in flight), never every WRITE)."""
        return len(self._xfers)

    @property
    def pending_ghosts(self) -> int:
        """Failed WRITEs whose bytes have not landed yet but will."""
        return len(self._ghosts)

    def land_all(self) -> int:
        """Land every pending ghost write now; returns how many landed."""
        ghosts, self._ghosts = self._ghosts, []
        for _, x in ghosts:
            _land(x)
        return len(ghosts)

    # -- internal
    def _prune_xfers(self) -> None:
        self._xfers = [x for x in self._xfers if not x.finished]
        self._xfers_pruned_len = len(self._xfers)

    def _tick(self) -> None:
        self.ticks += 1
        still = []
        for ghost in self._ghosts:
            ghost[0] -= 1
            if ghost[0] <= 0:
                _land(ghost[1])
            else:
                still.append(ghost)
        self._ghosts = still

    def _schedule(self, x: _Xfer, ticks: int | None) -> None:
        if ticks is None or x.landed:
            return
        if ticks == 0:
            _land(x)
        else:
            self._ghosts.append([ticks, x])

    def _take_write_fault(self, src: str, dst: str) -> WriteFault:
        for f in self.write_faults:
            if f.src in (None, src) and f.dst in (None, dst):
                f.count -= 1
                if f.count == 0:
                    self.write_faults.remove(f)
                return f
        return WriteFault(delay_polls=self.default_delay_polls)

    def _take_notif_fault(self, src: str, dst: str) -> NotifFault | None:
        for f in self.notif_faults:
            if f.src in (None, src) and f.dst in (None, dst):
                f.count -= 1
                if f.count == 0:
                    self.notif_faults.remove(f)
                return f
        return None

    def _deliver(self, src: str, dst: str, payload: bytes, fault: NotifFault | None = None) -> None:
        target = self._agents.get(dst)
        if target is None or (fault is not None and fault.drop):
            return  # the peer is gone, or the frame was lost on the wire
        delay = fault.delay_drains if fault is not None else 0
        for _ in range(2 if fault is not None and fault.dup else 1):
            target.inbox.append([delay, src, bytes(payload)])


def _land(x: _Xfer) -> None:
    if x.landed:
        return
    x.landed = True
    for laddr, raddr, nbytes in x.pieces:
        ctypes.memmove(raddr, laddr, nbytes)


def _rows(descs: Any) -> list[tuple[int, int]]:
    """(addr, nbytes) rows of an Nx3 array or a list of 3-tuples."""
    if isinstance(descs, np.ndarray):
        return descs[:, :2].tolist()  # [addr, nbytes] lists unpack like tuples
    return [(int(a), int(n)) for a, n, _ in descs]


def _covered(rows: list[tuple[int, int]], regions: list[tuple[int, int]]) -> bool:
    if len(regions) == 1:  # the common case, checked without a per-row scan of the regions
        (a, rn), = regions
        return all(a <= addr and addr + n <= a + rn for addr, n in rows)
    return all(any(a <= addr and addr + n <= a + rn for a, rn in regions) for addr, n in rows)


class _FakeAgent:
    """Imitates the ``nixl_agent`` calls the adapter makes. Raises ``RuntimeError`` where NIXL raises."""

    def __init__(self, name: str, fabric: FakeFabric) -> None:
        self.name = name
        self.fabric = fabric
        self.regions: dict[int, tuple[int, int, str]] = {}  # token -> (addr, nbytes, mem)
        self.peer_regions: dict[str, list[tuple[int, int]]] = {}
        self.inbox: list[list[Any]] = []
        self.outbox: list[tuple[str, bytes, NotifFault]] = []  # accepted, not sent (NotifFault.in_flight)
        self._tokens = 0

    def _local_regions(self) -> list[tuple[int, int]]:
        return [(a, n) for a, n, _ in self.regions.values()]

    # -- memory and metadata
    def register_memory(self, reg_list: list[tuple[int, int, int, str]], mem: str) -> int:
        self.fabric._tick()
        if mem != "DRAM":
            raise RuntimeError("NIXL_ERR_BACKEND: fake fabric moves host memory only")
        (addr, nbytes, _dev, _meta), = reg_list
        self._tokens += 1
        self.regions[self._tokens] = (addr, nbytes, mem)
        return self._tokens

    def deregister_memory(self, token: int) -> None:
        self.fabric._tick()
        del self.regions[token]

    def get_agent_metadata(self) -> bytes:
        self.fabric._tick()
        body = {"name": self.name, "regions": self._local_regions()}
        return _MD_MAGIC + json.dumps(body).encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self.fabric._tick()
        if not bytes(metadata).startswith(_MD_MAGIC):
            raise RuntimeError("NIXL_ERR_MISMATCH: failed to deserialize remote metadata")
        try:
            body = json.loads(bytes(metadata)[len(_MD_MAGIC):])
            name = str(body["name"])
            regions = [(int(a), int(n)) for a, n in body["regions"]]
        except (ValueError, KeyError, TypeError) as e:
            raise RuntimeError("NIXL_ERR_MISMATCH: failed to deserialize remote metadata") from e
        if name == self.name:
            raise RuntimeError("NIXL_ERR_INVALID_PARAM: remote agent name same as local agent")
        self.peer_regions[name] = regions
        return name.encode()

    def remove_remote_agent(self, name: str) -> None:
        self.fabric._tick()
        self.peer_regions.pop(name, None)
        kept = [item for item in self.outbox if item[0] != name]
        self.fabric.canceled_notifs += len(self.outbox) - len(kept)  # the UCX endpoint closed under them
        self.outbox = kept

    def _progress(self) -> None:
        """What a progress call of the sender's UCX worker does for its accepted notifications."""
        n = len(self.outbox) if self.fabric.notifs_per_progress is None else self.fabric.notifs_per_progress
        out, self.outbox = self.outbox[:n], self.outbox[n:]
        for peer, payload, fault in out:
            self.fabric._deliver(self.name, peer, payload, fault)

    # -- descriptors and transfers
    def get_xfer_descs(self, descs: Any, mem: str) -> _Dlist:  # Nx3 array or list of 3-tuples
        if mem != "DRAM":
            raise RuntimeError("NIXL_ERR_BACKEND: fake fabric moves host memory only")
        return _Dlist(_rows(descs), None)

    def _check_sides(self, lrows: list[tuple[int, int]], rrows: list[tuple[int, int]], peer: str) -> None:
        if peer not in self.peer_regions:
            raise RuntimeError(f"NIXL_ERR_NOT_FOUND: metadata for remote agent {peer!r} not found")
        if not _covered(lrows, self._local_regions()) or not _covered(rrows, self.peer_regions[peer]):
            raise RuntimeError("NIXL_ERR_NOT_FOUND: no backend had the required registrations")
        if [n for _, n in lrows] != [n for _, n in rrows]:
            raise RuntimeError("NIXL_ERR_INVALID_PARAM: descriptor lengths differ")

    def _new_xfer(self, lrows: list[tuple[int, int]], rrows: list[tuple[int, int]], peer: str,
                  notif: bytes) -> _Xfer:
        fault = self.fabric._take_write_fault(self.name, peer)
        if fault.at is FaultPoint.PREP:
            raise RuntimeError("NIXL_ERR_BACKEND: injected failure preparing the transfer")
        pieces = [(la, ra, n) for (la, n), (ra, _) in zip(lrows, rrows)]
        x = _Xfer(self.name, peer, pieces, bytes(notif), fault)
        fabric = self.fabric
        fabric._xfers.append(x)
        if len(fabric._xfers) > 2 * fabric._xfers_pruned_len + 64:
            fabric._prune_xfers()
        if fabric.record_posted:
            fabric._posted.append(x)
        return x

    def initialize_xfer(self, op: str, ldl: _Dlist, rdl: _Dlist, peer: str, notif: bytes = b"") -> _Xfer:
        self.fabric._tick()
        assert op == "WRITE"
        self._check_sides(ldl.rows, rdl.rows, peer)
        return self._new_xfer(ldl.rows, rdl.rows, peer, notif)

    def prep_xfer_dlist(self, agent: str, descs: np.ndarray, mem: str) -> _Dlist:
        self.fabric._tick()
        if mem != "DRAM":
            raise RuntimeError("NIXL_ERR_BACKEND: fake fabric moves host memory only")
        rows = _rows(descs)
        local = agent == "NIXL_INIT_AGENT"
        if not local and agent not in self.peer_regions:
            raise RuntimeError(f"NIXL_ERR_NOT_FOUND: metadata for remote agent {agent!r} not found")
        regions = self._local_regions() if local else self.peer_regions[agent]
        if not _covered(rows, regions):
            raise RuntimeError("NIXL_ERR_NOT_FOUND: failed to prepare the descriptors")
        return _Dlist(rows, None if local else agent)

    def release_dlist_handle(self, dl: _Dlist) -> None:
        self.fabric._tick()

    def make_prepped_xfer(self, op: str, lp: _Dlist, li: np.ndarray, rp: _Dlist, ri: np.ndarray,
                          notif: bytes = b"") -> _Xfer:
        self.fabric._tick()
        assert op == "WRITE" and rp.agent is not None
        lrows = [lp.rows[i] for i in (li.tolist() if hasattr(li, "tolist") else li)]  # NIXL takes either
        rrows = [rp.rows[i] for i in (ri.tolist() if hasattr(ri, "tolist") else ri)]
        self._check_sides(lrows, rrows, rp.agent)
        return self._new_xfer(lrows, rrows, rp.agent, notif)

    def transfer(self, x: _Xfer) -> str:
        self.fabric._tick()
        f = x.fault
        if x.dst not in self.fabric._agents:
            x.fault = WriteFault(at=FaultPoint.POST_ERR)
            return "ERR"
        if f.at is FaultPoint.POST_RAISES:
            self.fabric._schedule(x, f.land_after_ticks)
            raise RuntimeError("NIXL_ERR_BACKEND: injected failure inside postXferReq")
        if f.at is FaultPoint.POST_ERR:
            x.failed_seen = True
            self.fabric._schedule(x, f.land_after_ticks)
            return "ERR"
        fabric = self.fabric
        if fabric.rng is not None and fabric.p_land_at_post and fabric.rng.random() < fabric.p_land_at_post:
            _land(x)  # the copy happens inside the post (cma); completion is still reported later
        if f.delay_polls == 0 and f.outcome is FakeOutcome.DONE:
            self._finish(x)
            return "DONE"
        return "PROC"

    def check_xfer_state(self, x: _Xfer) -> str:
        self.fabric._tick()
        self._progress()
        if x.finished:
            return "DONE"
        f = x.fault
        if f.at is FaultPoint.POST_ERR:
            return "ERR"
        x.polls += 1
        if x.polls <= f.delay_polls:
            return "PROC"
        if f.outcome is FakeOutcome.DONE or (f.outcome is FakeOutcome.ERR_THEN_DONE and x.err_seen >= f.err_polls):
            self._finish(x)
            return "DONE"
        if f.outcome is FakeOutcome.ERR_THEN_DONE:
            x.err_seen += 1
            return "ERR"
        if not x.failed_seen:
            x.failed_seen = True
            self.fabric._schedule(x, f.land_after_ticks)
        if f.outcome is FakeOutcome.RAISE:
            raise RuntimeError("NIXL_ERR_BACKEND: injected failure in getXferStatus")
        return "ERR"

    def _finish(self, x: _Xfer) -> None:
        _land(x)  # INV-FAKE-1: DONE means every byte is in place
        self.fabric._ghosts = [g for g in self.fabric._ghosts if g[1] is not x]
        x.finished = True
        errored = x.failed_seen or x.err_seen or x.fault.at is not FaultPoint.NONE
        if x.notif and not errored:  # rule 4: NIXL drops the notification of a transfer that errored
            self.fabric._deliver(x.src, x.dst, x.notif, self.fabric._take_notif_fault(x.src, x.dst))

    def release_xfer_handle(self, x: _Xfer) -> None:
        self.fabric._tick()
        if self.fabric.fail_release > 0:
            self.fabric.fail_release -= 1
            raise RuntimeError("NIXL_ERR_BACKEND: injected failure releasing the handle")
        if not x.finished and not x.failed_seen and x.err_seen == 0 and x.fault.at is FaultPoint.NONE:
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE: transfer still in progress")
        # A released failed write may still land later: its ghost stays scheduled (INV-FAKE-2).

    # -- notifications
    def send_notif(self, peer: str, payload: bytes) -> None:
        self.fabric._tick()
        if peer not in self.peer_regions:
            raise RuntimeError("NIXL_ERR_NOT_FOUND: no backend could send the notification")
        fault = self.fabric._take_notif_fault(self.name, peer)
        if fault is not None and fault.raise_before:
            raise RuntimeError("NIXL_ERR_BACKEND: injected failure before sending the notification")
        if fault is not None and fault.in_flight:
            self.outbox.append((peer, bytes(payload), fault))
            return
        self.fabric._deliver(self.name, peer, payload, fault)
        if fault is not None and fault.raise_after:
            raise RuntimeError("NIXL_ERR_BACKEND: injected failure after the notification left")

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        self.fabric._tick()
        if self.fabric.fail_get_notifs > 0:
            self.fabric.fail_get_notifs -= 1
            raise RuntimeError("NIXL_ERR_BACKEND: injected failure in getNotifs")
        self._progress()
        out: dict[str, list[bytes]] = {}
        keep = []
        for item in self.inbox:
            if item[0] > 0:
                item[0] -= 1
                keep.append(item)
            else:
                out.setdefault(item[1], []).append(item[2])
        self.inbox = keep
        return out


def FakeNixlEndpoint(name: str, *, fabric: FakeFabric,
                     agent_type: type[_FakeAgent] | None = None) -> NixlEndpoint:
    """A ``NixlEndpoint`` whose library is a fake agent (``agent_type``, default ``_FakeAgent``) on
    ``fabric``; closing it takes the agent off the fabric. A factory, not a subclass: the compiled
    endpoint takes no interpreted subclasses, so the fake enters at the adapter's seam, its agent.

    Called: in tests and the simulator, one thread per fabric.
    """
    if name in fabric._agents:
        raise AdapterError("agent name already on this fake fabric", op="create_agent", name=name)
    agent = fabric._agents[name] = (agent_type or _FakeAgent)(name, fabric)
    return NixlEndpoint(name, clock=fabric.clock_ns, cpu_clock=fabric.cpu_clock_ns, agent=agent,
                        on_close=lambda: fabric._agents.pop(name, None))


__all__ = ["FakeFabric", "FakeNixlEndpoint", "FakeOutcome", "FaultPoint", "NotifFault", "WriteFault"]
