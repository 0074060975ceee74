"""The transport a driver talks to: one NIXL agent, seen in kvown's terms (ranks, blocks, frames).

Owns: this rank's ``NixlEndpoint``; the registration of its block space and aux slots; every peer's
record (``PeerInfo``: agent, block space, aux address, roles); the prepped descriptor lists of whole
blocks, ours and one per peer; and the map from agent names to ranks.

Rules:
  1. One call per action: ``send`` one sealed control frame; ``write`` one ``PostWrite`` (or whole-block KV
     ones for one receiver, coalesced) and, optionally, the sealed frame NIXL delivers as the WRITE's
     notification once data and flush completed (``notif``). Descriptors, byte ranges, addresses and
     NIXL's tri-state "posted" flag stay here.
  2. ``write`` answers with exactly one typed outcome: ``Posted`` (poll until DONE), ``NotPosted``
     (nothing can touch memory; also a peer's block id out of range: it never raises for that) or
     ``InDoubt`` (the post raised part-way: the handle is rooted and polled; only DONE proves quiescence).
  3. ``send`` raising ``AdapterError`` means *delivery unknown*: NIXL may or may not have sent it.
  4. ``receive`` returns ``(rank, frame)`` pairs in arrival order; an unknown agent's frame comes back with
     rank ``None`` (dropped), or with ``defer_unknown`` waits, up to ``MAX_DEFERRED``, for its ``connect``.
  5. Called from one thread only (the engine thread), like the endpoint below it.
  6. ``poll`` answers in kvown's words (``WriteStatus``), never NIXL's: DONE is the only proof of
     quiescence; IN_DOUBT (NIXL's ERROR) may still turn into DONE, so the handle is polled on.

Invariants:
  INV-T1  A ``PostWrite`` of whole blocks posts exactly the chunks of those blocks in every region,
          on both sides (``BlockSpace.indices``); a head-sliced one exactly its slice.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Final, Protocol

from kvown.adapters.nixl import MemKind, NixlEndpoint, XferHandle, XferStatus
from kvown.cache.space import BlockSpace
from kvown.core.actions import PieceKind, PostWrite
from kvown.core.errors import AdapterError, KvownError, PeerProtocolError
from kvown.core.messages import (
    CAPABILITIES,
    PROTOCOL_VERSION,
    Hello,
    check_hello,
    digest_field,
    int_field,
    names_field,
    rank_field,
    short_repr,
)
from kvown.core.record import Record


MAX_METADATA_NBYTES = 1 << 20  # NIXL metadata is ~0.5 KiB plus a few dozen bytes per registration
MAX_DEFERRED = 4096  # frames from not-yet-connected agents kept in a world whose members join over time


class Role(enum.Enum):
    """What a rank does: write KV (context/prefill) or receive it (generation/decode)."""

    __hash__ = object.__hash__  # members are singletons: C-level hashing (enum's is Python)

    SENDER = "sender"
    RECEIVER = "receiver"


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """What one rank publishes about itself at start-up (exchanged by allgather or a registry)."""

    rank: int
    agent_name: str
    agent_metadata: bytes
    space: BlockSpace
    aux_addr: int
    aux_slot_nbytes: int
    geometry_digest: str
    protocol_version: int
    capabilities: tuple[str, ...]
    roles: frozenset[Role]

    def to_wire(self) -> list[Any]:
        return [self.rank, self.agent_name, self.agent_metadata, self.space.to_wire(), self.aux_addr,
                self.aux_slot_nbytes, self.geometry_digest, self.protocol_version, list(self.capabilities),
                sorted(r.value for r in self.roles)]

    @classmethod
    def from_wire(cls, obj: Any) -> PeerInfo:
        """Validate a peer's start-up record (the list ``to_wire`` made).

        Called: once per peer at start-up, main thread. A peer's bytes are untrusted even inside one
        job (another release, a bug), so every field is checked as a control frame's would be, in
        wire order so the error names the first bad one.
        After error: ``PeerProtocolError`` naming the field; nothing was built.
        """
        if not isinstance(obj, (list, tuple)) or len(obj) != 10:
            raise PeerProtocolError("peer info must be a list of 10 fields", field="peer_info")
        rank, name, metadata, space, aux_addr, aux_slot_nbytes, digest, version, caps, roles = obj
        rank = rank_field("rank", rank)
        if type(name) is not str or not 0 < len(name) <= 256:
            raise PeerProtocolError("agent name must be 1..256 characters", field="agent_name", value=short_repr(name))
        # bytes(metadata) of an int would allocate that many zero bytes: only real bytes pass.
        if not isinstance(metadata, (bytes, bytearray)) or not 0 < len(metadata) <= MAX_METADATA_NBYTES:
            raise PeerProtocolError("agent metadata must be 1 B .. 1 MiB of bytes", field="agent_metadata")
        block_space = BlockSpace.from_wire(space)
        aux_addr = int_field(0, (1 << 64) - 1)("aux_addr", aux_addr)
        aux_slot_nbytes = int_field(1, 1 << 20)("aux_slot_nbytes", aux_slot_nbytes)
        digest, version = digest_field("geometry_digest", digest), int_field(0, 1 << 16)("protocol_version", version)
        caps = names_field("capabilities", caps)
        try:
            role_set = frozenset(Role(r) for r in roles) if isinstance(roles, (list, tuple)) else frozenset()
        except (ValueError, TypeError):
            role_set = frozenset()
        if not role_set or len(roles) > 2:
            raise PeerProtocolError("roles must name sender and/or receiver", field="roles", value=short_repr(roles))
        return cls(rank, name, bytes(metadata), block_space, aux_addr, aux_slot_nbytes, digest, version, caps, role_set)

    @classmethod
    def from_blob(cls, blob: bytes) -> PeerInfo:
        """Decode the msgpack blob a peer published (``msgpack.packb(info.to_wire())``) and validate it.

        Called: once per peer by ``connect_rendezvous``. After error: ``PeerProtocolError(field=...)``.
        """
        import msgpack

        try:
            obj = msgpack.unpackb(blob, raw=False, strict_map_key=True, max_str_len=1024,
                                  max_bin_len=MAX_METADATA_NBYTES, max_array_len=64 * 1024, max_map_len=0,
                                  max_ext_len=0)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            raise PeerProtocolError("peer info is not valid msgpack", field="peer_info") from None
        return cls.from_wire(obj)

    def hello(self) -> Hello:
        return Hello(self.rank, self.protocol_version, self.capabilities, self.geometry_digest)


def check_peer(local: PeerInfo, peer: PeerInfo) -> None:
    """Refuse a peer we cannot safely exchange KV with, naming the field (version, capabilities,
    geometry, block-space shape, aux slot size). Called: at start-up, once per peer."""
    if peer.space.shape_digest() != local.space.shape_digest():  # first: it can say what differs
        raise PeerProtocolError("peer's KV block regions differ", field="space", peer_rank=peer.rank,
                                got=peer.space.describe(), want=local.space.describe())
    check_hello(local.hello(), peer.hello())
    if peer.aux_slot_nbytes != local.aux_slot_nbytes:
        raise PeerProtocolError("peer's aux slot size differs", field="aux_slot_nbytes", peer_rank=peer.rank,
                                got=peer.aux_slot_nbytes, want=local.aux_slot_nbytes)


# ---- write outcomes (rules 2, 6) -----------------------------------------------------------------


class WriteStatus(enum.Enum):
    """What ``Transport.poll`` says of one posted WRITE (rule 6)."""

    __hash__ = object.__hash__  # members are singletons: C-level hashing (enum's is Python)

    IN_FLIGHT = "in_flight"  # still running: poll again
    DONE = "done"  # proof: the backend stopped touching both buffers (terminal)
    IN_DOUBT = "in_doubt"  # ended without proof (NIXL's ERROR): bytes may still land; poll again


_WRITE_STATUS = {XferStatus.IN_PROGRESS: WriteStatus.IN_FLIGHT, XferStatus.DONE: WriteStatus.DONE,
                 XferStatus.ERROR: WriteStatus.IN_DOUBT}


class Posted(Record):
    """The WRITE is on the wire; poll ``handle`` until DONE (or ERROR: in doubt). ``settled``: the post
    itself already reported how it ended (UCX copied inside ``transfer()``), so a poll now answers
    without asking the library; otherwise the first poll waits for the next step."""

    def __init__(self, handle: XferHandle, nbytes: int, settled: bool = False) -> None:
        self.handle: Final = handle
        self.nbytes: Final = nbytes
        self.settled: Final = settled


class NotPosted(Record):
    """Refused before anything was posted: nothing can touch memory."""

    def __init__(self, reason: str) -> None:
        self.reason: Final = reason


class InDoubt(Record):
    """Posting raised part-way: the backend may be writing. ``handle`` is rooted; poll it until DONE."""

    def __init__(self, handle: XferHandle, reason: str) -> None:
        self.handle: Final = handle
        self.reason: Final = reason


WriteOutcome = Posted | NotPosted | InDoubt


class Transport(Protocol):
    """What a driver needs from its transport (``KVTransport`` here; fault-injecting wrappers in
    ``kvown.testing.faults``)."""

    def send(self, rank: int, frame: bytes) -> None: ...
    def receive(self) -> list[tuple[int | None, bytes]]: ...
    def write(self, actions: Sequence[PostWrite], local_aux_slot: int, notif: bytes | None = None) -> WriteOutcome: ...
    def poll(self, handle: Any) -> WriteStatus: ...
    def release(self, handle: Any) -> None: ...


class KVTransport:
    """``Transport`` over one ``NixlEndpoint`` (real NIXL, or the fake library in ``kvown.testing``)."""

    def __init__(self, endpoint: NixlEndpoint, rank: int, space: BlockSpace, aux: Any, *, aux_slot_nbytes: int,
                 roles: frozenset[Role], geometry_digest: str, defer_unknown: bool = False) -> None:
        """Register ``space`` and the aux tensor ``aux`` with ``endpoint``.

        Called: once per rank at start-up, on the thread that will own the endpoint.
        Ownership: the caller keeps the memory alive until ``close``.
        After error: ``AdapterError`` from the registration; nothing else was done.
        """
        self.endpoint = endpoint
        self.rank = rank
        self.space = space
        self._mem = MemKind(space.mem)
        for region in space.regions:  # one registration per region: chunks are never merged across them
            last = region.base_addr + (space.num_blocks - 1) * region.stride_nbytes + region.chunk_nbytes
            endpoint.register(region.base_addr, last - region.base_addr, self._mem, space.device_id)
        endpoint.register(aux.data_ptr(), aux.numel() * aux.element_size(), MemKind.DRAM)
        self._aux_addr = aux.data_ptr()
        self._aux_slot_nbytes = aux_slot_nbytes
        self.info = PeerInfo(rank, endpoint.name, endpoint.metadata(), space, self._aux_addr, aux_slot_nbytes,
                             geometry_digest, PROTOCOL_VERSION, CAPABILITIES, roles)
        self.peers: dict[int, PeerInfo] = {}
        self._rank_of: dict[str, int] = {}
        self._local_prep: Any = None
        self._remote_prep: dict[int, Any] = {}
        self._defer_unknown = defer_unknown
        self._deferred: collections.deque[tuple[str, bytes]] = collections.deque(maxlen=MAX_DEFERRED)
        self.deferred_dropped = 0  # frames from agents that never joined, pushed out of the bounded wait

    def connect(self, peers: dict[int, PeerInfo]) -> None:
        """Check and load peers, and prep the block descriptor lists (ours once, one per peer).

        Called: at start-up with every peer, or later with ones that joined (a world whose members
        join over time), owner thread. A peer already loaded is skipped.
        After error: ``PeerProtocolError`` naming the field of the first incompatible peer (nothing
        was loaded), or ``AdapterError`` from NIXL.
        """
        peers = {r: p for r, p in peers.items() if r not in self.peers and r != self.rank}
        for peer in peers.values():
            check_peer(self.info, peer)
        if self._local_prep is None:
            addrs, sizes = self.space.descriptors()
            self._local_prep = self.endpoint.prep_descs(addrs, sizes, self._mem, device_id=self.space.device_id)
        for rank, peer in sorted(peers.items()):
            agent = self.endpoint.add_peer(peer.agent_metadata)
            if agent != peer.agent_name:
                raise PeerProtocolError("metadata names another agent", field="agent_name", peer_rank=rank)
            addrs, sizes = peer.space.descriptors()
            self._remote_prep[rank] = self.endpoint.prep_descs(addrs, sizes, MemKind(peer.space.mem), peer=agent,
                                                               device_id=peer.space.device_id)
            self.peers[rank] = peer
            self._rank_of[agent] = rank

    # ---- control (rules 3, 4) ----------------------------------------------------------------

    def send(self, rank: int, frame: bytes) -> None:
        """Called: once per control frame (and per resend), engine thread. After error: delivery unknown."""
        self.endpoint.send_notif(self.peers[rank].agent_name, frame)

    def receive(self) -> list[tuple[int | None, bytes]]:
        """Every frame that arrived, in arrival order. Also progresses incoming WRITEs (no progress thread)."""
        arrived = self.endpoint.drain_notifs()
        if not self._defer_unknown:
            return [(self._rank_of.get(agent), frame) for agent, frame in arrived]
        out: list[tuple[int | None, bytes]] = []
        if self._deferred and any(agent in self._rank_of for agent, _ in self._deferred):
            waiting, self._deferred = self._deferred, collections.deque(maxlen=MAX_DEFERRED)
            for agent, frame in waiting:  # rule 4: joined since; hand over in arrival order
                self._wait_or_take(agent, frame, out)
        for agent, frame in arrived:
            self._wait_or_take(agent, frame, out)
        return out

    def _wait_or_take(self, agent: str, frame: bytes, out: list[tuple[int | None, bytes]]) -> None:
        rank = self._rank_of.get(agent)
        if rank is not None:
            out.append((rank, frame))
            return
        if len(self._deferred) == MAX_DEFERRED:
            self.deferred_dropped += 1
        self._deferred.append((agent, frame))

    # ---- data (rule 2) -----------------------------------------------------------------------

    def write(self, actions: Sequence[PostWrite], local_aux_slot: int, notif: bytes | None = None) -> WriteOutcome:
        """Post one WRITE for ``actions`` (with ``notif`` as its NIXL notification when given): one action,
        or several whole-block KV pieces for one receiver coalesced into one transfer (rule 1).

        Called: per PostWrite, or per coalesced group of them, engine thread. Never raises (rule 2).
        """
        action = actions[0]
        peer = self.peers.get(action.receiver_rank)
        if peer is None:
            return NotPosted(f"rank {action.receiver_rank} is not a known peer")
        if len(actions) > 1 and any(a.kind is PieceKind.AUX or a.num_slices != 1
                                    or a.receiver_rank != action.receiver_rank for a in actions):
            return NotPosted("only whole-block KV pieces for one receiver are coalesced")
        if action.kind is PieceKind.AUX and local_aux_slot < 0:
            return NotPosted("no aux payload")
        try:
            handle = self._post(peer, actions, local_aux_slot, notif)
        except AdapterError as exc:
            if getattr(exc, "posted", False) is None:  # transfer() itself raised
                return InDoubt(exc.handle, str(exc))  # type: ignore[attr-defined]
            return NotPosted(str(exc))
        except KvownError as exc:  # our own checks (block ids, sizes) refused it before NIXL saw it
            return NotPosted(str(exc))
        return Posted(handle, handle.nbytes, handle.status is not XferStatus.IN_PROGRESS)

    def _post(self, peer: PeerInfo, actions: Sequence[PostWrite], local_aux_slot: int,
              notif: bytes | None) -> XferHandle:
        action = actions[0]
        if action.kind is PieceKind.AUX:
            n = self._aux_slot_nbytes
            return self.endpoint.post_write(peer.agent_name, [(self._aux_addr + local_aux_slot * n, n)],
                                            [(peer.aux_addr + action.aux_slot * n, n)], MemKind.DRAM,
                                            notif=notif)
        if action.num_slices == 1:  # whole blocks through the prepped lists (INV-T1)
            src, dst = action.src_blocks, action.dst_blocks
            for a in actions[1:]:
                src += a.src_blocks
                dst += a.dst_blocks
            if len(self.space.regions) == 1 and len(peer.space.regions) == 1 and len(src) <= 64:
                local_idx: Any = list(src)  # one region: a block's index is its id
                remote_idx: Any = list(dst)  # (the endpoint checks the range)
            else:
                local_idx = self.space.indices(src)
                remote_idx = peer.space.indices(dst)
            return self.endpoint.post_write_blocks(peer.agent_name, self._local_prep, local_idx,
                                                   self._remote_prep[action.receiver_rank], remote_idx, notif)
        local = self.space.slice_ranges(action.src_blocks, action.slice_index, action.num_slices)
        remote = peer.space.slice_ranges(action.dst_blocks, action.slice_index, action.num_slices)
        return self.endpoint.post_write(peer.agent_name, local, remote, self._mem, MemKind(peer.space.mem),
                                        device_id=self.space.device_id, remote_device_id=peer.space.device_id,
                                        notif=notif)

    def poll(self, handle: XferHandle) -> WriteStatus:
        return _WRITE_STATUS[self.endpoint.poll(handle)]

    def release(self, handle: XferHandle) -> None:
        self.endpoint.release(handle)

    def close(self) -> None:
        self.endpoint.close()


__all__ = ["InDoubt", "KVTransport", "NotPosted", "PeerInfo", "Posted", "Role", "Transport", "WriteOutcome",
           "WriteStatus", "check_peer"]
