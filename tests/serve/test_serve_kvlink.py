"""KVLink over real loopback TCP: bytes land exactly, lent blocks go back exactly once and never early.

Two links in one process, each with its own paged cache and its own BlockAllocator, as two servers
would have. Every wait is bounded. The eager-cancel mutant shows the hold-until-quiescent test bites.
"""

from __future__ import annotations

import socket
import struct
import time

import pytest
import torch

from kvown.apps.serve import kvlink as kl
from kvown.apps.serve.kvlink import KVLink, TransferFailed
from kvown.apps.serve.model import BlockAllocator, ModelConfig, PagedKVCache
from kvown.core.errors import PeerProtocolError

CONFIG = ModelConfig(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)


class Side:
    """One server's KV memory, allocator and link."""

    def __init__(
        self,
        name: str,
        *,
        config: ModelConfig = CONFIG,
        num_blocks: int = 32,
        link_cls=KVLink,
        peers: dict | None = None,
        **link_kw,
    ) -> None:
        self.cache = PagedKVCache(config, num_blocks)
        self.alloc = BlockAllocator(num_blocks)
        self.returned: list[tuple[int, tuple[int, ...], str]] = []
        self.peers = peers if peers is not None else {}
        self.link = link_cls(name, self.cache, on_returned=self._returned, resolve=self.peers.get, **link_kw)
        self.peers[name] = self.link.address

    def _returned(self, rid, blocks, outcome):
        self.returned.append((rid, blocks, outcome))
        self.alloc.give_back(blocks)

    def lend(self, n: int) -> list[int]:
        blocks = self.alloc.allocate(n)
        self.alloc.lend(blocks)
        return blocks

    def fill(self, blocks, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for layer in self.cache.layers:
            for b in blocks:
                layer[:, b] = torch.randn(layer[:, b].shape, generator=g)

    def block_bytes(self, blocks) -> list[torch.Tensor]:
        return [layer[:, list(blocks)].clone() for layer in self.cache.layers]

    def settled(self) -> bool:
        s = self.link.statistics()
        return (
            s["owned"] == s["held"] == s["sending"] == 0
            and self.alloc.statistics()["free"] == self.alloc.total
        )


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False


@pytest.fixture
def pair():
    peers: dict = {}
    prefill = Side("prefill-0", peers=peers, chunk_blocks=2)
    decode = Side("decode-0", peers=peers)
    yield prefill, decode
    decode.link.close()
    prefill.link.close()


@pytest.mark.parametrize("publish_first", [True, False])
def test_transfer_lands_byte_exact_in_other_block_ids(pair, publish_first):
    prefill, decode = pair
    filler = decode.lend(3)  # make the destination ids differ from the source ids
    src = prefill.lend(5)
    prefill.fill(src, seed=1)
    dst = decode.lend(5)
    if publish_first:
        h = decode.link.receive(7, dst, "prefill-0")
        s = prefill.link.send(7, src, aux=b"first-token")
    else:
        s = prefill.link.send(7, src, aux=b"first-token")
        h = decode.link.receive(7, dst, "prefill-0")
    assert h.landed.result(5) == b"first-token"
    assert s.done.result(5) == "completed"
    for a, b in zip(prefill.block_bytes(src), decode.block_bytes(dst), strict=True):
        assert torch.equal(a, b)
    assert decode.link.statistics()["owned"] == 5  # still the link's until release
    decode.link.release(7)
    assert h.returned.is_set() and h.outcome == "completed"
    assert decode.returned == [(7, tuple(dst), "completed")]
    decode.alloc.give_back(filler)
    assert wait_until(lambda: decode.settled() and prefill.settled())


def _slow_transfer(prefill: Side, decode: Side, rid: int, n: int = 10):
    prefill.link._chunk_blocks = 1
    prefill.link.pace_s = 0.03
    src = prefill.lend(n)
    prefill.fill(src, seed=rid)
    dst = decode.lend(n)
    h = decode.link.receive(rid, dst, "prefill-0")
    s = prefill.link.send(rid, src)
    assert wait_until(lambda: decode.link.statistics()["bytes_in"] > 0)
    return h, s, dst


def test_cancel_mid_transfer_holds_until_writer_quiesced(pair):
    prefill, decode = pair
    h, s, dst = _slow_transfer(prefill, decode, rid=11)
    decode.link.cancel(11)
    decode.link.cancel(11)  # idempotent
    with pytest.raises(TransferFailed) as caught:
        h.landed.result(1)
    assert caught.value.reason == "cancelled"
    assert not h.returned.is_set()  # HELD: the writer has not said its last word yet
    assert decode.link.statistics()["held"] == 10
    assert decode.alloc.statistics()["lent"] == 10
    assert h.returned.wait(5) and h.outcome == "cancelled"
    assert s.done.result(5) == "cancelled"
    assert decode.returned == [(11, tuple(dst), "cancelled")]
    assert wait_until(lambda: decode.settled() and prefill.settled())


class EagerCancelLink(KVLink):
    """Planted bug: hands a cancelled destination back to the allocator at once, without the writer's
    proof (the link still routes the writer's frames for it, as an RDMA NIC would still land them)."""

    def cancel(self, request_id: int) -> None:
        super().cancel(request_id)
        with self._lock:
            handle = self._dests.get(request_id)
            if handle is not None and handle.state == "held" and not handle.returned.is_set():
                self._on_returned(request_id, handle.blocks, "cancelled")
                handle.returned.set()

    def _give_back_dest(self, handle, outcome):
        if handle.returned.is_set():  # already (wrongly) given back: just forget it
            del self._dests[handle.request_id]
            return
        super()._give_back_dest(handle, outcome)


class SlowToCancelLink(KVLink):
    """A legitimate writer that learns of a cancel late (a slow network): it keeps writing a while."""

    def _on_prefill_frame(self, conn, kind, rid, arg, payload):
        if kind == kl.Kind.CANCEL:
            time.sleep(0.15)
        super()._on_prefill_frame(conn, kind, rid, arg, payload)


def _reused_blocks_corrupted(link_cls) -> bool:
    """Cancel mid-transfer, reuse the blocks as soon as the link gives them back, write a canary, and
    report whether any later write from the old transfer overwrote it."""
    peers: dict = {}
    prefill = Side("prefill-0", peers=peers, link_cls=SlowToCancelLink)
    decode = Side("decode-0", peers=peers, link_cls=link_cls)
    try:
        h, s, dst = _slow_transfer(prefill, decode, rid=21, n=12)
        decode.link.cancel(21)
        assert h.returned.wait(5)
        reused = decode.alloc.allocate(len(dst))  # the next request gets the same ids (LIFO free list)
        assert sorted(reused) == sorted(dst)
        for layer in decode.cache.layers:
            layer[:, reused] = 42.0
        assert s.done.result(5) in ("cancelled", "completed")
        return any(not torch.all(layer[:, reused] == 42.0) for layer in decode.cache.layers)
    finally:
        decode.link.close()
        prefill.link.close()


def test_reused_blocks_are_never_overwritten_and_the_eager_mutant_is_caught():
    assert not _reused_blocks_corrupted(KVLink)
    assert _reused_blocks_corrupted(EagerCancelLink), "the test did not catch a link that frees on cancel"


def test_cancel_before_send_fences_the_id(pair):
    prefill, decode = pair
    dst = decode.lend(2)
    h = decode.link.receive(31, dst, "prefill-0")
    decode.link.cancel(31)
    assert h.returned.wait(5) and h.outcome == "cancelled"
    src = prefill.lend(2)
    s = prefill.link.send(31, src)  # born cancelled: the blocks come straight back
    assert s.done.result(5) == "cancelled"
    assert wait_until(lambda: decode.settled() and prefill.settled())


def test_unpublished_send_expires_and_a_late_publication_is_refused():
    peers: dict = {}
    prefill = Side("prefill-0", peers=peers, publish_timeout_s=0.3)
    decode = Side("decode-0", peers=peers)
    try:
        s = prefill.link.send(41, prefill.lend(3))
        assert s.done.result(5) == "expired"
        h = decode.link.receive(41, decode.lend(3), "prefill-0")
        with pytest.raises(TransferFailed) as caught:
            h.landed.result(5)
        assert caught.value.reason == "writer_fenced"
        assert h.returned.wait(5) and h.outcome == "failed"
        assert wait_until(lambda: decode.settled() and prefill.settled())
    finally:
        decode.link.close()
        prefill.link.close()


def test_abort_send_gives_source_back(pair):
    prefill, _ = pair
    s = prefill.link.send(51, prefill.lend(4))
    prefill.link.abort_send(51)
    assert s.done.result(5) == "aborted"
    assert wait_until(prefill.settled)


def test_block_count_mismatch_fails_both_sides(pair):
    prefill, decode = pair
    s = prefill.link.send(55, prefill.lend(4))
    h = decode.link.receive(55, decode.lend(3), "prefill-0")
    with pytest.raises(TransferFailed) as caught:
        h.landed.result(5)
    assert caught.value.reason == "writer_bad_publication"
    assert s.done.result(5) == "failed"
    assert wait_until(lambda: decode.settled() and prefill.settled())


def test_writer_death_fails_unlanded_destinations_and_gives_blocks_back(pair):
    prefill, decode = pair
    h, s, _ = _slow_transfer(prefill, decode, rid=61)
    prefill.link.close()  # the prefill server goes away mid-transfer
    with pytest.raises(TransferFailed) as caught:
        h.landed.result(5)
    assert caught.value.reason == "writer_lost"
    assert h.returned.wait(5) and h.outcome == "failed"
    assert s.done.result(5) in ("cancelled", "failed")
    assert wait_until(decode.settled)
    with pytest.raises(TransferFailed) as caught:
        decode.link.receive(62, decode.lend(1), "prefill-0")  # listener closed: refused at once
    assert caught.value.reason == "writer_unreachable"


def test_peer_gone_drops_the_connection(pair):
    prefill, decode = pair
    h, _, _ = _slow_transfer(prefill, decode, rid=65)
    decode.link.peer_gone("prefill-0")
    with pytest.raises(TransferFailed):
        h.landed.result(5)
    assert h.returned.wait(5)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_kv_heads": 4, "num_heads": 4}, "layout.kv_heads"),
        ({"block_size": 8}, "layout.block_size"),
        ({"num_layers": 3}, "layout.num_layers"),
    ],
)
def test_layout_mismatch_is_refused_at_the_handshake_naming_the_field(change, field):
    peers: dict = {}
    prefill = Side("prefill-0", peers=peers)
    other = ModelConfig(**{**CONFIG.__dict__, **change})
    decode = Side("decode-0", peers=peers, config=other)
    try:
        with pytest.raises(PeerProtocolError) as caught:
            decode.link.receive(71, [0], "prefill-0")
        assert caught.value.field == field
        assert prefill.link.statistics()["protocol_errors"] == 1
    finally:
        decode.link.close()
        prefill.link.close()


def test_unknown_writer_is_refused_before_anything_is_published(pair):
    _, decode = pair
    with pytest.raises(TransferFailed) as caught:
        decode.link.receive(81, [0], "nobody")
    assert caught.value.reason == "writer_unknown"
    assert decode.link.statistics()["destinations"] == 0


class FakeWriter:
    """A hostile 'prefill' that speaks the wire format by hand."""

    def __init__(self, layout: dict) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.layout = layout
        self.conn: socket.socket | None = None

    def accept(self) -> None:
        import json

        self.server.settimeout(5)
        self.conn, _ = self.server.accept()
        self.conn.settimeout(5)
        head = kl._recv_exact(self.conn, kl.HEADER.size)
        kl._recv_exact(self.conn, kl.HEADER.unpack(head)[5])
        self.frame(kl.Kind.HELLO, payload=json.dumps({"name": "evil", "layout": self.layout}).encode())

    def frame(self, kind, rid=0, arg=0, payload=b"", nbytes=None) -> None:
        n = len(payload) if nbytes is None else nbytes
        self.conn.sendall(struct.pack(">2sBBQII", b"KL", 1, kind, rid, arg, n) + payload)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.server.close()


@pytest.mark.parametrize(
    "attack",
    ["unpublished_rid", "out_of_range", "partial_block", "oversized", "wrong_kind", "bad_magic", "bad_request_id"],
)
def test_hostile_writer_frames_close_the_connection_and_fail_only_its_destinations(attack):
    import threading

    decode = Side("decode-0")
    writer = FakeWriter(decode.link._layout)
    decode.peers["evil"] = writer.address
    try:
        t = threading.Thread(target=writer.accept)
        t.start()
        dst = decode.lend(2)
        h = decode.link.receive(91, dst, "evil")
        t.join(5)
        kl._recv_exact(writer.conn, kl.HEADER.size)  # the PUBLISH
        block = b"\0" * decode.cache.block_nbytes
        if attack == "unpublished_rid":
            writer.frame(kl.Kind.DATA, 92, 0, block)
        elif attack == "out_of_range":
            writer.frame(kl.Kind.DATA, 91, 1, block * 2)
        elif attack == "partial_block":
            writer.frame(kl.Kind.DATA, 91, 0, block[:-1])
        elif attack == "oversized":
            writer.frame(kl.Kind.DATA, 91, 0, nbytes=1 << 30)
        elif attack == "wrong_kind":
            writer.frame(kl.Kind.PUBLISH, 91, 1)
        elif attack == "bad_request_id":  # not a kvown request id: the fence could not hold it
            writer.frame(kl.Kind.DATA, (1 << 64) - 1, 0, block)
        else:
            writer.conn.sendall(b"XX" + b"\0" * (kl.HEADER.size - 2))
        with pytest.raises(TransferFailed) as caught:
            h.landed.result(5)
        assert caught.value.reason == "writer_lost"
        assert h.returned.wait(5)
        assert decode.link.statistics()["protocol_errors"] == 1
        assert wait_until(decode.settled)
    finally:
        decode.link.close()
        writer.close()
