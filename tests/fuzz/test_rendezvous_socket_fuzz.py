"""Hostile bytes into a real rendezvous server over loopback TCP (Hypothesis, not atheris).

Where atheris cannot reach: the atheris targets drive ``RendezvousServer._serve_one`` on a scripted
connection, in the fuzzing thread. What they cannot cover is the rest of the real path: the accept
loop, one thread per connection, the connection-slot semaphore, and the kernel's half-closes and
partial reads. Coverage guidance would buy little there (the branches are the same ``_recv_frame`` and
``_handle`` the atheris target already learns), and every input costs a TCP connection, so a seeded
Hypothesis search of a few dozen connections (CI) or five thousand (slow) checks that path instead.

Allowed outcomes, as for every fuzz target: the table unchanged, or changed at exactly one name after
an OK reply to a valid publish; every recorded error a ``PeerProtocolError`` naming its field; no
exception escaping a server thread; and the server still answering afterwards.
"""

from __future__ import annotations

import socket
import threading
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvown.adapters import rendezvous as rv
from kvown.core.errors import PeerProtocolError
from kvown.testing.fuzz_targets import KEY, rv_frame

TABLE = {"rank0": b"meta-of-rank0"}

field_value = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=300),
                        st.binary(max_size=64), st.lists(st.integers(0, 2**32), max_size=3))
request_body = st.one_of(
    st.fixed_dictionaries({"op": st.sampled_from([1, 2]), "name": st.sampled_from(["rank0", "rank1", ""])},
                          optional={"blob": st.binary(max_size=32)}),
    st.dictionaries(st.sampled_from(["op", "name", "blob", "x"]), field_value, max_size=4),
).map(lambda d: msgpack.packb(d, use_bin_type=True))
# (how to frame it, payload): "sealed" = correct header and tag around the body; "raw" = bytes as they are
hostile = st.one_of(st.tuples(st.just("sealed"), request_body | st.binary(max_size=64)),
                    st.tuples(st.just("raw"), st.binary(max_size=80)))


@pytest.fixture(scope="module")
def served():
    escaped: list[BaseException] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: escaped.append(args.exc_value)  # a server thread died: a finding
    server = rv.RendezvousServer("127.0.0.1", 0, KEY, io_timeout_s=2.0, max_connections=4)
    try:
        yield server, escaped
    finally:
        server.close()
        threading.excepthook = previous


def _send(addr, how: str, payload: bytes) -> dict | None:
    """One hostile connection; returns the server's decoded reply, or None when it closed silently."""
    deadline = time.monotonic() + 5
    with socket.create_connection(addr, timeout=5) as sock:
        hello = rv._recv_frame(sock, KEY, b"", rv.FrameKind.HELLO, deadline)
        frame = rv_frame(rv.FrameKind.REQUEST, payload, hello["challenge"]) if how == "sealed" else payload
        try:
            sock.sendall(frame)
            sock.shutdown(socket.SHUT_WR)  # half-close: the server's next recv sees the end at once
        except OSError:  # the server already closed (a bad header needs no more bytes): read what it said
            pass
        received = b""
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(1 << 16)
            except ConnectionResetError:  # the server closed with our bytes unread: the kernel resets
                break
            if not chunk:
                break
            received += chunk
    if not received:
        return None
    return rv._recv_frame(_Bytes(received), KEY, hello["challenge"], rv.FrameKind.RESPONSE, deadline)


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def settimeout(self, _t: float) -> None:
        pass

    def recv(self, n: int) -> bytes:
        chunk, self.data = self.data[:n], self.data[n:]
        return chunk


def _check_one(served, how: str, payload: bytes) -> None:
    server, escaped = served
    with server._lock:
        server._table = dict(TABLE)
    server.errors.clear()
    reply = _send(server.address, how, payload)  # the server records an error before it replies or closes
    after = server.snapshot()
    for exc in list(server.errors):
        assert isinstance(exc, PeerProtocolError) and exc.fields.get("field"), repr(exc)
    if reply is not None and reply.get("code") == rv.Reply.OK and after != TABLE:
        assert set(after) >= set(TABLE) and len({k for k in after if TABLE.get(k) != after[k]}) == 1
    else:
        assert after == TABLE
    assert not escaped, escaped
    assert rv.lookup(server.address, "rank0", KEY, 5.0) == after["rank0"]  # still serving


@settings(max_examples=40, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(hostile)
def test_hostile_connection_changes_nothing(served, case):
    _check_one(served, *case)


@pytest.mark.slow
@settings(max_examples=5000, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(hostile)
def test_hostile_connection_changes_nothing_slow(served, case):
    _check_one(served, *case)


def test_a_planted_table_write_before_validation_is_caught(served, monkeypatch):
    """Mutant: the server stores the blob before checking the op. The same oracle must fail."""
    original = rv.RendezvousServer._handle

    def handle(self, body):
        if isinstance(body.get("name"), str):
            self._table[body["name"]] = b"planted"
        return original(self, body)

    monkeypatch.setattr(rv.RendezvousServer, "_handle", handle)
    bad_op = msgpack.packb({"op": 9, "name": "rank1"}, use_bin_type=True)
    with pytest.raises(AssertionError):
        _check_one(served, "sealed", bad_op)
