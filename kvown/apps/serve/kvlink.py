"""``KVLink``: the loopback TCP reference implementation of the KV link protocol (``kvown.apps.serve.link``).

Owns: one TCP connection per (decode, prefill) pair and its bytes, the blocks lent meanwhile, its fence
(kvown's ``CancellationFence``); ``kvown serve --link loopback``. Why: docs/design.md sections 13, 15.

Rules:
  1. Decode side: a destination is OWNED from ``receive`` until DONE (landed: the server may use it)
     and ``release``; a ``cancel`` before DONE makes it HELD: DATA frames already in flight still land
     (as RDMA writes would) and the blocks go back only after DONE, QUIESCED or the connection's reader
     has exited. DONE and QUIESCED are each the last frame for their request on a connection.
  2. Prefill side: source blocks are read only by the sender thread and go back after the last frame
     for the request was written, after a publication deadline, or after ``abort_send``. A cancelled,
     expired or aborted request id is fenced for good: a later PUBLISH is answered QUIESCED, a later
     ``send`` returns its blocks at once.
  3. Untrusted bytes: every frame is size-capped before it is read and validated (its request id a
     kvown id) before any state changes; a violation raises ``PeerProtocolError(field=...)`` on the
     reader, which closes the connection (and with it, rule 1's proof for its destinations).
  4. ``on_returned`` runs on a link thread or the caller's thread, exactly once per lent set.

Invariants:
  INV-LINK-1  No block is given back while a DATA frame for it may still be scattered or gathered.
  INV-LINK-2  ``statistics()['owned'] + ['held']`` is the number of decode-side blocks lent and not yet
              given back; ``['sending']`` the same on the prefill side.
  INV-LINK-3  A request id's ``landed`` future is resolved exactly once: aux bytes, or ``TransferFailed``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvown.apps.serve.link import KVMemory, RecvHandle, SendHandle, TransferFailed
from kvown.core.errors import ConfigError, LocalProtocolError, PeerProtocolError
from kvown.core.fence import CancellationFence, CancelOrigin
from kvown.core.ids import is_valid_request_id

MAGIC, VERSION = b"KL", 1
HEADER = struct.Struct(">2sBBQII")
MAX_HELLO_NBYTES = 16 << 10
MAX_AUX_NBYTES = 64 << 10
MAX_BLOCKS_PER_REQUEST = 1 << 16


class Kind(enum.IntEnum):
    HELLO = 1
    PUBLISH = 2
    CANCEL = 3
    DATA = 4
    DONE = 5
    QUIESCED = 6
    REFUSED = 7


class Reason(enum.IntEnum):
    CANCELLED = 1
    EXPIRED = 2  # the prefill waited publish_timeout_s for a publication
    FENCED = 3  # the id was cancelled, expired or aborted earlier
    BAD_PUBLICATION = 4  # the publication's block count differs from the source's
    ABORTED = 5  # the prefill side gave the request up (abort_send)
    CLOSING = 6


@dataclass
class _Send(SendHandle):
    """A prefill-side send as this link tracks it: the connection it was paired with, if any."""

    conn: _Conn | None = None
    cancel: bool = False
    started: bool = False


class _Conn:
    """One TCP connection. Frames are written under ``lock``; one reader thread reads."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer = sock, peer
        self.lock = threading.Lock()
        self.alive = True
        self.rids: set[int] = set()  # decode: destinations published here; prefill: publications from here

    def send(self, kind: Kind, rid: int = 0, arg: int = 0, payload: bytes | memoryview = b"") -> None:
        head = HEADER.pack(MAGIC, VERSION, kind, rid, arg, len(payload))
        with self.lock:
            self.sock.sendall(head)
            if payload:
                self.sock.sendall(payload)

    def close(self) -> None:
        self.alive = False
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return buf


def _layout_diff(ours: dict[str, int | str], theirs: object) -> str | None:
    """Name the first layout field that differs, or None when they agree."""
    if not isinstance(theirs, dict):
        return "layout"
    for key in [*ours, *sorted(set(theirs) - set(ours))]:  # ours' order: primary fields before derived ones
        if ours.get(key) != theirs.get(key):
            return f"layout.{key}"
    return None


class KVLink:
    """Moves KV blocks between two servers' caches and owns the blocks lent to it meanwhile.

    ``resolve(name) -> "host:port" | None`` finds a writer's link address (the server passes its etcd
    view). ``publish_timeout_s`` bounds how long a prefill keeps source blocks for a decode that never
    publishes. ``chunk_blocks`` is how many blocks one DATA frame carries (the prefill checks for a
    cancel between frames).
    """

    def __init__(
        self,
        name: str,
        memory: KVMemory,
        *,
        on_returned: Callable[[int, tuple[int, ...], str], None],
        resolve: Callable[[str], str | None] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        publish_timeout_s: float = 30.0,
        chunk_blocks: int = 4,
        connect_timeout_s: float = 2.0,
    ) -> None:
        if chunk_blocks <= 0 or publish_timeout_s <= 0:
            raise ConfigError("chunk_blocks and publish_timeout_s must be positive", field="chunk_blocks")
        self.name, self.memory = name, memory
        self._on_returned, self._resolve = on_returned, resolve
        self._publish_timeout_s, self._chunk_blocks = publish_timeout_s, chunk_blocks
        self._connect_timeout_s = connect_timeout_s
        self._layout = dict(memory.describe())
        self._flat = [t.view(-1).view(torch.uint8) for t in memory.layers]
        self._lock = threading.RLock()
        self._closed = False
        # decode side
        self._dests: dict[int, RecvHandle] = {}
        self._writers: dict[str, _Conn] = {}
        # prefill side
        self._sends: dict[int, _Send] = {}
        self._publications: dict[int, tuple[_Conn, int]] = {}
        self._fences = CancellationFence()  # kvown's own: a fenced id stays fenced (ids are never reused)
        self._jobs: list[_Send] = []
        self._accepted: set[_Conn] = set()
        self._jobs_ready = threading.Condition(self._lock)
        self.counters = {
            "bytes_in": 0,
            "bytes_out": 0,
            "landed": 0,
            "recv_cancelled": 0,
            "recv_failed": 0,
            "sent": 0,
            "send_cancelled": 0,
            "send_expired": 0,
            "send_failed": 0,
            "protocol_errors": 0,
        }
        self.pace_s = 0.0  # tests only: sleep between DATA frames, to cancel mid-transfer
        self._listener = socket.create_server((host, port))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._threads = [
            threading.Thread(target=self._accept_loop, name=f"kvlink-accept-{name}", daemon=True),
            threading.Thread(target=self._sender_loop, name=f"kvlink-send-{name}", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------------------- decode side
    def receive(self, request_id: int, blocks: Sequence[int], writer: str) -> RecvHandle:
        """Publish ``blocks`` (lent by the server) as the destination of ``request_id`` to ``writer``.

        Called: once per request, from any thread. Ownership: on return the link owns ``blocks`` until
        ``on_returned``; if this raises, the blocks are still the caller's (nothing was published).
        After error: ``TransferFailed`` (writer unknown or unreachable), ``PeerProtocolError`` (layout
        refused at the handshake), ``LocalProtocolError`` (the id is already in use here).
        """
        blocks = tuple(blocks)
        if not is_valid_request_id(request_id):
            raise LocalProtocolError("not a kvown request id", field="request_id", value=request_id)
        if not (0 < len(blocks) <= MAX_BLOCKS_PER_REQUEST):
            raise LocalProtocolError("a destination needs 1..65536 blocks", field="blocks", n=len(blocks))
        conn = self._writer_conn(writer)
        handle = RecvHandle(request_id, blocks, writer)
        with self._lock:
            if request_id in self._dests:
                raise LocalProtocolError("request id already has a destination", request_id=request_id)
            if not conn.alive:
                raise TransferFailed("writer_lost", writer=writer)
            self._dests[request_id] = handle
            conn.rids.add(request_id)
        try:
            conn.send(Kind.PUBLISH, request_id, len(blocks))
        except OSError:
            conn.close()  # the reader sees the close and fails this destination (rule 1)
        return handle

    def release(self, request_id: int) -> None:
        """The server is done with a landed destination: give its blocks back now.

        Called: once, after ``landed`` resolved with aux. After error: ``LocalProtocolError`` when the
        destination has not landed (use ``cancel``).
        """
        with self._lock:
            handle = self._dests.get(request_id)
            if handle is None or handle.state != "landed":
                raise LocalProtocolError(
                    "release of a destination that has not landed",
                    request_id=request_id,
                    state=None if handle is None else handle.state,
                )
            self._give_back_dest(handle, "completed")

    def cancel(self, request_id: int) -> None:
        """Cancel a destination: idempotent, any time, any thread. A landed one goes back now (DONE was
        the writer's last frame); an unlanded one is HELD until the writer's last frame (rule 1)."""
        with self._lock:
            handle = self._dests.get(request_id)
            if handle is None or handle.state == "held":
                return
            if handle.state == "landed":
                self._give_back_dest(handle, "cancelled")
                return
            handle.state = "held"
            self.counters["recv_cancelled"] += 1
            handle.landed.set_exception(TransferFailed("cancelled", request_id=request_id))
            conn = self._writers.get(handle.writer)
        if conn is not None:
            try:
                conn.send(Kind.CANCEL, request_id)
            except OSError:
                conn.close()

    def peer_gone(self, writer: str) -> None:
        """Discovery saw ``writer`` leave (lease expired or revoked): drop its connection. Its reader
        then fails every unlanded destination (and only then, with the proof of rule 1, gives them back)."""
        with self._lock:
            conn = self._writers.get(writer)
        if conn is not None:
            conn.close()

    def _writer_conn(self, writer: str) -> _Conn:
        with self._lock:
            conn = self._writers.get(writer)
            if conn is not None and conn.alive:
                return conn
        address = self._resolve(writer) if self._resolve is not None else None
        if not address:
            raise TransferFailed("writer_unknown", writer=writer)
        host, port = address.rsplit(":", 1)
        try:
            sock = socket.create_connection((host, int(port)), timeout=self._connect_timeout_s)
        except OSError as error:
            raise TransferFailed("writer_unreachable", writer=writer, error=str(error)) from error
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, writer)
            conn.send(Kind.HELLO, payload=self._hello())
            kind, _, _, payload = self._read_frame(sock, handshake=True)
            if kind == Kind.REFUSED:
                raise PeerProtocolError(
                    "the writer refused our KV layout",
                    field=payload.decode(errors="replace")[:80],
                    writer=writer,
                )
            self._check_hello(kind, payload, expect=writer)
            sock.settimeout(None)
        except (OSError, ConnectionError) as error:
            sock.close()
            raise TransferFailed("writer_handshake_failed", writer=writer, error=str(error)) from error
        except PeerProtocolError:
            sock.close()
            raise
        with self._lock:
            old = self._writers.get(writer)
            if old is not None and old.alive:  # another thread won the race: use its connection
                sock.close()
                return old
            self._writers[writer] = conn
        threading.Thread(
            target=self._reader, args=(conn,), name=f"kvlink-read-{self.name}-{writer}", daemon=True
        ).start()
        return conn

    def _give_back_dest(self, handle: RecvHandle, outcome: str) -> None:
        """Called with the lock held, only where rule 1 holds for ``handle``."""
        del self._dests[handle.request_id]
        conn = self._writers.get(handle.writer)
        if conn is not None:
            conn.rids.discard(handle.request_id)
        handle.state, handle.outcome = "gone", outcome
        self._on_returned(handle.request_id, handle.blocks, outcome)
        handle.returned.set()

    def _on_decode_frame(self, conn: _Conn, kind: Kind, rid: int, arg: int, payload: bytearray) -> None:
        with self._lock:
            handle = self._dests.get(rid)
            if handle is None or rid not in conn.rids:
                raise PeerProtocolError(
                    "frame for a request not published to this writer",
                    field="request_id",
                    request_id=rid,
                    kind=kind.name,
                )
        if kind == Kind.DATA:
            n, rem = divmod(len(payload), self.memory.block_nbytes)
            if rem or n == 0 or arg + n > len(handle.blocks):
                raise PeerProtocolError(
                    "DATA outside the destination",
                    field="arg",
                    request_id=rid,
                    first=arg,
                    nbytes=len(payload),
                )
            self._scatter(handle.blocks[arg : arg + n], payload)  # lands even when held (rule 1)
            with self._lock:
                self.counters["bytes_in"] += len(payload)
            return
        with self._lock:
            if kind == Kind.DONE:
                if len(payload) > MAX_AUX_NBYTES:
                    raise PeerProtocolError("aux too large", field="payload", nbytes=len(payload))
                if handle.state == "owned":
                    handle.state = "landed"
                    self.counters["landed"] += 1
                    handle.landed.set_result(bytes(payload))
                    conn.rids.discard(rid)  # the writer is done with it: later frames for it are hostile
                else:
                    self._give_back_dest(handle, "cancelled")
            elif kind == Kind.QUIESCED:
                if handle.state == "owned":
                    self.counters["recv_failed"] += 1
                    reason = Reason(arg).name.lower() if arg in Reason._value2member_map_ else str(arg)
                    handle.landed.set_exception(TransferFailed(f"writer_{reason}", request_id=rid))
                self._give_back_dest(handle, "cancelled" if handle.state == "held" else "failed")
            else:
                raise PeerProtocolError("frame kind not allowed from a writer", field="kind", value=int(kind))

    def _decode_conn_closed(self, conn: _Conn) -> None:
        """The reader has exited: nothing writes into this connection's destinations any more."""
        with self._lock:
            conn.alive = False
            if self._writers.get(conn.peer) is conn:
                del self._writers[conn.peer]
            for rid in list(conn.rids):
                handle = self._dests.get(rid)
                if handle is None or handle.state == "landed":
                    continue
                if handle.state == "owned":
                    self.counters["recv_failed"] += 1
                    handle.landed.set_exception(
                        TransferFailed("writer_lost", writer=conn.peer, request_id=rid)
                    )
                self._give_back_dest(handle, "cancelled" if handle.state == "held" else "failed")
            conn.rids.clear()

    def _scatter(self, blocks: Sequence[int], payload: bytearray) -> None:
        src = torch.frombuffer(payload, dtype=torch.uint8)
        pos = 0
        for b in blocks:
            for region, offset, nbytes in self.memory.chunks(b):
                self._flat[region][offset : offset + nbytes].copy_(src[pos : pos + nbytes])
                pos += nbytes

    # ------------------------------------------------------------------------------ prefill side
    def send(self, request_id: int, blocks: Sequence[int], aux: bytes = b"") -> SendHandle:
        """Send the KV in ``blocks`` (lent by the server, already written) to whoever publishes a
        destination for ``request_id`` within ``publish_timeout_s``.

        Called: once per request, from any thread, after the KV write finished (on a GPU: after the
        producer stream is synchronised). Ownership: the link owns ``blocks`` until ``on_returned``.
        After error: ``LocalProtocolError`` for a reused id or oversized aux; the blocks stay the caller's.
        """
        blocks = tuple(blocks)
        if not is_valid_request_id(request_id):
            raise LocalProtocolError("not a kvown request id", field="request_id", value=request_id)
        if len(aux) > MAX_AUX_NBYTES or not (0 < len(blocks) <= MAX_BLOCKS_PER_REQUEST):
            raise LocalProtocolError("bad send", field="aux" if len(aux) > MAX_AUX_NBYTES else "blocks")
        handle = _Send(request_id, blocks, bytes(aux), time.monotonic() + self._publish_timeout_s)
        with self._lock:
            if request_id in self._sends:
                raise LocalProtocolError("request id is already being sent", request_id=request_id)
            self._sends[request_id] = handle
            if self._fences.is_fenced(request_id):
                self._finish_send(handle, "cancelled")
            elif request_id in self._publications:
                self._pair(handle, *self._publications.pop(request_id))
        return handle

    def abort_send(self, request_id: int) -> None:
        """The prefill side gives a request up (its router will never ask a decode to publish):
        source blocks go back as soon as no frame reads them. Idempotent."""
        with self._lock:
            self._fence(request_id)
            handle = self._sends.get(request_id)
            if handle is None:
                return
            if handle.conn is None:
                self._finish_send(handle, "aborted")
            else:
                handle.cancel = True

    def _fence(self, rid: int, origin: CancelOrigin = CancelOrigin.CLIENT) -> None:
        self._fences.install(rid, origin)

    def _pair(self, handle: _Send, conn: _Conn, num_blocks: int) -> None:
        """Lock held. A send met its publication: queue it for the sender thread."""
        if num_blocks != len(handle.blocks):
            self._fence(handle.request_id, CancelOrigin.PEER)
            self._send_quiet(conn, handle.request_id, Reason.BAD_PUBLICATION)
            self._finish_send(handle, "failed")
            return
        handle.conn = conn
        self._jobs.append(handle)
        self._jobs_ready.notify()

    def _finish_send(self, handle: _Send, outcome: str) -> None:
        """Lock held; only once no frame reads ``handle.blocks`` any more (INV-LINK-1)."""
        if self._sends.get(handle.request_id) is handle:
            del self._sends[handle.request_id]
        key = {
            "completed": "sent",
            "cancelled": "send_cancelled",
            "aborted": "send_cancelled",
            "expired": "send_expired",
        }.get(outcome, "send_failed")
        self.counters[key] += 1
        self._on_returned(handle.request_id, handle.blocks, outcome)
        handle.done.set_result(outcome)

    def _send_quiet(self, conn: _Conn, rid: int, reason: Reason) -> None:
        try:
            conn.send(Kind.QUIESCED, rid, int(reason))
        except OSError:
            conn.close()

    def _on_prefill_frame(self, conn: _Conn, kind: Kind, rid: int, arg: int, payload: bytearray) -> None:
        if payload:
            raise PeerProtocolError("PUBLISH and CANCEL carry no payload", field="payload", kind=kind.name)
        with self._lock:
            handle = self._sends.get(rid)
            if kind == Kind.PUBLISH:
                if not (0 < arg <= MAX_BLOCKS_PER_REQUEST):
                    raise PeerProtocolError("publication block count out of range", field="arg", value=arg)
                if rid in self._publications or (handle is not None and handle.conn is not None):
                    raise PeerProtocolError("request published twice", field="request_id", request_id=rid)
                if self._fences.is_fenced(rid):
                    self._send_quiet(conn, rid, Reason.FENCED)
                elif handle is not None:
                    self._pair(handle, conn, arg)
                else:
                    self._publications[rid] = (conn, arg)
                    conn.rids.add(rid)
            elif kind == Kind.CANCEL:
                if handle is not None and handle.conn is conn:
                    handle.cancel = (
                        True  # the sender thread ends it with QUIESCED (or DONE if it just finished)
                    )
                    return
                self._fence(rid, CancelOrigin.PEER)
                if handle is not None and handle.conn is None:
                    self._finish_send(handle, "cancelled")
                if self._publications.get(rid, (None,))[0] is conn:
                    del self._publications[rid]
                    conn.rids.discard(rid)
                    self._send_quiet(conn, rid, Reason.CANCELLED)
                # else: DONE or QUIESCED already went out for rid on this stream; the decode side has it.
            else:
                raise PeerProtocolError(
                    "frame kind not allowed from a receiver", field="kind", value=int(kind)
                )

    def _prefill_conn_closed(self, conn: _Conn) -> None:
        with self._lock:
            conn.alive = False
            for rid in list(conn.rids):
                if self._publications.get(rid, (None,))[0] is conn:
                    del self._publications[rid]
            for handle in self._sends.values():
                if handle.conn is conn:
                    handle.cancel = True

    def _sender_loop(self) -> None:
        while True:
            with self._lock:
                self._expire_sends()
                if self._closed:
                    for handle in self._jobs:  # never started: nothing reads their blocks
                        self._finish_send(handle, "aborted")
                    self._jobs.clear()
                    return
                if not self._jobs:
                    self._jobs_ready.wait(timeout=0.2)
                    continue
                handle = self._jobs.pop(0)
                handle.started = True
            self._transfer(handle)

    def _transfer(self, handle: _Send) -> None:
        """Sender thread: the only reader of a send's source blocks (INV-LINK-1)."""
        conn, rid, outcome = handle.conn, handle.request_id, "completed"
        assert conn is not None
        try:
            for first in range(0, len(handle.blocks), self._chunk_blocks):
                if handle.cancel or not conn.alive:
                    outcome = "cancelled"
                    break
                payload = self._gather(handle.blocks[first : first + self._chunk_blocks])
                conn.send(Kind.DATA, rid, first, payload)
                with self._lock:
                    self.counters["bytes_out"] += len(payload)
                if self.pace_s:
                    time.sleep(self.pace_s)
            if outcome == "completed":
                conn.send(Kind.DONE, rid, 0, handle.aux)
            elif conn.alive:
                conn.send(Kind.QUIESCED, rid, int(Reason.CANCELLED))
        except OSError:
            conn.close()
            outcome = "failed"
        with self._lock:
            conn.rids.discard(rid)
            if outcome != "completed":
                self._fence(rid)
            self._finish_send(handle, outcome)

    def _expire_sends(self) -> None:
        """Lock held. Sends nobody published in time go back (rule 2)."""
        now = time.monotonic()
        for handle in [h for h in self._sends.values() if h.conn is None and h.deadline_s <= now]:
            self._fence(handle.request_id, CancelOrigin.TIMEOUT)
            self._finish_send(handle, "expired")

    def _gather(self, blocks: Sequence[int]) -> bytes:
        parts = [
            self._flat[region][offset : offset + nbytes]
            for b in blocks
            for region, offset, nbytes in self.memory.chunks(b)
        ]
        return torch.cat(parts).cpu().numpy().tobytes()

    # ---------------------------------------------------------------------------------- plumbing
    def _hello(self) -> bytes:
        return json.dumps({"name": self.name, "layout": self._layout}, sort_keys=True).encode()

    def _check_hello(self, kind: int, payload: bytearray, *, expect: str | None) -> str:
        if kind != Kind.HELLO:
            raise PeerProtocolError("first frame must be HELLO", field="kind", value=kind)
        try:
            hello = json.loads(payload)
        except (ValueError, UnicodeDecodeError) as error:
            raise PeerProtocolError("HELLO is not JSON", field="hello") from error
        if not isinstance(hello, dict) or not isinstance(hello.get("name"), str):
            raise PeerProtocolError("HELLO has no name", field="hello.name")
        if expect is not None and hello["name"] != expect:
            raise PeerProtocolError(
                "the address answered with another name",
                field="hello.name",
                expected=expect,
                got=hello["name"][:80],
            )
        diff = _layout_diff(self._layout, hello.get("layout"))
        if diff is not None:
            theirs = hello.get("layout")
            raise PeerProtocolError(
                "KV layouts differ",
                field=diff,
                ours=self._layout.get(diff[7:]),
                theirs=theirs.get(diff[7:]) if isinstance(theirs, dict) else theirs,
            )
        return str(hello["name"])

    def _read_frame(
        self, sock: socket.socket, *, handshake: bool = False
    ) -> tuple[Kind, int, int, bytearray]:
        magic, version, kind, rid, arg, nbytes = HEADER.unpack(_recv_exact(sock, HEADER.size))
        if magic != MAGIC or version != VERSION:
            raise PeerProtocolError("not a kvlink frame", field="magic" if magic != MAGIC else "version")
        if kind not in Kind._value2member_map_:
            raise PeerProtocolError("unknown frame kind", field="kind", value=kind)
        if not is_valid_request_id(rid):  # the fence takes kvown request ids only
            raise PeerProtocolError("request id out of range", field="request_id", value=rid)
        limit = MAX_HELLO_NBYTES if handshake else max(self._chunk_blocks_cap(), MAX_AUX_NBYTES)
        if nbytes > limit:
            raise PeerProtocolError("frame too large", field="payload_nbytes", nbytes=nbytes, limit=limit)
        return Kind(kind), rid, arg, _recv_exact(sock, nbytes) if nbytes else bytearray()

    def _chunk_blocks_cap(self) -> int:
        # a peer may use a bigger chunk than ours; cap what we accept at 64 blocks per frame
        return 64 * self.memory.block_nbytes

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(
                target=self._serve_receiver, args=(sock,), name=f"kvlink-read-{self.name}-in", daemon=True
            ).start()

    def _serve_receiver(self, sock: socket.socket) -> None:
        """Prefill side: handshake a decode server's connection, then read its frames."""
        sock.settimeout(self._connect_timeout_s)
        try:
            kind, _, _, payload = self._read_frame(sock, handshake=True)
            peer = self._check_hello(kind, payload, expect=None)
        except PeerProtocolError as error:
            self.counters["protocol_errors"] += 1
            with contextlib.suppress(OSError):
                field_name = str(getattr(error, "field", "hello")).encode()[:256]
                sock.sendall(HEADER.pack(MAGIC, VERSION, Kind.REFUSED, 0, 0, len(field_name)) + field_name)
            sock.close()
            return
        except (OSError, ConnectionError, struct.error):
            sock.close()
            return
        sock.settimeout(None)
        conn = _Conn(sock, peer)
        with self._lock:
            if self._closed:
                sock.close()
                return
            self._accepted.add(conn)
        try:
            conn.send(Kind.HELLO, payload=self._hello())
        except OSError:
            sock.close()
            return
        self._reader(conn, prefill=True)

    def _reader(self, conn: _Conn, *, prefill: bool = False) -> None:
        try:
            while True:
                kind, rid, arg, payload = self._read_frame(conn.sock)
                if prefill:
                    self._on_prefill_frame(conn, kind, rid, arg, payload)
                else:
                    self._on_decode_frame(conn, kind, rid, arg, payload)
        except PeerProtocolError:
            self.counters["protocol_errors"] += 1
        except (OSError, ConnectionError, struct.error):
            pass
        finally:
            conn.close()
            conn.sock.close()
            (self._prefill_conn_closed if prefill else self._decode_conn_closed)(conn)
            with self._lock:
                self._accepted.discard(conn)

    def statistics(self) -> dict[str, int]:
        """Blocks the link holds for the server right now, and its counters (INV-LINK-2)."""
        with self._lock:
            owned = sum(len(h.blocks) for h in self._dests.values() if h.state != "held")
            held = sum(len(h.blocks) for h in self._dests.values() if h.state == "held")
            sending = sum(len(h.blocks) for h in self._sends.values())
            return {
                "owned": owned,
                "held": held,
                "sending": sending,
                "destinations": len(self._dests),
                "sends": len(self._sends),
                "connections": len(self._writers),
                **self.counters,
            }

    def close(self) -> None:
        """Stop accepting and drop every connection. Blocks still lent go back through their readers'
        exit (decode) or as failed sends (prefill). Called: once, at server shutdown."""
        with self._lock:
            self._closed = True
            self._jobs_ready.notify_all()
            conns = [*self._writers.values(), *self._accepted]
            for handle in list(self._sends.values()):
                if handle.conn is None:
                    self._finish_send(handle, "aborted")
                else:
                    handle.cancel = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread (close alone does not)
        self._listener.close()
        for conn in conns:
            conn.close()


__all__ = ["KVLink", "KVMemory", "RecvHandle", "SendHandle", "TransferFailed"]  # the handles: re-exported from link
