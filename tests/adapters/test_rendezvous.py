"""Tests for the authenticated metadata rendezvous (127.0.0.1 only, every wait bounded)."""

from __future__ import annotations

import socket
import threading
import time

import msgpack
import pytest

from kvown.adapters import rendezvous as rv
from kvown.adapters.rendezvous import RendezvousServer, job_key_from_env, lookup, publish
from kvown.core.errors import AdapterError, ConfigError, LocalProtocolError, PeerProtocolError

KEY = b"k" * 32
OTHER_KEY = b"x" * 32


@pytest.fixture
def server():
    s = RendezvousServer("127.0.0.1", 0, KEY, io_timeout_s=2.0)
    yield s
    s.close()


def _wait_errors(server: RendezvousServer, n: int) -> list[PeerProtocolError]:
    deadline = time.monotonic() + 5
    while len(server.errors) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.errors


class RawClient:
    """Speaks the wire format by hand so tests can send malformed or replayed frames."""

    def __init__(self, addr) -> None:
        self.sock = socket.create_connection(addr, timeout=5)
        self.deadline = time.monotonic() + 5
        hello = rv._recv_frame(self.sock, KEY, b"", rv.FrameKind.HELLO, self.deadline)
        self.challenge = hello["challenge"]

    def frame(self, body: bytes, key: bytes = KEY, kind=rv.FrameKind.REQUEST, challenge=None) -> bytes:
        header = rv.HEADER.pack(rv.MAGIC, rv.VERSION, int(kind), len(body))
        return header + body + rv._tag(key, self.challenge if challenge is None else challenge, header, body)

    def reply(self) -> dict:
        return rv._recv_frame(self.sock, KEY, self.challenge, rv.FrameKind.RESPONSE, self.deadline)

    def closed_by_peer(self) -> bool:
        self.sock.settimeout(5)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


@pytest.mark.timeout(60)
def test_publish_lookup_roundtrip_and_replace(server: RendezvousServer) -> None:
    publish(server.address, "ctx-0", b"meta-v1", KEY)
    assert lookup(server.address, "ctx-0", KEY, timeout_s=2) == b"meta-v1"
    publish(server.address, "ctx-0", b"meta-v2", KEY)  # re-publish after more registrations
    assert lookup(server.address, "ctx-0", KEY, timeout_s=2) == b"meta-v2"
    big = bytes(range(256)) * 4096  # 1 MiB, the cap
    publish(server.address, "gen-0", big, KEY)
    assert lookup(server.address, "gen-0", KEY, timeout_s=2) == big
    assert server.snapshot() == {"ctx-0": b"meta-v2", "gen-0": big}


@pytest.mark.timeout(60)
def test_lookup_waits_for_a_late_publish_and_times_out(server: RendezvousServer) -> None:
    t = threading.Timer(0.3, publish, args=(server.address, "late", b"blob", KEY))
    t.start()
    try:
        assert lookup(server.address, "late", KEY, timeout_s=5) == b"blob"
    finally:
        t.join(5)
    t0 = time.monotonic()
    with pytest.raises(AdapterError) as e:
        lookup(server.address, "never", KEY, timeout_s=0.3)
    assert e.value.op == "lookup"
    assert time.monotonic() - t0 < 2


@pytest.mark.timeout(60)
def test_wrong_key_is_refused_both_ways(server: RendezvousServer) -> None:
    with pytest.raises(PeerProtocolError) as e:
        publish(server.address, "evil", b"x", OTHER_KEY)
    assert e.value.field == "hmac"  # the client refuses the server's HELLO
    with pytest.raises(PeerProtocolError) as e:
        lookup(server.address, "anything", OTHER_KEY, timeout_s=2)
    assert e.value.field == "hmac"
    c = RawClient(server.address)  # a forged request: right framing, wrong key
    c.sock.sendall(c.frame(msgpack.packb({"op": 1, "name": "evil", "blob": b"x"}), key=OTHER_KEY))
    assert c.closed_by_peer()
    c.close()
    assert _wait_errors(server, 1)[-1].field == "hmac"
    assert server.snapshot() == {}


@pytest.mark.timeout(60)
def test_replayed_request_fails_on_another_connection(server: RendezvousServer) -> None:
    c1 = RawClient(server.address)
    recorded = c1.frame(msgpack.packb({"op": 1, "name": "n", "blob": b"v1"}))
    c1.sock.sendall(recorded)
    assert c1.reply()["code"] == rv.Reply.OK
    c1.close()
    publish(server.address, "n", b"v2", KEY)
    c2 = RawClient(server.address)
    c2.sock.sendall(recorded)  # bound to c1's challenge
    assert c2.closed_by_peer()
    c2.close()
    assert _wait_errors(server, 1)[-1].field == "hmac"
    assert server.snapshot() == {"n": b"v2"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (lambda c: b"XXXX" + c.frame(b"")[4:], "magic"),
        (lambda c: rv.HEADER.pack(rv.MAGIC, 9, 2, 0), "version"),
        (lambda c: c.frame(b"", kind=rv.FrameKind.RESPONSE), "kind"),
        (lambda c: rv.HEADER.pack(rv.MAGIC, rv.VERSION, 2, rv.MAX_BODY_NBYTES + 1), "body_nbytes"),
    ],
)
def test_unframed_requests_are_dropped_without_reply(server: RendezvousServer, raw, field) -> None:
    c = RawClient(server.address)
    c.sock.sendall(raw(c))
    assert c.closed_by_peer()
    c.close()
    assert _wait_errors(server, 1)[-1].field == field
    assert server.snapshot() == {}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"\xc1", "body"),  # 0xc1 is never valid msgpack
        (msgpack.packb([1, 2]), "body"),
        (msgpack.packb({"name": "n", "blob": b"x"}), "op"),
        (msgpack.packb({"op": True, "name": "n", "blob": b"x"}), "op"),
        (msgpack.packb({"op": 7, "name": "n"}), "op"),
        (msgpack.packb({"op": 1, "name": "", "blob": b"x"}), "name"),
        (msgpack.packb({"op": 1, "name": "n" * 257, "blob": b"x"}), "name"),
        (msgpack.packb({"op": 1, "name": "n", "blob": "text"}), "blob"),
        (msgpack.packb({"op": 1, "name": "n", "blob": b"x" * (rv.MAX_BLOB_NBYTES + 1)}), "blob"),
    ],
)
def test_authenticated_but_malformed_requests_are_rejected(server: RendezvousServer, body, field) -> None:
    c = RawClient(server.address)
    c.sock.sendall(c.frame(body))
    reply = c.reply()
    c.close()
    assert reply == {"code": int(rv.Reply.REJECTED), "field": field}
    assert server.snapshot() == {}


def _evil_server(payload_for, stop: threading.Event) -> tuple[str, int]:
    """A server that answers every connection with ``payload_for(challenge)`` bytes."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.1)

    def loop() -> None:
        with srv:
            while not stop.is_set():
                try:
                    conn, _ = srv.accept()
                except TimeoutError:
                    continue
                with conn:
                    challenge = b"c" * rv.CHALLENGE_NBYTES
                    rv._send_frame(conn, KEY, b"", rv.FrameKind.HELLO, {"challenge": challenge})
                    conn.settimeout(2)
                    try:
                        conn.recv(1 << 20)
                        conn.sendall(payload_for(challenge))
                    except OSError:
                        pass

    threading.Thread(target=loop, daemon=True).start()
    return srv.getsockname()[:2]


def _signed(challenge: bytes, body: bytes, nbytes: int | None = None) -> bytes:
    header = rv.HEADER.pack(rv.MAGIC, rv.VERSION, int(rv.FrameKind.RESPONSE), len(body) if nbytes is None else nbytes)
    return header + body + rv._tag(KEY, challenge, header, body)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("payload_for", "field"),
    [
        (lambda ch: _signed(ch, b"", nbytes=rv.MAX_BODY_NBYTES + 1), "body_nbytes"),
        (lambda ch: _signed(b"wrong-challenge!", msgpack.packb({"code": 0, "blob": b"x"})), "hmac"),
        (lambda ch: _signed(ch, msgpack.packb({"code": 99})), "code"),
        (lambda ch: _signed(ch, msgpack.packb({"code": 0, "blob": 5})), "blob"),
    ],
)
def test_client_rejects_bad_replies(payload_for, field) -> None:
    stop = threading.Event()
    addr = _evil_server(payload_for, stop)
    try:
        with pytest.raises(PeerProtocolError) as e:
            lookup(addr, "n", KEY, timeout_s=3)
        assert e.value.field == field
    finally:
        stop.set()


@pytest.mark.timeout(60)
def test_silent_server_is_bounded() -> None:
    srv = socket.create_server(("127.0.0.1", 0))  # accepts (backlog) but never speaks
    try:
        t0 = time.monotonic()
        with pytest.raises(AdapterError) as e:
            lookup(srv.getsockname()[:2], "n", KEY, timeout_s=0.5)
        assert e.value.op == "lookup"
        assert time.monotonic() - t0 < 3
        with pytest.raises(AdapterError) as e:
            publish(srv.getsockname()[:2], "n", b"x", KEY, timeout_s=0.3)
        assert e.value.op == "publish"
    finally:
        srv.close()


@pytest.mark.timeout(60)
def test_keys_are_checked() -> None:
    with pytest.raises(ConfigError) as e:
        job_key_from_env({})
    assert e.value.field == "key" and "KVOWN_JOB_KEY" in e.value.fix
    with pytest.raises(ConfigError):
        job_key_from_env({"KVOWN_JOB_KEY": "ab" * 8})  # 8 bytes: too short
    with pytest.raises(ConfigError):
        job_key_from_env({"KVOWN_JOB_KEY": "not hex at all, but long enough"})
    assert job_key_from_env({"KVOWN_JOB_KEY": "ab" * 16}) == b"\xab" * 16
    with pytest.raises(ConfigError):
        RendezvousServer("127.0.0.1", 0, b"short")
    with pytest.raises(LocalProtocolError) as e:
        publish(("127.0.0.1", 1), "n" * 300, b"x", KEY)  # checked before any connection
    assert e.value.field == "name"
    with pytest.raises(LocalProtocolError) as e:
        publish(("127.0.0.1", 1), "n", b"x" * (rv.MAX_BLOB_NBYTES + 1), KEY)
    assert e.value.field == "blob"
