"""NIXL data-plane adapter: one NIXL agent per rank, translated into kvown's vocabulary.

Owns: the rank's NIXL agent, registrations, loaded peers, prepped lists and posted handles until released;
no ``nixl`` object or quirk leaves this module (why: docs/design.md section 14).

Rules:
  1. One thread per endpoint (no progress thread by default): nothing moves unless polled (``drain_notifs``).
  2. A library result is one kvown value: ``poll`` an ``XferStatus``, a failure ``AdapterError(op, cause)``.
  3. A failed post says ``AdapterError(posted=False)`` (nothing can touch memory) before ``transfer()``,
     ``posted=None, handle=...`` (in doubt; the handle stays rooted) inside it.
  4. DONE is the only proof of quiescence, and terminal; ERROR is not: ``poll`` keeps asking after it.
  5. Releasing is not a fence: ``release`` is refused until the handle reached DONE or ERROR.
  6. Descriptor count is the cost: ``post_write`` coalesces pairs contiguous on both sides, prepped
     posts let NIXL merge index runs, and short index lists (<= 64) skip numpy.
  7. NIXL sends a WRITE's notification (``notif``) only after its data and endpoint flush completed,
     never after an error: its arrival proves the bytes landed and the WRITE touches them no more.
  8. The library is the seam: an endpoint drives the agent it is given (a fake), else NIXL's; no subclass.
  9. A wrong value in a public parameter is ``LocalProtocolError`` naming it, in both builds (``_check_*``).

Invariants:
  INV-NX-1  Every posted, unreleased handle is rooted in ``_live``: NIXL's finalizer (a cancel) never runs.
  INV-NX-2  A handle leaves ``_live`` only through ``release`` after DONE or ERROR was observed.
  INV-NX-3  ``close`` deregisters memory only when ``_live`` is empty.
  INV-NX-4  A ``XferStatus.DONE`` handle never reports anything else afterwards.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from collections.abc import Iterable, Sequence
from typing import Any, Callable

import numpy as np

from kvown.core.errors import AdapterError, LocalProtocolError

# Largest notification payload kvown sends. Measured here: payloads up to 16 MiB arrive intact, in one
# process and across two processes over tcp/lo; 1 MiB keeps a margin and still carries block tables of
# hundreds of thousands of int32s.
MAX_NOTIF_NBYTES = 1 << 20
# close() first progresses the agent for this much of its own thread's CPU when it ever sent a
# notification: NIXL's genNotif returns once UCX accepted one, which leaves only while the worker is
# progressed, and closing cancels what is still in flight (docs/design.md section 16). CPU time, not wall
# time: a starved thread gets the same progress as a quiet one; CLOSE_FLUSH_MAX_S of wall time bounds it.
CLOSE_FLUSH_S = 0.05
CLOSE_FLUSH_MAX_S = 2.0


def _monotonic_ns() -> int:
    return time.monotonic_ns()  # looked up per call, so a test's clock guard sees it


_INIT_AGENT = "NIXL_INIT_AGENT"  # NIXL's name for "the local side" in prep_xfer_dlist


class MemKind(enum.Enum):
    """Memory segment kind, with NIXL's segment name as the value."""

    __hash__ = object.__hash__  # members are singletons: C-level hashing (enum's is Python)

    DRAM = "DRAM"
    VRAM = "VRAM"


class XferStatus(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: C-level hashing (enum's is Python)

    IN_PROGRESS = "in_progress"
    DONE = "done"  # positive proof: the backend stopped touching both buffers
    ERROR = "error"  # in doubt: no proof; bytes may still land


@dataclass(frozen=True, slots=True)
class Region:
    """A registered memory range. Returned by ``register``; kept by the endpoint until ``close``."""

    addr: int
    nbytes: int
    mem: MemKind
    device_id: int = 0


@dataclass(eq=False)
class PreppedBlocks:
    """A prepped descriptor list: entry ``i`` is ``sizes[i]`` bytes at ``addrs[i]``.

    ``prep_blocks`` makes the common case (``num_blocks`` equal blocks at ``base + i * stride``);
    ``prep_descs`` any list, e.g. one chunk of every block in each of several regions.
    ``peer`` is None for the local side of a transfer, else the peer agent whose memory it names.
    """

    addrs: np.ndarray  # uint64
    sizes: np.ndarray  # int64
    mem: MemKind
    device_id: int
    peer: str | None
    _lib: Any = field(repr=False, default=None)
    released: bool = False
    count: int = 0  # number of entries (set by prep_descs)
    uniform_nbytes: int = 0  # every entry's size when all are equal, else 0 (the list fast path)

    @property
    def num_blocks(self) -> int:
        """Number of entries (indices passed to ``post_write_blocks`` must be below it)."""
        return int(self.sizes.size)


class XferHandle:
    """One posted WRITE. ``status`` is the last status observed; ``error`` the last library failure.

    ``posted`` is True when ``transfer()`` returned, None when it raised (in doubt).
    """

    __slots__ = ("xfer_id", "peer", "nbytes", "num_descs", "status", "error", "posted", "released",
                 "_lib", "_owner")

    def __init__(self, xfer_id: int, peer: str, nbytes: int, num_descs: int, lib: Any, owner: object):
        self.xfer_id = xfer_id
        self.peer = peer
        self.nbytes = nbytes
        self.num_descs = num_descs
        self.status = XferStatus.IN_PROGRESS
        self.error: BaseException | None = None
        self.posted: bool | None = None
        self.released = False
        self._lib = lib
        self._owner = owner

    def __repr__(self) -> str:
        return (f"XferHandle(id={self.xfer_id}, peer={self.peer!r}, nbytes={self.nbytes}, "
                f"descs={self.num_descs}, status={self.status.name}, released={self.released})")


# ----------------------------------------------------------------------------- pure descriptor helpers


def coalesce(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge ``(addr, nbytes)`` ranges that are adjacent in the given order.

    Called: by descriptor builders, any thread (pure). Order is kept: ranges are merged only when one
    ends exactly where the next begins, never sorted, because the pairing with the other side of a
    transfer depends on order.
    """
    out: list[tuple[int, int]] = []
    for addr, nbytes in ranges:
        if out and out[-1][0] + out[-1][1] == addr:
            out[-1] = (out[-1][0], out[-1][1] + nbytes)
        else:
            out.append((addr, nbytes))
    return out


def pair_ranges(
    local: Sequence[tuple[int, int]] | np.ndarray,
    remote: Sequence[tuple[int, int]] | np.ndarray,
    local_breaks: Iterable[int] = (),
) -> list[tuple[int, int, int]]:
    """Pair local and remote ranges byte for byte into ``(local_addr, remote_addr, nbytes)`` pieces.

    Called: by ``post_write``, once per post (pure). The two sides may be split differently (one 8 KiB
    local range against two 4 KiB remote ranges); pieces are cut where either side has a boundary, then
    neighbouring pieces are merged when they are contiguous on BOTH sides and the local junction is not
    in ``local_breaks`` (the start/end addresses of local registrations). Raises ``LocalProtocolError``
    when the totals differ or a range is empty or negative. Inputs may be Nx2 integer arrays.
    """
    if _is_small(local, remote):
        return _pair_small(local, remote, set(local_breaks))  # type: ignore[arg-type]
    la, ra, n = _pair_arrays(local, remote, local_breaks)
    return list(zip(la.tolist(), ra.tolist(), n.tolist(), strict=True))


_SMALL_RANGES = 16  # below this a plain loop beats numpy's fixed per-call overheads (~15 us)


def _is_small(local: Any, remote: Any) -> bool:
    return (not isinstance(local, np.ndarray) and not isinstance(remote, np.ndarray)
            and len(local) <= _SMALL_RANGES and len(remote) <= _SMALL_RANGES)


def _pair_small(
    local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]], breaks: set[int]
) -> list[tuple[int, int, int]]:
    """The same pairing as ``_pair_arrays`` as a plain loop (the tests check that they agree)."""
    for side, ranges in (("local", local), ("remote", remote)):
        if len(ranges) == 0:
            raise LocalProtocolError("no ranges to transfer", field=side)
        for rng in ranges:
            if len(rng) != 2 or rng[0] < 0 or rng[1] <= 0:
                raise LocalProtocolError("range must have addr >= 0 and nbytes > 0", field=side)
    local_total, remote_total = sum(n for _, n in local), sum(n for _, n in remote)
    if local_total != remote_total:
        raise LocalProtocolError("local and remote ranges differ in total length", field="remote",
                                 local_nbytes=local_total, remote_nbytes=remote_total)
    pieces: list[tuple[int, int, int]] = []
    li = ri = loff = roff = 0
    while li < len(local):
        (laddr, lnb), (raddr, rnb) = local[li], remote[ri]
        take = min(lnb - loff, rnb - roff)
        la, ra = laddr + loff, raddr + roff
        prev = pieces[-1] if pieces else None
        if prev and prev[0] + prev[2] == la and prev[1] + prev[2] == ra and la not in breaks:
            pieces[-1] = (prev[0], prev[1], prev[2] + take)
        else:
            pieces.append((la, ra, take))
        loff += take
        roff += take
        if loff == lnb:
            li, loff = li + 1, 0
        if roff == rnb:
            ri, roff = ri + 1, 0
    return pieces


def _as_ranges(ranges: Sequence[tuple[int, int]] | np.ndarray, side: str) -> np.ndarray:
    try:
        if isinstance(ranges, np.ndarray):
            arr = ranges.astype(np.int64, copy=False)
        else:  # fromiter over the flattened pairs is ~2x faster than np.asarray on a list of tuples
            flat = itertools.chain.from_iterable(ranges)
            arr = np.fromiter(flat, dtype=np.int64, count=2 * len(ranges)).reshape(-1, 2)
    except (TypeError, ValueError, OverflowError) as e:
        raise LocalProtocolError("ranges must be (addr, nbytes) integer pairs", field=side) from e
    if arr.size == 0:
        raise LocalProtocolError("no ranges to transfer", field=side)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise LocalProtocolError("ranges must be (addr, nbytes) integer pairs", field=side)
    if (arr[:, 0] < 0).any() or (arr[:, 1] <= 0).any():
        raise LocalProtocolError("range must have addr >= 0 and nbytes > 0", field=side)
    return arr


def _pair_arrays(
    local: Sequence[tuple[int, int]] | np.ndarray,
    remote: Sequence[tuple[int, int]] | np.ndarray,
    local_breaks: Iterable[int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lr, rr = _as_ranges(local, "local"), _as_ranges(remote, "remote")
    local_total, remote_total = int(lr[:, 1].sum()), int(rr[:, 1].sum())
    if local_total != remote_total:
        raise LocalProtocolError("local and remote ranges differ in total length", field="remote",
                                 local_nbytes=local_total, remote_nbytes=remote_total)
    if lr.shape != rr.shape or not np.array_equal(lr[:, 1], rr[:, 1]):
        lr, rr = _cut_to_common_pieces(lr, rr)
    # Vectorised merge: a Python loop costs about 1 us per range, as much as NIXL's per-descriptor post.
    join = (lr[:-1, 0] + lr[:-1, 1] == lr[1:, 0]) & (rr[:-1, 0] + rr[:-1, 1] == rr[1:, 0])
    breaks = np.sort(np.fromiter(local_breaks, dtype=np.int64))
    if breaks.size:
        at = lr[1:, 0]
        join &= breaks[np.minimum(np.searchsorted(breaks, at), breaks.size - 1)] != at
    starts = np.flatnonzero(np.concatenate(([True], ~join)))
    return lr[starts, 0], rr[starts, 0], np.add.reduceat(lr[:, 1], starts)


def _cut_to_common_pieces(lr: np.ndarray, rr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cut both sides at the union of their boundaries so piece i has the same length on each side."""
    lends, rends = np.cumsum(lr[:, 1]), np.cumsum(rr[:, 1])
    cuts = np.union1d(lends, rends)  # ends of the common pieces; the last one is the total
    begins = np.concatenate(([0], cuts[:-1]))
    li = np.searchsorted(lends, begins, side="right")  # the range each piece starts in
    ri = np.searchsorted(rends, begins, side="right")
    lp = np.stack([lr[li, 0] + begins - (lends[li] - lr[li, 1]), cuts - begins], axis=1)
    rp = np.stack([rr[ri, 0] + begins - (rends[ri] - rr[ri, 1]), cuts - begins], axis=1)
    return lp, rp


def _as_index_array(idx: Any, num_blocks: int, side: str) -> np.ndarray:
    arr = np.ascontiguousarray(idx, dtype=np.int32)
    if arr.ndim != 1 or arr.size == 0:
        raise LocalProtocolError("block indices must be a non-empty 1-D array", field=side)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= num_blocks:
        raise LocalProtocolError("block index out of range", field=side, min_index=lo, max_index=hi,
                                 num_blocks=num_blocks)
    return arr


_LIST_INDICES = 64  # up to this many indices a Python list is checked and passed as it is


def _check_index_list(idx: list[Any], count: int, side: str) -> None:
    if not idx:
        raise LocalProtocolError("block indices must be a non-empty 1-D array", field=side)
    for i in idx:
        if type(i) is not int:
            raise LocalProtocolError("block indices must be integers", field=side)
    lo, hi = min(idx), max(idx)
    if lo < 0 or hi >= count:
        raise LocalProtocolError("block index out of range", field=side, min_index=lo, max_index=hi,
                                 num_blocks=count)


def _status_of(text: Any) -> XferStatus | None:
    if text == "DONE":
        return XferStatus.DONE
    if text == "PROC":
        return XferStatus.IN_PROGRESS
    if text == "ERR":
        return XferStatus.ERROR
    return None


def _check_mem(mem: object, field: str) -> MemKind:
    """``mem`` narrowed to a ``MemKind``, else ``LocalProtocolError`` naming ``field`` (rule 9)."""
    if not isinstance(mem, MemKind):
        raise LocalProtocolError(f"{field} must be a MemKind", field=field, mem=mem)
    return mem


def make_agent(name: str, *, progress_thread: bool = False) -> Any:
    """NIXL's agent for ``name`` with the UCX backend; ``AdapterError(op="create_agent")`` otherwise.

    What an endpoint drives when it is given no agent; public so a caller can wrap the library (a
    benchmark's call timer) or keep a handle on it for a raw baseline, then pass it as ``agent``."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config

        cfg = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        agent = nixl_agent(name, cfg)
    except Exception as e:
        raise AdapterError("could not create the NIXL agent", cause=e, op="create_agent", name=name) from e
    if "UCX" not in getattr(agent, "backends", {"UCX": 0}):
        raise AdapterError("NIXL has no UCX backend", op="create_agent", name=name)
    return agent


# ----------------------------------------------------------------------------- endpoint


class NixlEndpoint:
    """One NIXL agent for one rank. See the module docstring for the rules."""

    def __init__(self, name: str, *, progress_thread: bool = False, clock: Callable[[], int] | None = None,
                 cpu_clock: Callable[[], int] | None = None, agent: Any = None,
                 on_close: Callable[[], None] | None = None) -> None:
        """Create the agent with the UCX backend, or drive ``agent`` (an object with the ``nixl_agent``
        calls this module makes: the fake library's seam, rule 8). ``on_close`` runs once ``close`` is done.

        Called: once per rank at startup, on the thread that will own the endpoint.
        After error: ``AdapterError(op="create_agent")``; nothing to clean up.
        """
        if not name:
            raise LocalProtocolError("endpoint name must be non-empty", field="name")
        self._name = name
        self._agent = agent if agent is not None else make_agent(name, progress_thread=progress_thread)
        self._on_close = on_close
        self._regions: dict[Region, Any] = {}
        self._breaks: set[int] = set()
        self._peers: set[str] = set()
        self._prepped: dict[int, PreppedBlocks] = {}  # id -> live prepped list (the dict holds it alive)
        self._live: dict[int, XferHandle] = {}  # INV-NX-1: the root of every unreleased handle
        self._ids = itertools.count(1)
        self._closed = False
        self._last_notif_ns: int | None = None  # when send_notif last returned (None: no flush at close)
        self._clock = clock or _monotonic_ns  # the flush's wall clock (a fake fabric passes its own)
        self._cpu_clock = cpu_clock or time.thread_time_ns  # the flush's CPU clock (the owner thread's)

    # ------------------------------------------------------------------ identity and registration

    @property
    def name(self) -> str:
        return self._name

    @property
    def live_handles(self) -> int:
        """Number of posted handles not yet released."""
        return len(self._live)

    @property
    def peers(self) -> frozenset[str]:
        return frozenset(self._peers)

    def register(self, addr: int, nbytes: int, mem: MemKind | object, device_id: int = 0) -> Region:
        """Register ``[addr, addr + nbytes)`` with NIXL. ``mem`` is checked here (``LocalProtocolError``,
        field ``mem``), not by the compiled build's argument check (a bare ``TypeError``).

        Called: at startup (KV pools, staging buffers), owner thread.
        Ownership: the caller keeps owning the memory and must keep it alive until ``close``.
        After error: ``AdapterError(op="register_memory")``; nothing was registered.
        """
        self._check_open()
        mem = _check_mem(mem, "mem")
        if addr <= 0 or nbytes <= 0:
            raise LocalProtocolError("register needs addr > 0 and nbytes > 0", field="nbytes",
                                     addr=addr, nbytes=nbytes)
        region = Region(addr, nbytes, mem, device_id)
        if region in self._regions:
            raise LocalProtocolError("region already registered", field="addr", addr=addr)
        try:
            reg = self._agent.register_memory([(addr, nbytes, device_id, "")], mem.value)
        except Exception as e:
            raise AdapterError("memory registration failed", cause=e, op="register_memory",
                               addr=addr, nbytes=nbytes, mem=mem.name) from e
        self._regions[region] = reg
        self._breaks.update((addr, addr + nbytes))
        return region

    def register_tensor(self, t: Any) -> Region:
        """Register a contiguous torch tensor: DRAM for CPU tensors, VRAM (its device index) for CUDA.

        Called: at startup, owner thread. Ownership: the caller keeps the tensor alive until ``close``.
        After error: as ``register``.
        """
        if not t.is_contiguous():
            raise LocalProtocolError("tensor must be contiguous", field="tensor")
        if t.device.type == "cpu":
            mem, device_id = MemKind.DRAM, 0
        elif t.device.type == "cuda":
            mem, device_id = MemKind.VRAM, t.device.index or 0
        else:
            raise LocalProtocolError("unsupported tensor device", field="tensor", device=str(t.device))
        return self.register(t.data_ptr(), t.numel() * t.element_size(), mem, device_id)

    def deregister(self, region: Region) -> None:
        """Deregister one region. Refused while handles are live (they may use it).

        Called: rarely (pool teardown), owner thread.
        After error: ``AdapterError(op="deregister_memory")``; the region stays registered.
        """
        self._check_open()
        if self._live:
            raise LocalProtocolError("deregister with live transfer handles", field="region",
                                     live_handles=len(self._live))
        reg = self._regions.get(region)
        if reg is None:
            raise LocalProtocolError("region is not registered here", field="region")
        try:
            self._agent.deregister_memory(reg)
        except Exception as e:
            raise AdapterError("deregistration failed", cause=e, op="deregister_memory") from e
        del self._regions[region]
        self._breaks = {a for r in self._regions for a in (r.addr, r.addr + r.nbytes)}

    # ------------------------------------------------------------------ peers

    def metadata(self) -> bytes:
        """This agent's metadata (connection info and registrations as of now), for peers to load.

        Called: at startup and after new registrations, owner thread. Exchanged by the runtime with
        ``comm.allgather`` inside one MPI world, or through ``kvown.adapters.rendezvous`` across worlds.
        """
        self._check_open()
        try:
            return bytes(self._agent.get_agent_metadata())
        except Exception as e:
            raise AdapterError("could not read agent metadata", cause=e, op="get_agent_metadata") from e

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the peer's agent name. Loading again refreshes it.

        Called: at startup / membership change, owner thread.
        After error: ``AdapterError(op="add_remote_agent")`` (malformed metadata, or our own).
        """
        self._check_open()
        try:
            raw = self._agent.add_remote_agent(metadata)
        except Exception as e:
            raise AdapterError("could not load peer metadata", cause=e, op="add_remote_agent") from e
        peer = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
        self._peers.add(peer)
        return peer

    def remove_peer(self, peer: object) -> None:
        """Drop a peer's metadata (disconnects) and release prepped lists naming its memory.

        Called: on membership change, owner thread. Refused while handles to that peer are live.
        After error: ``AdapterError(op="remove_remote_agent")``; the peer may be half removed.
        """
        self._check_open()
        peer = self._check_peer(peer)
        if any(h.peer == peer for h in self._live.values()):
            raise LocalProtocolError("remove_peer with live handles to it", field="peer", peer=peer)
        for prep in [p for p in self._prepped.values() if p.peer == peer]:
            self.release_prepped(prep)
        self._peers.discard(peer)
        try:
            self._agent.remove_remote_agent(peer)
        except Exception as e:
            raise AdapterError("could not remove peer", cause=e, op="remove_remote_agent", peer=peer) from e

    # ------------------------------------------------------------------ writes

    def post_write(
        self,
        peer: object,
        local: Sequence[tuple[int, int]],
        remote: Sequence[tuple[int, int]],
        mem: object,
        remote_mem: object = None,
        notif: object = None,
        *,
        device_id: int = 0,
        remote_device_id: int = 0,
    ) -> XferHandle:
        """Post one WRITE of the ``local`` ranges into the peer's ``remote`` ranges, coalesced.

        ``device_id`` / ``remote_device_id`` name the GPU of VRAM ranges (ignored for DRAM).

        Called: per transfer slice, owner thread.
        Ownership: from a successful return (and from ``AdapterError(posted=None)``) both buffers
        belong to the backend until ``poll`` reports DONE; the handle is rooted until ``release``.
        After error: ``posted=False``: nothing was posted, memory is untouched, retry is allowed.
        ``posted=None``: in doubt; ``error.handle`` is rooted, poll it; only DONE proves quiescence.
        """
        self._check_open()
        peer = self._check_peer(peer)
        payload = b"" if notif is None else self._check_notif(notif)  # b"": NIXL's "no notification"
        mem = _check_mem(mem, "mem")
        rmem = mem if remote_mem is None else _check_mem(remote_mem, "remote_mem")
        lrows: Any
        rrows: Any
        if _is_small(local, remote):  # lists of 3-tuples: NIXL's cheapest input for a few descriptors
            pieces = _pair_small(local, remote, self._breaks)
            lrows = [(la, n, device_id) for la, _, n in pieces]
            rrows = [(ra, n, remote_device_id) for _, ra, n in pieces]
            count, nbytes = len(pieces), sum(n for _, _, n in pieces)
        else:
            laddr, raddr, sizes = _pair_arrays(local, remote, self._breaks)
            count, nbytes = int(sizes.size), int(sizes.sum())
            lrows = np.zeros((count, 3), dtype=np.uint64)
            rrows = np.zeros((count, 3), dtype=np.uint64)
            lrows[:, 0], lrows[:, 1], lrows[:, 2] = laddr, sizes, device_id
            rrows[:, 0], rrows[:, 1], rrows[:, 2] = raddr, sizes, remote_device_id
        try:
            ldl = self._agent.get_xfer_descs(lrows, mem.value)
            rdl = self._agent.get_xfer_descs(rrows, rmem.value)
            if ldl is None or rdl is None:
                raise ValueError("NIXL refused the descriptor arrays")
            lib = self._agent.initialize_xfer("WRITE", ldl, rdl, peer, payload)
        except Exception as e:
            raise AdapterError("could not prepare the WRITE", cause=e, op="initialize_xfer",
                               posted=False, peer=peer, nbytes=nbytes) from e
        return self._post(lib, peer, nbytes, count)

    def prep_blocks(
        self,
        base_addr: int,
        block_nbytes: int,
        num_blocks: int,
        mem: MemKind,
        peer: str | None = None,
        device_id: int = 0,
        stride_nbytes: int | None = None,
    ) -> PreppedBlocks:
        """Prep a descriptor list of equal blocks once, for ``post_write_blocks`` by index.

        ``peer=None`` preps our own memory (the local side); ``peer=name`` preps that peer's memory at
        ``base_addr`` (the remote side; its metadata must be loaded). ``stride_nbytes`` defaults to
        ``block_nbytes`` (dense blocks, which NIXL can merge when indices run contiguously).
        Called: at startup / when a peer joins, owner thread (can take ms for large lists).
        After error: ``AdapterError(op="prep_xfer_dlist")``; nothing was prepped.
        """
        stride = block_nbytes if stride_nbytes is None else stride_nbytes
        if base_addr <= 0 or block_nbytes <= 0 or num_blocks <= 0 or stride < block_nbytes:
            raise LocalProtocolError("bad block geometry", field="block_nbytes", base_addr=base_addr,
                                     block_nbytes=block_nbytes, num_blocks=num_blocks, stride_nbytes=stride)
        addrs = base_addr + np.arange(num_blocks, dtype=np.uint64) * np.uint64(stride)
        return self.prep_descs(addrs, np.full(num_blocks, block_nbytes, dtype=np.int64), mem, peer, device_id)

    def prep_descs(
        self, addrs: np.ndarray, sizes: np.ndarray, mem: MemKind, peer: str | None = None, device_id: int = 0
    ) -> PreppedBlocks:
        """Prep an arbitrary descriptor list (``addrs[i]``, ``sizes[i]``). Called, After error: as above."""
        self._check_open()
        if peer is not None:
            self._check_peer(peer)
        addrs = np.ascontiguousarray(addrs, dtype=np.uint64)
        sizes = np.ascontiguousarray(sizes, dtype=np.int64)
        if addrs.ndim != 1 or addrs.shape != sizes.shape or addrs.size == 0 or (sizes <= 0).any():
            raise LocalProtocolError("descriptors need matching non-empty addrs and positive sizes", field="sizes")
        descs = np.empty((addrs.size, 3), dtype=np.uint64)
        descs[:, 0] = addrs
        descs[:, 1] = sizes
        descs[:, 2] = device_id
        try:
            lib = self._agent.prep_xfer_dlist(peer or _INIT_AGENT, descs, mem.value)
        except Exception as e:
            raise AdapterError("could not prep the descriptor list", cause=e, op="prep_xfer_dlist",
                               peer=peer, num_descs=int(addrs.size)) from e
        uniform = int(sizes[0]) if bool((sizes == sizes[0]).all()) else 0
        prep = PreppedBlocks(addrs, sizes, mem, device_id, peer, lib, count=int(addrs.size), uniform_nbytes=uniform)
        self._prepped[id(prep)] = prep
        return prep

    def release_prepped(self, prep: object) -> None:
        """Release a prepped list. Idempotent. Called: teardown or peer removal, owner thread."""
        if not isinstance(prep, PreppedBlocks):
            raise LocalProtocolError("not a prepped list", field="prep")
        if prep.released:
            return
        try:
            self._agent.release_dlist_handle(prep._lib)
        except Exception as e:
            raise AdapterError("could not release the prepped list", cause=e, op="release_dlist_handle") from e
        prep.released = True
        self._prepped.pop(id(prep), None)

    def post_write_blocks(
        self,
        peer: object,
        local_prep: object,
        local_idx: np.ndarray | list[int],
        remote_prep: object,
        remote_idx: np.ndarray | list[int],
        notif: object = None,
    ) -> XferHandle:
        """Post one WRITE of local blocks ``local_idx`` into the peer's blocks ``remote_idx``.

        The cheap path: numpy int32 indices into prepped lists. NIXL itself merges runs that are
        contiguous in memory on both sides. Called, Ownership, After error: as ``post_write``.
        """
        self._check_open()
        peer = self._check_peer(peer)
        payload = b"" if notif is None else self._check_notif(notif)  # b"": NIXL's "no notification"
        local_prep = self._check_prep(local_prep, "local_prep")
        remote_prep = self._check_prep(remote_prep, "remote_prep")
        if local_prep.peer is not None:
            raise LocalProtocolError("local_prep must be prepped with peer=None", field="local_prep")
        if remote_prep.peer != peer:
            raise LocalProtocolError("remote_prep names another peer", field="remote_prep",
                                     peer=peer, prep_peer=remote_prep.peer)
        size = local_prep.uniform_nbytes
        li: Any
        ri: Any
        if (type(local_idx) is list and type(remote_idx) is list and size
                and size == remote_prep.uniform_nbytes and len(local_idx) <= _LIST_INDICES):
            # Fast path (rule 6): short Python lists into uniform lists - plain checks, no numpy; NIXL
            # takes the lists as they are (cheaper than int32 arrays at this size, perf.md 1.3).
            li, ri, n = local_idx, remote_idx, len(local_idx)
            _check_index_list(li, local_prep.count, "local_idx")
            _check_index_list(ri, remote_prep.count, "remote_idx")
            if len(ri) != n:
                raise LocalProtocolError("index arrays differ in length", field="remote_idx",
                                         local_count=n, remote_count=len(ri))
            nbytes, count = n * size, n
        else:
            li = _as_index_array(local_idx, local_prep.num_blocks, "local_idx")
            ri = _as_index_array(remote_idx, remote_prep.num_blocks, "remote_idx")
            if li.size != ri.size:
                raise LocalProtocolError("index arrays differ in length", field="remote_idx",
                                         local_count=int(li.size), remote_count=int(ri.size))
            local_sizes = local_prep.sizes[li]
            if not np.array_equal(local_sizes, remote_prep.sizes[ri]):
                raise LocalProtocolError("block sizes differ", field="remote_prep")
            nbytes, count = int(local_sizes.sum()), int(li.size)
        try:
            lib = self._agent.make_prepped_xfer("WRITE", local_prep._lib, li, remote_prep._lib, ri, payload)
        except Exception as e:
            raise AdapterError("could not make the prepped WRITE", cause=e, op="make_prepped_xfer",
                               posted=False, peer=peer, nbytes=nbytes) from e
        return self._post(lib, peer, nbytes, count)

    def _post(self, lib: Any, peer: str, nbytes: int, num_descs: int) -> XferHandle:
        handle = XferHandle(next(self._ids), peer, nbytes, num_descs, lib, self)
        self._live[handle.xfer_id] = handle  # rooted before transfer(): INV-NX-1 holds if it raises
        try:
            text = self._agent.transfer(lib)
        except Exception as e:
            err = AdapterError("transfer() raised; the WRITE is in doubt", cause=e, op="transfer",
                               posted=None, peer=peer, nbytes=nbytes, handle=handle)
            handle.error = err
            raise err from e
        handle.posted = True
        status = _status_of(text)
        if status is None or status is XferStatus.ERROR:
            handle.error = AdapterError("transfer() reported an error", op="transfer", peer=peer,
                                        nbytes=nbytes, state=text)
            status = XferStatus.ERROR
        handle.status = status
        return handle

    # ------------------------------------------------------------------ completion

    def poll(self, handle: object) -> XferStatus:
        """Ask the library once; returns exactly one status and records it on the handle.

        Called: by the NIXL status poller, repeatedly per live handle, owner thread. Cost ~0.5 us.
        After error: a library exception is ``ERROR`` with ``handle.error`` set (never raised); the
        handle may still be polled and may later report DONE. Polling a released handle is refused.
        """
        handle = self._check_handle(handle)
        if handle.released:
            raise LocalProtocolError("poll of a released handle", field="handle", xfer_id=handle.xfer_id)
        if handle.status is XferStatus.DONE:  # INV-NX-4
            return XferStatus.DONE
        try:
            text = self._agent.check_xfer_state(handle._lib)
        except Exception as e:
            handle.error = AdapterError("check_xfer_state raised", cause=e, op="check_xfer_state",
                                        peer=handle.peer, xfer_id=handle.xfer_id)
            handle.status = XferStatus.ERROR
            return XferStatus.ERROR
        status = _status_of(text)
        if status is None or status is XferStatus.ERROR:
            handle.error = AdapterError("transfer failed", op="check_xfer_state", peer=handle.peer,
                                        xfer_id=handle.xfer_id, state=text)
            status = XferStatus.ERROR
        handle.status = status
        return status

    def release(self, handle: object) -> None:
        """Release a handle that reached DONE or ERROR. Idempotent.

        Called: once the driver has turned the status into a core event, owner thread.
        Ownership: after DONE the buffers are the caller's again. After ERROR they are NOT proven
        quiescent; the caller must keep holding them (this call is bookkeeping, not a fence).
        After error: ``LocalProtocolError`` for a live handle (releasing is not a fence);
        ``AdapterError(op="release_xfer_handle")`` when NIXL refused, and the handle stays rooted.
        """
        handle = self._check_handle(handle)
        if handle.released:
            return
        if handle.status is XferStatus.IN_PROGRESS:
            raise LocalProtocolError("release of an in-progress handle is not a fence", field="handle",
                                     xfer_id=handle.xfer_id, peer=handle.peer)
        try:
            self._agent.release_xfer_handle(handle._lib)
        except Exception as e:
            raise AdapterError("NIXL refused to release the handle", cause=e, op="release_xfer_handle",
                               xfer_id=handle.xfer_id) from e
        handle.released = True
        handle._lib = None
        del self._live[handle.xfer_id]  # INV-NX-2

    # ------------------------------------------------------------------ notifications

    def send_notif(self, peer: object, payload: object) -> None:
        """Send a standalone notification (at most ``MAX_NOTIF_NBYTES``). NIXL promises no order.

        Called: per control message on the NIXL channel, owner thread. Cost ~7 us (tcp/lo AM).
        After error: ``AdapterError(op="send_notif")``; the message may or may not have been sent.
        """
        self._check_open()
        peer = self._check_peer(peer)
        data = self._check_notif(payload)
        try:
            self._agent.send_notif(peer, data)
        except Exception as e:
            raise AdapterError("send_notif failed", cause=e, op="send_notif", peer=peer) from e
        finally:  # accepted or not, it may be in flight in UCX until the worker is progressed
            self._last_notif_ns = self._clock()

    def drain_notifs(self) -> list[tuple[str, bytes]]:
        """Return every pending notification, from all peers, as ``(sender agent name, payload)``.

        Also progresses the agent (the target side of incoming WRITEs needs this without a progress
        thread). Order within one sender is arrival order; nothing is promised across senders.
        Called: by the control poller in its loop, owner thread. Cost ~0.8 us when empty.
        After error: ``AdapterError(op="get_new_notifs")``; notifications may have been lost.
        """
        self._check_open()
        try:
            got = self._agent.get_new_notifs()
        except Exception as e:
            raise AdapterError("get_new_notifs failed", cause=e, op="get_new_notifs") from e
        if not got:
            return []
        return [(str(sender), bytes(msg)) for sender, msgs in got.items() for msg in msgs]

    # ------------------------------------------------------------------ teardown

    def flush_notifs(self, flush_s: float = CLOSE_FLUSH_S, max_s: float = CLOSE_FLUSH_MAX_S) -> int:
        """Progress the agent for ``flush_s`` of this thread's CPU if it ever sent a notification, so
        notifications NIXL accepted but UCX has not sent yet leave before the peers are dropped (dropping a
        peer closes its UCX endpoint, which cancels them: NIXL logs "UCX AM send failed with status -16"
        and loses the frame). NIXL says nothing about what is still in flight, so the flush is timed, from
        now (a sender that napped since its last send still holds what it held then), in CPU time: a thread
        starved by other processes gets as many progress passes as a quiet one. Bounded by ``max_s`` of
        wall time. Returns how many notifications arrived meanwhile; they are discarded (closing).

        Called: by ``close``, owner thread. After error: ``AdapterError(op="get_new_notifs")``.
        """
        if self._last_notif_ns is None or self._closed:
            return 0
        cpu_end_ns = self._cpu_clock() + int(flush_s * 1e9)
        wall_end_ns = self._clock() + int(max_s * 1e9)
        arrived = 0
        while True:
            arrived += len(self.drain_notifs())
            if self._cpu_clock() >= cpu_end_ns or self._clock() >= wall_end_ns:
                return arrived

    def close(self, flush_s: float = CLOSE_FLUSH_S) -> None:
        """Flush notifications still in flight (``flush_notifs``), release prepped lists, drop peers,
        deregister memory and drop the agent. Idempotent.

        Called: once at shutdown, owner thread.
        After error: ``LocalProtocolError`` while handles are live (INV-NX-3; the memory may still be
        written); ``AdapterError`` from the library leaves the endpoint closed but possibly leaky.
        """
        if self._closed:
            return
        if self._live:
            raise LocalProtocolError("close with live transfer handles", field="live_handles",
                                     live_handles=len(self._live), name=self._name)
        first: BaseException | None = None
        try:
            self.flush_notifs(flush_s)
        except AdapterError as e:
            first = e
        for prep in list(self._prepped.values()):
            try:
                self.release_prepped(prep)
            except AdapterError as e:
                first = first or e
        for peer in list(self._peers):
            try:
                self._agent.remove_remote_agent(peer)
            except Exception as e:
                first = first or e
        self._peers.clear()
        for reg in self._regions.values():
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:
                first = first or e
        self._regions.clear()
        self._breaks.clear()
        self._closed = True
        self._agent = None
        if self._on_close is not None:
            self._on_close()
        if first is not None:
            raise AdapterError("close finished with library errors", cause=first, op="close")

    # ------------------------------------------------------------------ checks

    def _check_open(self) -> None:
        if self._closed:
            raise LocalProtocolError("endpoint is closed", field="endpoint", name=self._name)

    # The checks below take ``object`` and return the narrowed value (rule 9): a public parameter a caller
    # can get wrong is typed ``object`` and checked here, so both builds answer ``LocalProtocolError``
    # naming it (the compiled build's own argument check would be a bare ``TypeError``).

    def _check_peer(self, peer: object) -> str:
        if not isinstance(peer, str) or peer not in self._peers:
            raise LocalProtocolError("unknown peer; call add_peer first", field="peer", peer=peer)
        return peer

    def _check_handle(self, handle: object) -> XferHandle:
        if not isinstance(handle, XferHandle) or handle._owner is not self:
            raise LocalProtocolError("handle does not belong to this endpoint", field="handle")
        return handle

    def _check_prep(self, prep: object, side: str) -> PreppedBlocks:
        if not isinstance(prep, PreppedBlocks) or self._prepped.get(id(prep)) is not prep:
            raise LocalProtocolError("prepped list is not live on this endpoint", field=side)  # or released
        return prep

    @staticmethod
    def _check_notif(payload: object) -> bytes:
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise LocalProtocolError("notification payload must be bytes", field="notif")
        if len(payload) > MAX_NOTIF_NBYTES:
            raise LocalProtocolError("notification payload too large", field="notif",
                                     nbytes=len(payload), max_nbytes=MAX_NOTIF_NBYTES)
        return bytes(payload)
