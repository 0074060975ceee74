"""Fuzz targets: every entry point that reads untrusted bytes, each with the oracle that judges it.

Owns: the targets (``TARGETS``: name -> ``Target``), their fixtures (the state a hostile input meets),
the oracles, the corpus seeds (``seeds``) and the planted bugs (``MUTANTS``) that prove the oracles
can fail. ``kvown.testing.fuzz`` drives them with atheris (not imported here); tests replay them.

Rules:
  1. A target ``one_input(data: bytes) -> str`` returns the outcome's name and raises ``FuzzFinding``
     (or lets an unexpected exception escape) for a crash.
  2. Allowed outcomes, and only these: success, or ``PeerProtocolError`` whose ``field`` is a non-empty
     string *and* after which the state it could have touched is unchanged (a structural snapshot
     taken before the call, compared after it). ``LocalProtocolError`` from peer bytes is a crash:
     a peer must never be able to make kvown blame itself.
  3. Every input meets a fresh fixture built the same way each time (INV-FZ1): a finding replays
     from its bytes alone, ``one_input`` is a pure function of them.
  4. Where a frame is HMAC-sealed in production, the target seals the fuzzed body with the job key
     itself: the fuzzer plays an attacker who holds the key (the strongest case), so its bytes reach
     msgpack and the field validators instead of dying at the tag check.
  5. The field oracle (``check_fields``) restates the documented field ranges independently of
     ``kvown.core.messages``' validators, so a validator that lets a bad value through is a finding.

Targets (what each reaches: docs/design.md section 15): ``frame``, ``core`` (frames through the
driver's own ``Router`` into the cores), ``peer_info``, ``rendezvous_server``, ``rendezvous_client``.
"""

from __future__ import annotations

import enum
import hashlib
import struct
import time
from array import array
from dataclasses import dataclass, fields
from typing import Any, Callable

import msgpack

from kvown.adapters import codec
from kvown.core import messages
from kvown.core.errors import LocalProtocolError, PeerProtocolError
from kvown.core.messages import (
    CAPABILITIES,
    FLAG_CARRIED,
    FRAME_BATCH,
    MAX_BATCH,
    MAX_BLOCKS,
    MAX_CARRIED,
    MAX_NBYTES,
    MAX_PIECE,
    MAX_RANK,
    MAX_SEQ,
    MAX_SLICES,
    PROTOCOL_VERSION,
    AuxResult,
    CancelSession,
    Envelope,
    Frame,
    Hello,
    KvResult,
    RequestData,
    ResultStatus,
    SessionQuiesced,
    Watermark,
    seal,
)
from kvown.core.record import record_fields
from kvown.core.routing import Router
from kvown.core.streams import InboundStreams

KEY = b"fuzz-job-key-0123456789abcdef!!!"  # 32 bytes; the per-job key every target seals with
LOCAL = 1  # the rank whose inputs are fuzzed
PEERS = (0, 2, 3)
NOW_NS = 1_000  # fixtures are built at this instant and fuzzed inputs arrive at it: no time passes
DIGEST = hashlib.sha256(b"fuzz geometry").hexdigest()


class FuzzFinding(AssertionError):
    """An outcome outside the allowed set (module rule 2)."""


@dataclass(frozen=True)
class Target:
    name: str
    one_input: Callable[[bytes], str]
    doc: str


# ---- oracles --------------------------------------------------------------------------------------


def snapshot(obj: Any, _depth: int = 0) -> Any:
    """A structural, comparable copy of ``obj``: containers, slots and ``__dict__`` walked recursively.

    Why not ``copy.deepcopy`` + ``==``: several kvown objects define no ``__eq__`` (streams, fences,
    clocks), so equality of copies would compare identities.
    """
    if _depth > 40:
        raise FuzzFinding("state snapshot nests deeper than 40 levels (a cycle?)")
    d = _depth + 1
    if obj is None or isinstance(obj, (bool, int, float, str, bytes, enum.Enum)):
        return obj
    if isinstance(obj, (bytearray, array, memoryview)):
        return (type(obj).__name__, bytes(obj) if not isinstance(obj, array) else tuple(obj))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(snapshot(v, d) for v in obj))
    if isinstance(obj, dict):
        return ("dict", tuple((snapshot(k, d), snapshot(v, d)) for k, v in obj.items()))
    if isinstance(obj, (set, frozenset)):
        return ("set", tuple(sorted((snapshot(v, d) for v in obj), key=repr)))
    attrs: dict[str, Any] = {}
    for cls in type(obj).__mro__:  # a compiled (mypyc) class lists its attributes in __mypyc_attrs__
        for name in (*getattr(cls, "__slots__", ()), *getattr(cls, "__mypyc_attrs__", ())):
            if name not in attrs and name != "__dict__" and hasattr(obj, name):
                attrs[name] = getattr(obj, name)
    attrs.update(getattr(obj, "__dict__", {}))
    return (type(obj).__name__, tuple((k, snapshot(v, d)) for k, v in sorted(attrs.items())))


def expect_field(exc: PeerProtocolError) -> None:
    field = exc.fields.get("field")
    if not isinstance(field, str) or not field:
        raise FuzzFinding(f"PeerProtocolError without a field name: {exc!r}") from exc


def rejected_without_change(exc: PeerProtocolError, before: Any, after: Any, what: str) -> str:
    expect_field(exc)
    if before != after:
        raise FuzzFinding(f"{what} changed although the input was rejected ({exc})") from exc
    return f"rejected:{exc.fields['field']}"


def _is_int(v: Any, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def _valid_request_id(v: Any) -> bool:
    # Restated from kvown.core.ids (rule 5): epoch < 2**31 in the high bits, seq <= 2**32 - 2 below.
    return type(v) is int and 0 <= v < (1 << 63) and (v & 0xFFFFFFFF) <= 0xFFFFFFFE


def _is_blocks(v: Any) -> bool:
    return type(v) is tuple and len(v) <= MAX_BLOCKS and all(_is_int(b, 0, (1 << 31) - 1) for b in v)


def _is_names(v: Any) -> bool:
    return type(v) is tuple and len(v) <= 16 and all(type(c) is str and 0 < len(c) <= 32 for c in v)


def _is_digest(v: Any) -> bool:
    return type(v) is str and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


_RANK = lambda v: _is_int(v, 0, MAX_RANK)  # noqa: E731 - a table of one-line predicates reads best
FIELD_SPEC: dict[str, Callable[[Any], bool]] = {
    "rank": _RANK,
    "writer_rank": _RANK,
    "receiver_rank": _RANK,
    "protocol_version": lambda v: _is_int(v, 0, 1 << 16),
    "capabilities": _is_names,
    "geometry_digest": _is_digest,
    "request_id": _valid_request_id,
    "dst_blocks": _is_blocks,
    "slice_index": lambda v: _is_int(v, 0, MAX_SLICES - 1),
    "num_slices": lambda v: _is_int(v, 1, MAX_SLICES),
    "aux_slot": lambda v: _is_int(v, -1, (1 << 31) - 1),
    "piece": lambda v: _is_int(v, 0, MAX_PIECE),
    "is_last": lambda v: type(v) is bool,
    "status": lambda v: isinstance(v, ResultStatus),
    "nbytes": lambda v: _is_int(v, 0, MAX_NBYTES),
    "epoch": lambda v: _is_int(v, 0, (1 << 31) - 1),
}


def check_fields(frame: Frame) -> None:
    """Rule 5: every field of an accepted frame and of each of its messages is inside its documented
    range, and a carried frame is what ``messages`` rule 1 says (1..MAX_CARRIED final SUCCESS results,
    seq 0).

    A field this table does not know is a finding too: a new message field must be given a spec here
    before the fuzzer can vouch for it.
    """
    for name, value in (("src_rank", frame.src_rank), ("dst_rank", frame.dst_rank)):
        if not _RANK(value):
            raise FuzzFinding(f"decode accepted {name}={value!r}")
    if not _is_int(frame.seq, 0, MAX_SEQ):
        raise FuzzFinding(f"decode accepted seq={frame.seq!r}")
    if not 1 <= len(frame.messages) <= MAX_BATCH:
        raise FuzzFinding(f"decode accepted a frame of {len(frame.messages)} messages")
    if frame.carried and (frame.seq != 0 or len(frame.messages) > MAX_CARRIED or not all(
            isinstance(m, (KvResult, AuxResult)) and m.status is ResultStatus.SUCCESS and m.is_last is True
            for m in frame.messages)):
        raise FuzzFinding(f"decode accepted a carried frame that is not final SUCCESS reports: {frame!r:.120}")
    for message in frame.messages:
        for name in record_fields(type(message)):
            spec = FIELD_SPEC.get(name)
            if spec is None:
                raise FuzzFinding(f"no field spec for {type(message).__name__}.{name}; add it to FIELD_SPEC")
            value = getattr(message, name)
            if not spec(value):
                raise FuzzFinding(f"decode accepted {type(message).__name__}.{name}={value!r:.60}")


def check_round_trip(frame: Frame) -> None:
    """INV-M1: what decode accepted encodes back to an equal frame."""
    again = codec.decode_frame(codec.encode_frame(frame, KEY), KEY)
    if again != frame:
        raise FuzzFinding(f"round trip changed the frame: {frame!r:.80} -> {again!r:.80}")


def _decode_sealed(body: bytes) -> Frame:
    frame = codec.decode_frame(seal(body, KEY), KEY)
    check_fields(frame)
    return frame


# ---- target: frame ----------------------------------------------------------------------------------

_LOCAL_HELLO = Hello(LOCAL, PROTOCOL_VERSION, CAPABILITIES, DIGEST)


def _frame_streams() -> InboundStreams:
    """Rank 1's streams part-way through a session: from rank 0 seqs 0..2 applied and 4 held (3 is the
    gap); from rank 2 seq 1 held. So a fuzzed seq can be a duplicate, a replay, fill a gap, be held,
    or be too far ahead."""
    streams = InboundStreams(LOCAL, max_held=8)
    for src, seq in ((0, 0), (0, 1), (0, 2), (0, 4), (2, 1)):
        streams.deliver(Envelope(src, LOCAL, seq, Watermark(src, 0)))
    return streams


def frame_one_input(data: bytes) -> str:
    streams = _frame_streams()
    before = snapshot(streams)
    try:
        frame = _decode_sealed(data)
        check_round_trip(frame)
        for message in frame.messages:
            if isinstance(message, Hello):
                messages.check_hello(_LOCAL_HELLO, message)
        if frame.carried:  # not a stream position: the engine hands it to the receiver core directly
            return "carried"
        delivered = streams.deliver(frame)
    except PeerProtocolError as exc:
        return rejected_without_change(exc, before, snapshot(streams), "InboundStreams")
    _check_stream_step(before, streams, frame, delivered)
    return "delivered" if delivered else "held_or_duplicate"


def _check_stream_step(before: Any, streams: InboundStreams, envelope: Any, delivered: list[Any]) -> None:
    """INV-ST1 for one accepted envelope: what came out is the stream's next seqs, in order, no gaps;
    nothing came out means it was held (one more held frame) or a duplicate (one more duplicate)."""
    if delivered:
        seqs = [e.seq for e in delivered]
        consecutive = seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        if any(e.src_rank != envelope.src_rank for e in delivered) or not consecutive:
            raise FuzzFinding(f"streams delivered out of order: {seqs}")
        if delivered[0] is not envelope:
            raise FuzzFinding("streams delivered something before the envelope that filled the gap")
        return
    fresh = _frame_streams()
    if snapshot(fresh) != before:
        raise FuzzFinding("frame fixture is not reproducible")  # INV-FZ1
    held_grew = streams.held_count() == fresh.held_count() + 1 and streams.duplicates == fresh.duplicates
    duplicate = (streams.duplicates == fresh.duplicates + 1
                 and snapshot(_with_duplicates(streams, fresh.duplicates)) == before)
    if not (held_grew or duplicate):
        raise FuzzFinding("streams neither delivered, held nor counted a duplicate")


def _with_duplicates(streams: InboundStreams, n: int) -> InboundStreams:
    streams.duplicates = n
    return streams


# ---- target: core -----------------------------------------------------------------------------------

RID_ACTIVE = 0x1_0000_000A  # receiver: published to writers 0 and 2, two slices, aux slot 5
RID_DRAINING = 0x1_0000_000B  # receiver: cancelled; CANCEL_SESSION sent to writer 0
RID_DELIVERED = 0x1_0000_000C  # receiver: writer 2 reported its last piece; waiting for release
RID_PUBLISHING = 0x1_0000_000D  # receiver: just opened (REQUEST_DATA sent, nothing back)
RID_SEND_WAITING = 0x1_0000_0014  # sender: open, no REQUEST_DATA yet
RID_SEND_POSTED = 0x1_0000_0015  # sender: receiver 2 attached, piece 0 posted
RID_FENCED = 0x1_0000_0016  # sender: cancelled before any session
CORE_RIDS = (RID_ACTIVE, RID_DRAINING, RID_DELIVERED, RID_PUBLISHING, RID_SEND_WAITING, RID_SEND_POSTED, RID_FENCED)


def core_fixture() -> tuple[Any, Any]:
    """Fresh sender and receiver cores of rank 1 with sessions in several states (see the RID_* names)."""
    from kvown.core.events import (
        CancelRequested,
        MessageReceived,
        OpenReceive,
        OpenSend,
        SourceReady,
    )
    from kvown.core.machine import CoreConfig
    from kvown.core.receiver import ReceiverCore
    from kvown.core.sender import SenderCore

    config = CoreConfig(rank=LOCAL, timeout_ns=10**9, grace_ns=10**9, peers=PEERS)
    rx, tx = ReceiverCore(config), SenderCore(config)
    for event in (
        OpenReceive(RID_ACTIVE, (0, 1, 2, 3), (0, 2), num_slices=2, aux_slot=5),
        OpenReceive(RID_DRAINING, (4, 5), (0,)),
        CancelRequested(RID_DRAINING),
        OpenReceive(RID_DELIVERED, (6,), (2,)),
        MessageReceived(Envelope(2, LOCAL, 0, KvResult(2, RID_DELIVERED, 0, True, ResultStatus.SUCCESS, 64))),
        OpenReceive(RID_PUBLISHING, (7,), (3,)),
    ):
        rx.handle(event, NOW_NS)
    for event in (
        OpenSend(RID_SEND_WAITING, (0, 1, 2, 3), num_pieces=2),
        OpenSend(RID_SEND_POSTED, (4, 5), num_pieces=2),
        MessageReceived(Envelope(2, LOCAL, 0, RequestData(RID_SEND_POSTED, 2, (8, 9), 0, 1, -1))),
        SourceReady(RID_SEND_POSTED, 0),
        CancelRequested(RID_FENCED),
    ):
        tx.handle(event, NOW_NS)
    return tx, rx


def split_frames(data: bytes, limit: int = 8) -> list[bytes]:
    """``u16 length | body`` records; a record that runs past the end takes what is left."""
    out, i = [], 0
    while i < len(data) and len(out) < limit:
        if i + 2 > len(data):
            out.append(data[i:])
            break
        (n,) = struct.unpack_from(">H", data, i)
        out.append(data[i + 2 : i + 2 + n])
        i += 2 + n
    return out


def join_frames(bodies: list[bytes]) -> bytes:
    return b"".join(struct.pack(">H", len(b)) + b for b in bodies)


def core_one_input(data: bytes) -> str:
    tx, rx = core_fixture()
    streams = InboundStreams(LOCAL)
    router = Router(LOCAL, tx, rx, streams)  # the driver's own routing (kvown.core.routing)
    outcomes = []
    for body in split_frames(data):
        before = snapshot(streams)
        try:
            frame = _decode_sealed(body)
            if frame.src_rank not in PEERS:
                outcomes.append("unknown_source")  # the engine drops it: the transport names the source
                continue
            deliveries = router.frame(frame.src_rank, frame)
        except PeerProtocolError as exc:
            outcomes.append(rejected_without_change(exc, before, snapshot(streams), "InboundStreams"))
            continue
        for d in deliveries:
            if d.drop is not None:
                outcomes.append(f"dropped:{d.drop.name.lower()}")
            for core in d.cores:
                outcomes.append(_handle_one(core, d.event))
    return ",".join(outcomes) or "empty"


def _handle_one(core: Any, event: Any) -> str:
    before = snapshot(core)
    try:
        core.handle(event, NOW_NS)
    except PeerProtocolError as exc:
        return rejected_without_change(exc, before, snapshot(core), type(core).__name__)
    except LocalProtocolError as exc:
        raise FuzzFinding(f"a peer's message raised LocalProtocolError in {type(core).__name__}: {exc}") from exc
    return "handled"


# ---- target: peer_info ------------------------------------------------------------------------------


def _layout() -> Any:
    from kvown.cache.layout import KVLayout

    return KVLayout.standard(num_layers=2, num_blocks=8, tokens_per_block=4, num_kv_heads=2, head_dim=8)


_PEER_INFO_CTX: dict[str, Any] = {}


def local_peer_info(layout: Any, **changes: Any) -> Any:
    """A well-formed record for ``layout`` (this rank's own, or a seed for a peer's)."""
    from kvown.adapters.transport import PeerInfo, Role
    from kvown.cache.space import BlockSpace

    base = dict(rank=LOCAL, agent_name="kvown-job-r1", agent_metadata=b"nixl-md\x00\x01" * 8,
                space=BlockSpace.contiguous(0x7F00_0000_0000, layout.block_nbytes, layout.num_blocks,
                                            heads=layout.num_kv_heads),
                aux_addr=0x7F10_0000_0000, aux_slot_nbytes=64, geometry_digest=layout.geometry_digest(),
                protocol_version=PROTOCOL_VERSION, capabilities=CAPABILITIES, roles=frozenset({Role.RECEIVER}))
    base.update(changes)
    return PeerInfo(**base)


def peer_info_one_input(data: bytes) -> str:
    from kvown.adapters.transport import PeerInfo, check_peer

    layout = _PEER_INFO_CTX.get("layout") or _PEER_INFO_CTX.setdefault("layout", _layout())
    local = _PEER_INFO_CTX.get("local") or _PEER_INFO_CTX.setdefault("local", local_peer_info(layout))
    try:
        info = PeerInfo.from_blob(data)
        check_peer(local, info)
    except PeerProtocolError as exc:
        expect_field(exc)  # stateless: nothing to compare
        return f"rejected:{exc.fields['field']}"
    check_peer_info_fields(info)
    if PeerInfo.from_blob(msgpack.packb(info.to_wire())) != info:  # what connect_rendezvous publishes
        raise FuzzFinding("PeerInfo round trip changed it")
    return "accepted"


_U64 = (1 << 64) - 1
def _is_space(v: Any) -> bool:
    from kvown.cache.space import BlockSpace, Region

    return (isinstance(v, BlockSpace) and 0 < v.num_blocks < 1 << 31 and v.mem in ("DRAM", "VRAM")
            and all(isinstance(r, Region) and 0 < r.chunk_nbytes <= r.stride_nbytes
                    and r.base_addr + v.num_blocks * r.stride_nbytes <= 1 << 64 for r in v.regions))


PEER_INFO_SPEC: dict[str, Callable[[Any], bool]] = {
    "rank": _RANK,
    "agent_name": lambda v: type(v) is str and 0 < len(v) <= 256,
    "agent_metadata": lambda v: type(v) is bytes and 0 < len(v) <= 1 << 20,
    "space": _is_space,
    "aux_addr": lambda v: _is_int(v, 0, _U64),
    "aux_slot_nbytes": lambda v: _is_int(v, 1, 1 << 20),
    "geometry_digest": _is_digest,
    "protocol_version": FIELD_SPEC["protocol_version"],
    "capabilities": _is_names,
    "roles": lambda v: isinstance(v, frozenset) and 0 < len(v) <= 2,
}


def check_peer_info_fields(info: Any) -> None:
    """Rule 5 for ``PeerInfo``: every field of an accepted record is inside its documented range."""
    for f in fields(info):
        spec = PEER_INFO_SPEC.get(f.name)
        if spec is None:
            raise FuzzFinding(f"no field spec for PeerInfo.{f.name}; add it to PEER_INFO_SPEC")
        value = getattr(info, f.name)
        if not spec(value):
            raise FuzzFinding(f"PeerInfo accepted {f.name}={value!r:.60}")


def peer_info_seed(layout: Any, **changes: Any) -> bytes:
    from kvown.adapters.transport import Role

    base = dict(rank=0, agent_name="kvown-job-r0", roles=frozenset({Role.SENDER}))
    base.update(changes)
    return msgpack.packb(local_peer_info(layout, **base).to_wire())


# ---- targets: rendezvous ----------------------------------------------------------------------------


class ScriptedSocket:
    """A connection whose incoming bytes are computed, once, from what was sent before the first recv.

    Lets a target answer the server's HELLO with a frame bound to that HELLO's challenge (rule 4)
    without a real socket: fuzzing through the kernel would cost 100x the time and add nothing.
    """

    def __init__(self, script: Callable[[bytes], bytes]) -> None:
        self.sent = bytearray()
        self._script = script
        self._incoming: bytes | None = None
        self._pos = 0

    def settimeout(self, _timeout_s: float | None) -> None:
        pass

    def sendall(self, data: bytes) -> None:
        self.sent += data

    def recv(self, nbytes: int) -> bytes:
        if self._incoming is None:
            self._incoming = self._script(bytes(self.sent))
        chunk = self._incoming[self._pos : self._pos + nbytes]
        self._pos += len(chunk)
        return chunk

    def close(self) -> None:
        pass

    def __enter__(self) -> ScriptedSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def rv_frame(kind: int, body: bytes, challenge: bytes, *, good_tag: bool = True) -> bytes:
    """One rendezvous frame with a correct header; its tag is right only when ``good_tag``."""
    from kvown.adapters import rendezvous as rv

    header = rv.HEADER.pack(rv.MAGIC, rv.VERSION, kind, len(body))
    tag = rv._tag(KEY, challenge, header, body) if good_tag else bytes(rv.TAG_NBYTES)
    return header + body + tag


def _challenge_of(sent: bytes) -> bytes:
    """The challenge inside the HELLO the server sent (trusted: the server is ours)."""
    from kvown.adapters import rendezvous as rv

    n = rv.HEADER.unpack_from(sent)[3]
    return msgpack.unpackb(sent[rv.HEADER.size : rv.HEADER.size + n])["challenge"]


_RV_TABLE = {"rank0": b"meta-of-rank0", "rank2": b"meta-of-rank2"}
_RV_CTX: dict[str, Any] = {}


def _rv_server() -> Any:
    """One server for the whole process (it binds 127.0.0.1:0 and runs an idle accept thread); each
    input resets its table and error list, so every input meets the same state (INV-FZ1)."""
    from kvown.adapters.rendezvous import RendezvousServer

    server = _RV_CTX.get("server")
    if server is None:
        server = _RV_CTX["server"] = RendezvousServer("127.0.0.1", 0, KEY, io_timeout_s=5.0, max_connections=4)
    with server._lock:
        server._table = dict(_RV_TABLE)
    server.errors.clear()
    return server


def rendezvous_server_one_input(data: bytes) -> str:
    """Input: ``mode u8 | payload``. Mode bit 0 set: payload is a REQUEST body and the target frames and
    tags it correctly (reaches body validation). Bit 0 clear: payload is sent as it is (header checks),
    followed by a correct tag over its first 10 bytes and the rest when bit 1 is set."""
    from kvown.adapters import rendezvous as rv

    mode, payload = (data[0], data[1:]) if data else (0, b"")

    def script(sent: bytes) -> bytes:
        challenge = _challenge_of(sent)
        if mode & 1:
            return rv_frame(rv.FrameKind.REQUEST, payload, challenge)
        if mode & 2:
            return payload + rv._tag(KEY, challenge, payload[: rv.HEADER.size], payload[rv.HEADER.size :])
        return payload

    server = _rv_server()
    before = server.snapshot()
    conn = ScriptedSocket(script)
    if not server._slots.acquire(blocking=False):
        raise FuzzFinding("a rendezvous connection slot leaked")
    server._serve_one(conn)  # anything escaping here would kill a server thread: a crash
    for exc in server.errors:
        if not isinstance(exc, PeerProtocolError):
            raise FuzzFinding(f"server recorded a non-protocol error: {exc!r}")
        expect_field(exc)
    after = server.snapshot()
    reply = _parse_reply(bytes(conn.sent), _challenge_of(bytes(conn.sent))) if len(conn.sent) else None
    published = reply is not None and reply.get("code") == rv.Reply.OK and after != before
    if published:
        changed = {k for k in after if before.get(k) != after[k]}
        if len(changed) != 1 or set(before) - set(after):
            raise FuzzFinding(f"a publish changed more than one name: {sorted(changed)}")
        return "published"
    if after != before:
        raise FuzzFinding("the rendezvous table changed without an OK reply")
    if reply is None:
        return "closed:" + (str(server.errors[-1].fields["field"]) if server.errors else "io")
    return f"reply:{reply.get('code')}"


def _parse_reply(sent: bytes, challenge: bytes) -> dict[str, Any] | None:
    """The RESPONSE after the HELLO, read with the client's own reader: a server reply that its own
    client cannot read is a finding."""
    from kvown.adapters import rendezvous as rv

    hello_len = rv.HEADER.size + rv.HEADER.unpack_from(sent)[3] + rv.TAG_NBYTES
    rest = sent[hello_len:]
    if not rest:
        return None
    sock = ScriptedSocket(lambda _: rest)
    try:
        return rv._recv_frame(sock, KEY, challenge, rv.FrameKind.RESPONSE, time.monotonic() + 5)
    except PeerProtocolError as exc:
        raise FuzzFinding(f"the server sent a reply its client rejects: {exc}") from exc


_CHALLENGE = bytes(range(16))


def rendezvous_client_one_input(data: bytes) -> str:
    """Input: ``mode u8 | hello_len u8 | hello body | response body``: what a (hostile) server sends.
    Mode bit 0 set: the HELLO's tag is wrong; bit 1 set: the RESPONSE's tag is wrong. The response is
    bound to the challenge the HELLO carried when it is 16 bytes (else to zeros)."""
    from kvown.adapters import rendezvous as rv

    mode = data[0] if data else 0
    n = data[1] if len(data) > 1 else 0
    hello, response = data[2 : 2 + n], data[2 + n :]
    try:
        challenge = msgpack.unpackb(hello).get("challenge")
    except Exception:  # noqa: BLE001 - only the harness's guess of the challenge; the client decides
        challenge = None
    if not isinstance(challenge, bytes) or len(challenge) != rv.CHALLENGE_NBYTES:
        challenge = bytes(rv.CHALLENGE_NBYTES)
    incoming = rv_frame(rv.FrameKind.HELLO, hello, b"", good_tag=not mode & 1) + rv_frame(
        rv.FrameKind.RESPONSE, response, challenge, good_tag=not mode & 2
    )
    sock = ScriptedSocket(lambda _: incoming)
    try:
        reply = rv._exchange(sock, KEY, {"op": int(rv.Op.LOOKUP), "name": "rank2"}, time.monotonic() + 5)
        blob = rv._blob_of(reply)
    except PeerProtocolError as exc:
        expect_field(exc)  # the client keeps no state
        return f"rejected:{exc.fields['field']}"
    if blob is not None and (type(blob) is not bytes or len(blob) > rv.MAX_BLOB_NBYTES):
        raise FuzzFinding(f"lookup returned a blob it should have refused: {type(blob).__name__}")
    return "not_found" if blob is None else "found"


# ---- registry -------------------------------------------------------------------------------------

TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("frame", frame_one_input, "one sealed frame: codec.decode, check_hello, InboundStreams.deliver"),
        Target("core", core_one_input, "sealed frames through streams into the sender and receiver cores"),
        Target("peer_info", peer_info_one_input, "a peer's start-up blob: PeerInfo.from_blob, check_peer"),
        Target("rendezvous_server", rendezvous_server_one_input, "one connection to the rendezvous server"),
        Target("rendezvous_client", rendezvous_client_one_input, "a rendezvous server's answer to lookup"),
    )
}


# ---- seeds: the checked-in corpus starts deep -------------------------------------------------------


def _body(src: int, dst: int, seq: int, message: Any) -> bytes:
    return msgpack.packb(messages.to_wire(Envelope(src, dst, seq, message)), use_bin_type=True)


def _every_kind(src: int, seq: int) -> dict[str, bytes]:
    """One valid frame body of every message kind, from ``src`` to LOCAL, aimed at the core fixture."""
    rid = RID_ACTIVE
    return {
        "hello": _body(src, LOCAL, seq, Hello(src, PROTOCOL_VERSION, CAPABILITIES, DIGEST)),
        "request_data": _body(src, LOCAL, seq, RequestData(RID_SEND_WAITING, src, (10, 11, 12, 13), 0, 1, 3)),
        "kv_result": _body(src, LOCAL, seq, KvResult(src, rid, 0, False, ResultStatus.SUCCESS, 4096)),
        "aux_result": _body(src, LOCAL, seq, AuxResult(src, rid, 1, True, ResultStatus.SUCCESS, 64)),
        "cancel_session": _body(src, LOCAL, seq, CancelSession(RID_SEND_POSTED, src)),
        "session_quiesced": _body(src, LOCAL, seq, SessionQuiesced(src, RID_DRAINING)),
        "watermark": _body(src, LOCAL, seq, Watermark(src, 1)),
    }


def _batch(src: int, dst: int, seq: int, *items: Any, flags: int = 0) -> bytes:
    return msgpack.packb([FRAME_BATCH, src, dst, seq, flags,
                          *([int(m.KIND), *m.to_fields()] for m in items)], use_bin_type=True)


def seeds() -> dict[str, dict[str, bytes]]:
    """target -> {file name: bytes}. ``python -m kvown.testing.fuzz --write-seeds`` writes them."""
    return {"frame": _frame_seeds(), "core": _core_seeds(), "peer_info": _peer_info_seeds(), **_rendezvous_seeds()}


def _frame_seeds() -> dict[str, bytes]:
    frame = {f"{k}_gap": v for k, v in _every_kind(0, 3).items()}  # fills rank 0's gap
    frame.update({f"{k}_held": v for k, v in _every_kind(2, 2).items()})  # held behind rank 2's gap
    frame["replay"] = _every_kind(0, 1)["watermark"]
    frame["too_far_ahead"] = _every_kind(0, 64)["kv_result"]
    frame["other_dst"] = _body(0, 7, 3, Watermark(0, 1))
    frame["hello_other_geometry"] = _body(0, LOCAL, 3, Hello(0, PROTOCOL_VERSION, CAPABILITIES, "0" * 64))
    frame["not_msgpack"] = b"\xc1\xff"
    kv = KvResult(0, RID_ACTIVE, 0, True, ResultStatus.SUCCESS, 4096)
    frame["batch_gap"] = _batch(0, LOCAL, 3, Watermark(0, 1), kv, SessionQuiesced(0, RID_ACTIVE))
    frame["batch_held"] = _batch(2, LOCAL, 2, RequestData(RID_SEND_WAITING, 2, (1, 2), 0, 1, -1), Watermark(2, 1))
    frame["carried"] = _batch(0, LOCAL, 0, kv, flags=FLAG_CARRIED)
    frame["carried_not_final"] = _batch(0, LOCAL, 0, KvResult(0, RID_ACTIVE, 0, False, ResultStatus.SUCCESS, 0),
                                        flags=FLAG_CARRIED)
    frame["carried_two"] = _batch(0, LOCAL, 0, kv, KvResult(0, RID_SEND_WAITING, 0, True, ResultStatus.SUCCESS, 8),
                                  flags=FLAG_CARRIED)
    frame["carried_too_many"] = _batch(0, LOCAL, 0, *[kv] * (MAX_CARRIED + 1), flags=FLAG_CARRIED)
    return frame


def _core_seeds() -> dict[str, bytes]:
    core = {k: join_frames([v]) for k, v in _every_kind(0, 0).items()}
    rid = RID_ACTIVE
    core["writer0_result_then_quiesced"] = join_frames([
        _body(0, LOCAL, 0, KvResult(0, rid, 0, True, ResultStatus.SUCCESS, 4096)),
        _body(0, LOCAL, 1, AuxResult(0, rid, 1, True, ResultStatus.SUCCESS, 64)),
        _body(0, LOCAL, 2, SessionQuiesced(0, rid)),
    ])
    core["both_writers_complete"] = join_frames([
        _body(0, LOCAL, 0, KvResult(0, rid, 0, True, ResultStatus.SUCCESS, 4096)),
        _body(2, LOCAL, 0, KvResult(2, rid, 0, True, ResultStatus.SUCCESS, 4096)),
    ])
    core["in_doubt_then_quiesced"] = join_frames([
        _body(2, LOCAL, 0, KvResult(2, rid, 0, False, ResultStatus.IN_DOUBT, 0)),
        _body(2, LOCAL, 1, KvResult(2, rid, 0, True, ResultStatus.FAILED_QUIESCED, 0)),
    ])
    core["draining_ack"] = join_frames([_body(0, LOCAL, 0, SessionQuiesced(0, RID_DRAINING))])
    core["delivered_repeat_result"] = join_frames([
        _body(2, LOCAL, 0, KvResult(2, RID_DELIVERED, 0, True, ResultStatus.SUCCESS, 64)),
    ])
    core["publication_then_cancel"] = join_frames([
        _body(3, LOCAL, 0, RequestData(RID_SEND_WAITING, 3, (1, 2, 3, 4), 0, 1, -1)),
        _body(3, LOCAL, 1, CancelSession(RID_SEND_WAITING, 3)),
    ])
    # Every live session meets each message its side accepts, from a writer or receiver it knows. The
    # seeds after these loops name the last id they bound (RID_FENCED): the checked-in corpus has them so.
    for rid, writer in ((RID_ACTIVE, 2), (RID_DRAINING, 0), (RID_DELIVERED, 2), (RID_PUBLISHING, 3)):
        core[f"rx_{rid & 0xFF:02x}_result"] = join_frames([
            _body(writer, LOCAL, 0, KvResult(writer, rid, 0, True, ResultStatus.SUCCESS, 4096))])
        core[f"rx_{rid & 0xFF:02x}_aux_failed"] = join_frames([
            _body(writer, LOCAL, 0, AuxResult(writer, rid, 1, False, ResultStatus.FAILED, 0))])
        core[f"rx_{rid & 0xFF:02x}_quiesced"] = join_frames([_body(writer, LOCAL, 0, SessionQuiesced(writer, rid))])
    for rid in (RID_SEND_WAITING, RID_SEND_POSTED, RID_FENCED):
        core[f"tx_{rid & 0xFF:02x}_request"] = join_frames([
            _body(2, LOCAL, 0, RequestData(rid, 2, (20, 21, 22, 23), 0, 1, 4))])
        core[f"tx_{rid & 0xFF:02x}_cancel"] = join_frames([_body(2, LOCAL, 0, CancelSession(rid, 2))])
    core["cancel_fenced"] = join_frames([_body(0, LOCAL, 0, RequestData(RID_FENCED, 0, (1,), 0, 1, -1))])
    core["batch_result_then_ack"] = join_frames([
        _batch(0, LOCAL, 0, KvResult(0, rid, 0, True, ResultStatus.SUCCESS, 4096), SessionQuiesced(0, rid))])
    core["carried_result"] = join_frames([
        _batch(2, LOCAL, 0, KvResult(2, rid, 0, True, ResultStatus.SUCCESS, 0), flags=FLAG_CARRIED)])
    core["carried_after_ack"] = join_frames([
        _body(0, LOCAL, 0, SessionQuiesced(0, RID_DRAINING)),
        _batch(0, LOCAL, 0, KvResult(0, RID_DRAINING, 0, True, ResultStatus.SUCCESS, 0), flags=FLAG_CARRIED)])
    core["carried_twice"] = join_frames([
        _batch(2, LOCAL, 0, KvResult(2, rid, 0, True, ResultStatus.SUCCESS, 0), flags=FLAG_CARRIED)] * 2)
    core["out_of_order"] = join_frames([
        _body(0, LOCAL, 1, SessionQuiesced(0, rid)),
        _body(0, LOCAL, 0, KvResult(0, rid, 0, True, ResultStatus.FAILED, 0)),
    ])
    # a writer's stream carrying a result in the other writer's name: refused, and nothing may change first
    core["result_in_another_writers_name"] = join_frames([
        _body(0, LOCAL, 0, KvResult(2, rid, 0, True, ResultStatus.SUCCESS, 4096))])
    return core


def _peer_info_seeds() -> dict[str, bytes]:
    from kvown.adapters.transport import Role

    layout = _layout()
    return {
        "valid": peer_info_seed(layout),
        "two_roles": peer_info_seed(layout, rank=3, roles=frozenset(Role)),
        "other_geometry": peer_info_seed(layout, geometry_digest="ab" * 32),
        "old_version": peer_info_seed(layout, protocol_version=0),
        "missing_capability": peer_info_seed(layout, capabilities=("session_quiesced",)),
        "not_a_list": msgpack.packb({"rank": 0}),
    }


def _rendezvous_seeds() -> dict[str, dict[str, bytes]]:
    from kvown.adapters import rendezvous as rv

    out: dict[str, dict[str, bytes]] = {}

    def req(body: dict) -> bytes:
        return b"\x01" + msgpack.packb(body, use_bin_type=True)

    header = rv.HEADER.pack(rv.MAGIC, rv.VERSION, rv.FrameKind.REQUEST, 20)
    out["rendezvous_server"] = {
        "publish": req({"op": int(rv.Op.PUBLISH), "name": "rank1", "blob": b"nixl metadata"}),
        "republish": req({"op": int(rv.Op.PUBLISH), "name": "rank0", "blob": b"newer metadata"}),
        "lookup": req({"op": int(rv.Op.LOOKUP), "name": "rank2"}),
        "lookup_missing": req({"op": int(rv.Op.LOOKUP), "name": "rank9"}),
        "unknown_op": req({"op": 7, "name": "rank1"}),
        "publish_text_blob": req({"op": int(rv.Op.PUBLISH), "name": "rank1", "blob": "not bytes"}),
        "raw_header": b"\x02" + header + b"x" * 20,
        "bad_magic": b"\x00XXXX\x01\x02\x00\x00\x00\x00",
    }

    def answer(reply: dict, challenge: bytes = _CHALLENGE, mode: int = 0) -> bytes:
        hello = msgpack.packb({"challenge": challenge}, use_bin_type=True)
        return bytes([mode, len(hello)]) + hello + msgpack.packb(reply, use_bin_type=True)

    out["rendezvous_client"] = {
        "found": answer({"code": int(rv.Reply.OK), "blob": b"nixl metadata"}),
        "not_found": answer({"code": int(rv.Reply.NOT_FOUND)}),
        "rejected": answer({"code": int(rv.Reply.REJECTED), "field": "name"}),
        "short_challenge": answer({"code": 0}, challenge=b"short"),
        "forged_reply": answer({"code": 0, "blob": b"x"}, mode=2),
        "found_text_blob": answer({"code": int(rv.Reply.OK), "blob": "not bytes"}),
    }
    return out


# ---- mutants: planted bugs the oracles must catch -----------------------------------------------


def _mutant_unchecked_request_id() -> None:
    """The request-id validator forgets the epoch and seq limits (accepts any non-negative int)."""
    messages.is_valid_request_id = lambda value: type(value) is int and value >= 0  # type: ignore[assignment]


def _mutant_streams_touch_before_check() -> None:
    """InboundStreams creates a stream's held table before it validates the frame."""
    original = InboundStreams.deliver

    def deliver(self: InboundStreams, envelope: Envelope) -> list[Envelope]:
        self._held.setdefault(envelope.src_rank, {})
        return original(self, envelope)

    InboundStreams.deliver = deliver  # type: ignore[method-assign]


def _mutant_receiver_touch_before_check() -> None:
    """The receiver quarantines on a result from the wrong stream before it refuses it (state, then raise)."""
    from kvown.core.receiver import ReceiverCore

    original = ReceiverCore._dispatch

    def dispatch(self: Any, event: Any, now_ns: int, actions: list) -> None:
        message = getattr(getattr(event, "envelope", None), "message", None)
        if isinstance(message, (KvResult, AuxResult)) and message.writer_rank != event.envelope.src_rank:
            self.quarantined = self.quarantined or "mutant: noted before the check"
        original(self, event, now_ns, actions)

    ReceiverCore._dispatch = dispatch  # type: ignore[method-assign]


def _mutant_peer_info_unvalidated() -> None:
    """``PeerInfo.from_wire`` as it was before fuzzing: no validation at all."""
    from kvown.adapters.transport import PeerInfo, Role
    from kvown.cache.space import BlockSpace, Region

    def from_wire(cls: Any, obj: Any) -> Any:
        rank, name, md, space, aux_addr, aux_nbytes, digest, version, caps, roles = obj
        regions, num_blocks, mem, device = space
        block_space = object.__new__(BlockSpace)
        for key, value in (("regions", tuple(Region(*r) for r in regions)), ("num_blocks", num_blocks),
                           ("mem", mem), ("device_id", device)):
            object.__setattr__(block_space, key, value)
        return cls(rank, name, bytes(md), block_space, aux_addr, aux_nbytes, digest, version, tuple(caps),
                   frozenset(Role(r) for r in roles))

    PeerInfo.from_wire = classmethod(from_wire)  # type: ignore[method-assign,assignment]


def _mutant_carried_frame_unchecked() -> None:
    """``frame_from_wire`` forgets messages rule 1: a carried frame may hold any message at any position."""
    messages._check_carried = lambda seq, items: None  # type: ignore[assignment]


def _mutant_rendezvous_stores_before_check() -> None:
    """The rendezvous server stores a PUBLISH's blob before it checks it (INV-RV-1 broken)."""
    from kvown.adapters import rendezvous as rv

    original = rv.RendezvousServer._handle

    def handle(self: Any, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("name")
        if body.get("op") == rv.Op.PUBLISH and isinstance(name, str) and "blob" in body:
            with self._lock:
                self._table[name] = body["blob"]
        return original(self, body)

    rv.RendezvousServer._handle = handle  # type: ignore[method-assign]


def _mutant_rendezvous_blob_unchecked() -> None:
    """The rendezvous client hands back a lookup's blob without checking its type or size."""
    from kvown.adapters import rendezvous as rv

    rv._blob_of = lambda reply: reply.get("blob") if reply["code"] == rv.Reply.OK else None  # type: ignore[assignment]


MUTANTS: dict[str, tuple[str, Callable[[], None]]] = {
    "unchecked_request_id": ("frame", _mutant_unchecked_request_id),
    "streams_touch_before_check": ("frame", _mutant_streams_touch_before_check),
    "receiver_touch_before_check": ("core", _mutant_receiver_touch_before_check),
    "peer_info_unvalidated": ("peer_info", _mutant_peer_info_unvalidated),
    "carried_frame_unchecked": ("frame", _mutant_carried_frame_unchecked),
    "rendezvous_stores_before_check": ("rendezvous_server", _mutant_rendezvous_stores_before_check),
    "rendezvous_blob_unchecked": ("rendezvous_client", _mutant_rendezvous_blob_unchecked),
}
