"""Metadata rendezvous between separately launched worlds: a tiny authenticated TCP registry.

Owns: ``RendezvousServer`` (a ``{name: blob}`` table served over TCP) and the ``publish`` / ``lookup``
clients. It carries NIXL agent metadata between MPI worlds that share no communicator (inside one
world the runtime uses ``comm.allgather(endpoint.metadata())`` instead). Slow path only: one
connection per request.

Wire: ``header(b"KVRV", version, kind, body_nbytes) | msgpack body | HMAC(key, challenge || header ||
body)``; each connection opens with a HELLO carrying a fresh challenge that binds its REQUEST and
RESPONSE, so a recorded frame cannot be replayed elsewhere (docs/design.md section 14).

Rules:
  1. Untrusted bytes: frames are size-capped before anything is read into memory, the tag is checked
     (constant time) before the body is decoded, msgpack only (never pickle), and every field is
     validated. A violation raises ``PeerProtocolError(field=...)`` and changes no state.
  2. Every wait is bounded: socket timeouts on each call; ``lookup`` retries until ``timeout_s``.
  3. Re-publishing a name replaces its blob (an agent re-publishes after registering more memory).
  4. The key is a per-job secret of at least 16 bytes; the runtime reads it (hex) from ``KVOWN_JOB_KEY``.

Invariants:
  INV-RV-1  The table changes only on an authenticated, fully validated publish request.
  INV-RV-2  A client returns a blob only from a response whose tag verifies under the job key and the
            challenge of its own connection.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Mapping
from typing import Any

import msgpack

from kvown.core.errors import AdapterError, ConfigError, LocalProtocolError, PeerProtocolError

MAGIC = b"KVRV"
VERSION = 1
HEADER = struct.Struct(">4sBBI")
TAG_NBYTES = 32
CHALLENGE_NBYTES = 16
MAX_NAME_LEN = 256
MAX_BLOB_NBYTES = 1 << 20  # NIXL metadata is ~0.5 KiB plus a few dozen bytes per registration
MAX_BODY_NBYTES = MAX_BLOB_NBYTES + 4096
MIN_KEY_NBYTES = 16
JOB_KEY_ENV = "KVOWN_JOB_KEY"


class FrameKind(enum.IntEnum):
    HELLO = 1
    REQUEST = 2
    RESPONSE = 3


class Op(enum.IntEnum):
    PUBLISH = 1
    LOOKUP = 2


class Reply(enum.IntEnum):
    OK = 0
    NOT_FOUND = 1
    REJECTED = 2  # the request failed validation; ``field`` names the part


def job_key_from_env(env: Mapping[str, str] | None = None) -> bytes:
    """Read the per-job HMAC key from ``KVOWN_JOB_KEY`` (hex, as ``kvown.rank.connect_rendezvous`` reads it).

    Called: once at startup. After error: ``ConfigError``; nothing started.
    """
    value = (os.environ if env is None else env).get(JOB_KEY_ENV, "")
    try:
        key = bytes.fromhex(value)
    except ValueError:
        raise ConfigError("job key is not hex", field="key", fix=_KEY_FIX) from None
    _check_key(key)
    return key


_KEY_FIX = f"export {JOB_KEY_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))') on every rank"


def _check_key(key: bytes) -> None:
    if not isinstance(key, (bytes, bytearray)) or len(key) < MIN_KEY_NBYTES:
        raise ConfigError("job key missing or shorter than 16 bytes", field="key", fix=_KEY_FIX)


# ----------------------------------------------------------------------------- frames


def _tag(key: bytes, challenge: bytes, header: bytes, body: bytes) -> bytes:
    return hmac.new(key, challenge + header + body, hashlib.sha256).digest()


def _send_frame(sock: socket.socket, key: bytes, challenge: bytes, kind: FrameKind, body: dict[str, Any]) -> None:
    payload = msgpack.packb(body, use_bin_type=True)
    header = HEADER.pack(MAGIC, VERSION, int(kind), len(payload))
    sock.sendall(header + payload + _tag(key, challenge, header, payload))


def _recv_exact(sock: socket.socket, nbytes: int, deadline: float) -> bytes:
    chunks, got = [], 0
    while got < nbytes:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("frame not received in time")
        sock.settimeout(left)
        chunk = sock.recv(min(nbytes - got, 1 << 16))
        if not chunk:
            raise ConnectionError("connection closed mid-frame")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv_frame(sock: socket.socket, key: bytes, challenge: bytes, want: FrameKind,
                deadline: float) -> dict[str, Any]:
    """Read one frame, check it in order (header, size cap, tag, body) and return the decoded body."""
    header = _recv_exact(sock, HEADER.size, deadline)
    magic, version, kind, body_nbytes = HEADER.unpack(header)
    if magic != MAGIC:
        raise PeerProtocolError("not a kvown rendezvous frame", field="magic")
    if version != VERSION:
        raise PeerProtocolError("unsupported rendezvous version", field="version", version=version)
    if kind != want:
        raise PeerProtocolError("unexpected frame kind", field="kind", kind=kind, expected=int(want))
    if body_nbytes > MAX_BODY_NBYTES:
        raise PeerProtocolError("frame too large", field="body_nbytes", nbytes=body_nbytes,
                                max_nbytes=MAX_BODY_NBYTES)
    body = _recv_exact(sock, body_nbytes, deadline)
    tag = _recv_exact(sock, TAG_NBYTES, deadline)
    if not hmac.compare_digest(tag, _tag(key, challenge, header, body)):
        raise PeerProtocolError("frame authentication failed", field="hmac")
    try:
        decoded = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:
        raise PeerProtocolError("frame body is not valid msgpack", field="body") from e
    if not isinstance(decoded, dict):
        raise PeerProtocolError("frame body is not a map", field="body")
    return decoded


def _get(body: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise PeerProtocolError("missing or mistyped field", field=name)
    return value


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LEN:
        raise PeerProtocolError("name must be 1..256 characters", field="name")
    return name


def _check_blob(blob: Any) -> bytes:
    if not isinstance(blob, bytes) or len(blob) > MAX_BLOB_NBYTES:
        raise PeerProtocolError("blob must be bytes of at most 1 MiB", field="blob")
    return blob


# ----------------------------------------------------------------------------- server


class RendezvousServer:
    """Serves ``{name: blob}`` on ``host:port`` (port 0 picks a free port; see ``address``).

    Called: started once by the job launcher (or rank 0 of one world), its own named threads serve.
    After error: a bad request gets a REJECTED reply (when its tag verified) or the connection closed;
    the reason is appended to ``errors``; the table is unchanged.
    """

    def __init__(self, host: str, port: int, key: bytes, *, io_timeout_s: float = 5.0,
                 max_connections: int = 64) -> None:
        _check_key(key)
        self._key = bytes(key)
        self._io_timeout_s = io_timeout_s
        self._table: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self.errors: list[PeerProtocolError] = []
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.2)  # the accept loop re-checks _stop this often
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="kvown-rendezvous-accept", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return host, port

    def snapshot(self) -> dict[str, bytes]:
        """A copy of the table. Called: by tests and diagnostics, any thread."""
        with self._lock:
            return dict(self._table)

    def close(self) -> None:
        """Stop accepting and join the accept thread (bounded). Idempotent."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()

    def __enter__(self) -> RendezvousServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                conn.close()  # over the connection cap: the client retries
                continue
            threading.Thread(target=self._serve_one, args=(conn,), name="kvown-rendezvous-conn",
                             daemon=True).start()

    def _serve_one(self, conn: socket.socket) -> None:
        try:
            with conn:
                deadline = time.monotonic() + self._io_timeout_s
                conn.settimeout(self._io_timeout_s)
                challenge = secrets.token_bytes(CHALLENGE_NBYTES)
                _send_frame(conn, self._key, b"", FrameKind.HELLO, {"challenge": challenge})
                try:
                    body = _recv_frame(conn, self._key, challenge, FrameKind.REQUEST, deadline)
                    reply = self._handle(body)
                except PeerProtocolError as e:
                    self.errors.append(e)
                    if e.field == "hmac" or e.field in ("magic", "version", "kind", "body_nbytes"):
                        return  # unauthenticated or unframed: say nothing, just close
                    reply = {"code": int(Reply.REJECTED), "field": str(e.field)}
                _send_frame(conn, self._key, challenge, FrameKind.RESPONSE, reply)
        except (OSError, TimeoutError, ConnectionError):
            pass  # a client that vanished or stalled; nothing changed
        finally:
            self._slots.release()

    def _handle(self, body: dict[str, Any]) -> dict[str, Any]:
        op = _get(body, "op", int)
        name = _check_name(body.get("name"))
        if op == Op.PUBLISH:
            blob = _check_blob(body.get("blob"))
            with self._lock:
                self._table[name] = blob  # INV-RV-1: only after every check above
            return {"code": int(Reply.OK)}
        if op == Op.LOOKUP:
            with self._lock:
                found = self._table.get(name)
            if found is None:
                return {"code": int(Reply.NOT_FOUND)}
            return {"code": int(Reply.OK), "blob": found}
        raise PeerProtocolError("unknown op", field="op", op=op)


# ----------------------------------------------------------------------------- clients


def _request(addr: tuple[str, int], key: bytes, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    with socket.create_connection(addr, timeout=timeout_s) as sock:
        return _exchange(sock, key, body, deadline)


def _exchange(sock: socket.socket, key: bytes, body: dict[str, Any], deadline: float) -> dict[str, Any]:
    """One request on a connected socket: read HELLO, send the request bound to its challenge, read and
    check the reply. Split from ``_request`` so the fuzz targets can drive it without a socket."""
    hello = _recv_frame(sock, key, b"", FrameKind.HELLO, deadline)
    challenge = hello.get("challenge")
    if not isinstance(challenge, bytes) or len(challenge) != CHALLENGE_NBYTES:
        raise PeerProtocolError("bad challenge", field="challenge")
    _send_frame(sock, key, challenge, FrameKind.REQUEST, body)
    reply = _recv_frame(sock, key, challenge, FrameKind.RESPONSE, deadline)  # INV-RV-2
    code = _get(reply, "code", int)
    if code not in {r.value for r in Reply}:
        raise PeerProtocolError("unknown reply code", field="code", code=code)
    if code == Reply.REJECTED:
        raise PeerProtocolError("rendezvous server rejected the request", field=str(reply.get("field")))
    return reply


def _blob_of(reply: dict[str, Any]) -> bytes | None:
    """A checked lookup reply's blob, or None for NOT_FOUND. Raises ``PeerProtocolError(field="blob")``."""
    return _check_blob(reply.get("blob")) if reply["code"] == Reply.OK else None


def _check_local(name: Any, blob: Any = b"") -> None:
    """Our own arguments: a bad one is our bug (``LocalProtocolError``), not the peer's."""
    try:
        _check_name(name)
        _check_blob(blob)
    except PeerProtocolError as e:
        raise LocalProtocolError(e.message, field=e.field) from None


def publish(addr: tuple[str, int], name: str, blob: bytes, key: bytes, timeout_s: float = 5.0) -> None:
    """Store ``blob`` under ``name`` (replacing any earlier blob).

    Called: once per agent at startup, and again after it registers more memory; any thread.
    After error: ``LocalProtocolError`` for a bad name or blob (nothing sent);
    ``PeerProtocolError(field=...)`` for a bad/forged reply or a rejected request;
    ``AdapterError(op="publish")`` when the server cannot be reached in ``timeout_s``. Retrying is safe.
    """
    _check_key(key)
    _check_local(name, bytes(blob))
    try:
        _request(addr, key, {"op": int(Op.PUBLISH), "name": name, "blob": bytes(blob)}, timeout_s)
    except (OSError, TimeoutError) as e:
        raise AdapterError("rendezvous server unreachable", cause=e, op="publish", addr=addr, name=name) from e


def lookup(addr: tuple[str, int], name: str, key: bytes, timeout_s: float, poll_interval_s: float = 0.05) -> bytes:
    """Return the blob published under ``name``, waiting up to ``timeout_s`` for it to appear.

    Called: at startup, once per remote agent; any thread. Retries NOT_FOUND and connection failures
    until the deadline (the peer world may start later than ours).
    After error: ``AdapterError(op="lookup")`` at the deadline; ``PeerProtocolError`` at once for a
    forged or malformed reply (a wrong key is not retried).
    """
    _check_key(key)
    _check_local(name)
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AdapterError("rendezvous lookup timed out", cause=last, op="lookup", addr=addr, name=name,
                               timeout_s=timeout_s)
        try:
            reply = _request(addr, key, {"op": int(Op.LOOKUP), "name": name}, min(left, 5.0))
        except (OSError, TimeoutError) as e:
            last = e
        else:
            blob = _blob_of(reply)
            if blob is not None:
                return blob
        time.sleep(min(poll_interval_s, max(0.0, deadline - time.monotonic())))
