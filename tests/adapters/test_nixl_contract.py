"""Contract tests for the NIXL adapter, run against the fake fabric and real NIXL (UCX, host memory).

The same assertions run on both so ``FakeNixlEndpoint`` cannot drift from ``NixlEndpoint``. Real NIXL
runs with no progress thread, so every wait loop here polls BOTH agents (``Pair.pump``), and every
loop is bounded. One test crosses a process boundary (multiprocessing spawn, bounded joins).
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvown.adapters.nixl import (
    MAX_NOTIF_NBYTES,
    MemKind,
    NixlEndpoint,
    XferStatus,
    _pair_arrays,
    _pair_small,
    coalesce,
    pair_ranges,
)
from kvown.core.errors import AdapterError, LocalProtocolError
from kvown.testing.fake_nixl import (
    FakeFabric,
    FakeNixlEndpoint,
    FakeOutcome,
    FaultPoint,
    NotifFault,
    WriteFault,
)

KIB = 1024
MAX_SPINS = 200_000  # bound for every wait loop (a real 1 MiB write needs well under 100 spins)
_ids = itertools.count()


# --------------------------------------------------------------------------- pure helpers


@pytest.mark.timeout(30)
def test_coalesce_merges_only_adjacent_in_order() -> None:
    assert coalesce([(100, 10), (110, 5), (115, 1)]) == [(100, 16)]
    assert coalesce([(100, 10), (200, 10), (210, 10)]) == [(100, 10), (200, 20)]
    # adjacent in memory but not in order: kept apart, order matters for pairing
    assert coalesce([(110, 10), (100, 10)]) == [(110, 10), (100, 10)]
    assert coalesce([]) == []


@pytest.mark.timeout(30)
def test_pair_ranges_needs_contiguity_on_both_sides() -> None:
    # contiguous on both sides: one piece
    assert pair_ranges([(0x1000, 8), (0x1008, 8)], [(0x9000, 8), (0x9008, 8)]) == [(0x1000, 0x9000, 16)]
    # contiguous locally only: two pieces
    assert pair_ranges([(0x1000, 8), (0x1008, 8)], [(0x9000, 8), (0x9100, 8)]) == [
        (0x1000, 0x9000, 8), (0x1008, 0x9100, 8)]
    # split differently on each side
    assert pair_ranges([(0x1000, 16)], [(0x9000, 4), (0x9010, 12)]) == [
        (0x1000, 0x9000, 4), (0x1004, 0x9010, 12)]
    # a local registration boundary stops merging
    assert pair_ranges([(0x1000, 8), (0x1008, 8)], [(0x9000, 16)], local_breaks={0x1008}) == [
        (0x1000, 0x9000, 8), (0x1008, 0x9008, 8)]


@pytest.mark.timeout(30)
def test_pair_ranges_rejects_bad_input() -> None:
    with pytest.raises(LocalProtocolError) as e:
        pair_ranges([(0x1000, 8)], [(0x9000, 16)])
    assert e.value.field == "remote"
    with pytest.raises(LocalProtocolError):
        pair_ranges([], [])
    with pytest.raises(LocalProtocolError):
        pair_ranges([(0x1000, 0)], [(0x9000, 0)])
    many = [(0x1000 + 8 * i, 8) for i in range(40)]  # the vectorised path
    with pytest.raises(LocalProtocolError) as e:
        pair_ranges(many, many[:-1])
    assert e.value.field == "remote"
    with pytest.raises(LocalProtocolError) as e:
        pair_ranges([*many[:-1], (0x1000, -8)], many)
    assert e.value.field == "local"
    assert pair_ranges(many, [(0x9000, 320)], local_breaks={0x1000 + 160}) == [
        (0x1000, 0x9000, 160), (0x10A0, 0x90A0, 160)]


def _split(total: int, cuts: list[int]) -> list[int]:
    points = sorted({c % total for c in cuts if c % total} | {0, total})
    return [b - a for a, b in itertools.pairwise(points)]


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(
    total=st.integers(1, 64),
    lcuts=st.lists(st.integers(0, 63), max_size=8),
    rcuts=st.lists(st.integers(0, 63), max_size=8),
    lgaps=st.lists(st.integers(0, 2), min_size=9, max_size=9),
    rgaps=st.lists(st.integers(0, 2), min_size=9, max_size=9),
    breaks=st.sets(st.integers(1000, 1100), max_size=3),
)
def test_pair_ranges_preserves_the_byte_mapping(total, lcuts, rcuts, lgaps, rgaps, breaks) -> None:
    def lay(sizes: list[int], gaps: list[int], base: int) -> list[tuple[int, int]]:
        out, addr = [], base
        for n, g in zip(sizes, gaps, strict=False):
            addr += g
            out.append((addr, n))
            addr += n
        return out

    lsizes, rsizes = _split(total, lcuts), _split(total, rcuts)
    local = lay(lsizes, lgaps + [0] * len(lsizes), 1000)
    remote = lay(rsizes, rgaps + [0] * len(rsizes), 5000)
    want = list(zip([a + i for a, n in local for i in range(n)], [a + i for a, n in remote for i in range(n)],
                    strict=True))
    pieces = _pair_small(local, remote, breaks)
    la, ra, n = _pair_arrays(np.array(local), np.array(remote), breaks)
    assert list(zip(la.tolist(), ra.tolist(), n.tolist(), strict=True)) == pieces  # both paths agree
    assert pair_ranges(local, remote, breaks) == pieces
    got = [(la + i, ra + i) for la, ra, n in pieces for i in range(n)]
    assert got == want
    # maximal merging: neighbours stay apart only if not contiguous on both sides, or at a break
    for (la, ra, n), (lb, rb, _) in itertools.pairwise(pieces):
        assert not (la + n == lb and ra + n == rb) or lb in breaks


# --------------------------------------------------------------------------- fake / real pairs


class Pair:
    """Two endpoints (``a`` writes into ``b``) with one registered buffer each, and bounded waits."""

    def __init__(self, kind: str, nbytes: int = 1 << 20) -> None:
        self.kind = kind
        tag = f"{os.getpid()}-{next(_ids)}"
        if kind == "fake":
            self.fabric = FakeFabric()
            self.a = FakeNixlEndpoint(f"a-{tag}", fabric=self.fabric)
            self.b = FakeNixlEndpoint(f"b-{tag}", fabric=self.fabric)
        else:
            self.a = NixlEndpoint(f"a-{tag}")
            self.b = NixlEndpoint(f"b-{tag}")
        self.src = (np.arange(nbytes, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)
        self.dst = np.zeros(nbytes, dtype=np.uint8)
        self.src_addr, self.dst_addr = self.src.ctypes.data, self.dst.ctypes.data
        self.a.register(self.src_addr, nbytes, MemKind.DRAM)
        self.b.register(self.dst_addr, nbytes, MemKind.DRAM)
        self.inbox: dict[str, list[tuple[str, bytes]]] = {self.a.name: [], self.b.name: []}
        self.exchange()

    def exchange(self) -> None:
        assert self.a.add_peer(self.b.metadata()) == self.b.name
        assert self.b.add_peer(self.a.metadata()) == self.a.name

    def pump(self) -> None:
        for ep in (self.a, self.b):
            self.inbox[ep.name] += ep.drain_notifs()

    def wait(self, h, until=(XferStatus.DONE, XferStatus.ERROR)) -> XferStatus:
        for _ in range(MAX_SPINS):
            s = self.a.poll(h)
            if s in until:
                return s
            self.pump()
        raise AssertionError(f"transfer did not finish in {MAX_SPINS} spins: {h}")

    def wait_notifs(self, ep, n: int) -> list[tuple[str, bytes]]:
        for _ in range(MAX_SPINS):
            if len(self.inbox[ep.name]) >= n:
                return self.inbox[ep.name]
            self.pump()
        raise AssertionError(f"{ep.name} got {len(self.inbox[ep.name])} of {n} notifications")

    def close(self) -> None:
        for ep in (self.a, self.b):
            for h in list(ep._live.values()):
                for _ in range(MAX_SPINS):
                    if ep.poll(h) is not XferStatus.IN_PROGRESS:
                        break
                    self.pump()
                ep.release(h)
        self.a.close()
        self.b.close()


@pytest.fixture(params=["fake", "real"])
def pair(request):
    p = Pair(request.param)
    yield p
    p.close()


@pytest.mark.timeout(60)
def test_register_and_metadata_exchange(pair: Pair) -> None:
    assert pair.a.peers == {pair.b.name}
    assert pair.b.peers == {pair.a.name}
    assert isinstance(pair.a.metadata(), bytes)
    # loading a peer again (fresh metadata) is allowed and keeps its name
    assert pair.a.add_peer(pair.b.metadata()) == pair.b.name


@pytest.mark.timeout(60)
def test_write_lands_exactly_the_bytes(pair: Pair) -> None:
    s, d = pair.src_addr, pair.dst_addr
    local = [(s + 0, 4 * KIB), (s + 64 * KIB, 4 * KIB), (s + 200 * KIB, 1000)]
    remote = [(d + 8 * KIB, 4 * KIB), (d + 100 * KIB, 4 * KIB), (d + 300 * KIB, 1000)]
    h = pair.a.post_write(pair.b.name, local, remote, MemKind.DRAM)
    assert h.posted is True and h.nbytes == 8 * KIB + 1000
    assert pair.wait(h) is XferStatus.DONE
    want = np.zeros_like(pair.dst)
    for (la, n), (ra, _) in zip(local, remote, strict=True):
        want[ra - d : ra - d + n] = pair.src[la - s : la - s + n]
    assert np.array_equal(pair.dst, want)  # the right bytes, and nothing else touched
    pair.a.release(h)
    assert pair.a.live_handles == 0


@pytest.mark.timeout(60)
def test_coalescing_reduces_descriptor_count(pair: Pair) -> None:
    s, d = pair.src_addr, pair.dst_addr
    blocks = [(s + i * 4 * KIB, 4 * KIB) for i in range(16)]
    contiguous = [(d + i * 4 * KIB, 4 * KIB) for i in range(16)]
    h1 = pair.a.post_write(pair.b.name, blocks, contiguous, MemKind.DRAM)
    assert h1.num_descs == 1
    scattered = [(d + 128 * KIB + i * 8 * KIB, 4 * KIB) for i in range(16)]
    h2 = pair.a.post_write(pair.b.name, blocks, scattered, MemKind.DRAM)
    assert h2.num_descs == 16
    one_side = [(s, 64 * KIB)]  # one local range against 16 remote ranges
    h3 = pair.a.post_write(pair.b.name, one_side, [(d + 512 * KIB + i * 8 * KIB, 4 * KIB) for i in range(16)],
                           MemKind.DRAM)
    assert h3.num_descs == 16
    for h in (h1, h2, h3):
        assert pair.wait(h) is XferStatus.DONE
        pair.a.release(h)
    assert np.array_equal(pair.dst[: 64 * KIB], pair.src[: 64 * KIB])
    for i in range(16):
        for base in (128 * KIB, 512 * KIB):
            off = base + i * 8 * KIB
            assert np.array_equal(pair.dst[off : off + 4 * KIB], pair.src[i * 4 * KIB : (i + 1) * 4 * KIB])
            assert not pair.dst[off + 4 * KIB : off + 8 * KIB].any()


@pytest.mark.timeout(60)
def test_prepped_blocks_write_by_index(pair: Pair) -> None:
    bs, nblocks = 4 * KIB, 256
    lp = pair.a.prep_blocks(pair.src_addr, bs, nblocks, MemKind.DRAM)
    rp = pair.a.prep_blocks(pair.dst_addr, bs, nblocks, MemKind.DRAM, peer=pair.b.name)
    li = np.array([3, 4, 5, 10, 200], dtype=np.int32)
    ri = np.array([7, 8, 9, 0, 255], dtype=np.int64)  # int64 is accepted too
    h = pair.a.post_write_blocks(pair.b.name, lp, li, rp, ri, notif=b"blocks")
    assert h.nbytes == 5 * bs
    assert pair.wait(h) is XferStatus.DONE
    pair.a.release(h)
    want = np.zeros_like(pair.dst)
    for l_i, r_i in zip(li, ri, strict=True):
        want[r_i * bs : (r_i + 1) * bs] = pair.src[l_i * bs : (l_i + 1) * bs]
    assert np.array_equal(pair.dst, want)
    assert (pair.a.name, b"blocks") in pair.wait_notifs(pair.b, 1)
    with pytest.raises(LocalProtocolError):
        pair.a.post_write_blocks(pair.b.name, lp, np.array([256]), rp, np.array([0]))
    with pytest.raises(LocalProtocolError):
        pair.a.post_write_blocks(pair.b.name, lp, np.array([1, 2]), rp, np.array([0]))
    with pytest.raises(LocalProtocolError):  # sides swapped: remote list used as local
        pair.a.post_write_blocks(pair.b.name, rp, np.array([1]), lp, np.array([0]))
    assert pair.a.live_handles == 0


@pytest.mark.timeout(60)
def test_poll_and_release_rules(pair: Pair) -> None:
    # nothing pumps the target, so the WRITE (with its notification) cannot complete yet
    h = pair.a.post_write(pair.b.name, [(pair.src_addr, 4 * KIB)], [(pair.dst_addr, 4 * KIB)],
                          MemKind.DRAM, notif=b"n")
    assert h.status is XferStatus.IN_PROGRESS
    with pytest.raises(LocalProtocolError):
        pair.a.release(h)  # releasing a live handle is not a fence
    assert pair.a.live_handles == 1
    assert pair.wait(h) is XferStatus.DONE
    assert pair.a.poll(h) is XferStatus.DONE  # DONE is terminal
    pair.a.release(h)
    pair.a.release(h)  # idempotent
    assert pair.a.live_handles == 0 and h.released
    with pytest.raises(LocalProtocolError):
        pair.a.poll(h)
    with pytest.raises(LocalProtocolError):
        pair.b.poll(h)  # a handle belongs to its endpoint


@pytest.mark.timeout(60)
def test_notifications_carry_sender_and_payload(pair: Pair) -> None:
    for i in range(5):
        pair.a.send_notif(pair.b.name, b"ping-%d" % i)
    got = pair.wait_notifs(pair.b, 5)
    assert sorted(got) == sorted((pair.a.name, b"ping-%d" % i) for i in range(5))
    pair.b.send_notif(pair.a.name, b"pong")
    assert pair.wait_notifs(pair.a, 1) == [(pair.b.name, b"pong")]
    assert pair.a.drain_notifs() == []


@pytest.mark.timeout(60)
def test_write_notification_follows_the_data(pair: Pair) -> None:
    n = 256 * KIB
    h = pair.a.post_write(pair.b.name, [(pair.src_addr, n)], [(pair.dst_addr, n)], MemKind.DRAM,
                          notif=b"landed")
    for _ in range(MAX_SPINS):
        pair.a.poll(h)
        got = pair.b.drain_notifs()
        if got:
            assert got == [(pair.a.name, b"landed")]
            assert np.array_equal(pair.dst[:n], pair.src[:n])  # bytes are there when the notif is
            break
        pair.a.drain_notifs()
    else:
        raise AssertionError("no notification")
    assert pair.wait(h) is XferStatus.DONE
    pair.a.release(h)


@pytest.mark.timeout(60)
def test_a_refused_write_sends_no_notification(pair: Pair) -> None:
    """nixl rule 7: nothing posted, nothing announced (the carried result must never arrive)."""
    outside = pair.dst_addr + (1 << 20) + 4096  # not in b's registration: NIXL refuses to prepare it
    with pytest.raises(AdapterError) as e:
        pair.a.post_write(pair.b.name, [(pair.src_addr, 64)], [(outside, 64)], MemKind.DRAM, notif=b"never")
    assert e.value.posted is False and pair.a.live_handles == 0
    n = 64 * KIB  # a good WRITE after it is announced, and only it
    h = pair.a.post_write(pair.b.name, [(pair.src_addr, n)], [(pair.dst_addr, n)], MemKind.DRAM, notif=b"good")
    assert pair.wait(h) is XferStatus.DONE
    assert pair.wait_notifs(pair.b, 1) == [(pair.a.name, b"good")]
    for _ in range(100):
        pair.pump()
    assert pair.inbox[pair.b.name] == [(pair.a.name, b"good")]
    pair.a.release(h)


@pytest.mark.timeout(60)
def test_prepped_write_with_index_lists(pair: Pair) -> None:
    """The short-list fast path (nixl rule 6): Python lists go to NIXL as they are, checked the same."""
    block = 4 * KIB
    lp = pair.a.prep_blocks(pair.src_addr, block, 16, MemKind.DRAM)
    rp = pair.a.prep_blocks(pair.dst_addr, block, 16, MemKind.DRAM, peer=pair.b.name)
    h = pair.a.post_write_blocks(pair.b.name, lp, [3, 4, 9], rp, [0, 1, 15], notif=b"list")
    assert h.nbytes == 3 * block
    assert pair.wait(h) is XferStatus.DONE
    pair.a.release(h)
    want = np.concatenate([pair.src[3 * block : 5 * block], pair.src[9 * block : 10 * block]])
    got = np.concatenate([pair.dst[0 : 2 * block], pair.dst[15 * block : 16 * block]])
    assert np.array_equal(got, want)
    for bad, field in (([16], "remote_idx"), ([-1], "remote_idx"), ([], "local_idx")):
        with pytest.raises(LocalProtocolError) as e:
            pair.a.post_write_blocks(pair.b.name, lp, [0] if bad else [], rp, bad)
        assert e.value.field == field
    assert pair.a.live_handles == 0


@pytest.mark.timeout(60)
def test_prepped_write_notification_follows_the_data(pair: Pair) -> None:
    """The path kvown's carried results take: a prepped WRITE whose notification is the report."""
    block = 16 * KIB
    lp = pair.a.prep_blocks(pair.src_addr, block, 8, MemKind.DRAM)
    rp = pair.a.prep_blocks(pair.dst_addr, block, 8, MemKind.DRAM, peer=pair.b.name)
    h = pair.a.post_write_blocks(pair.b.name, lp, np.arange(2, 6), rp, np.arange(4, 8), notif=b"report")
    for _ in range(MAX_SPINS):
        pair.a.poll(h)
        got = pair.b.drain_notifs()
        if got:
            assert got == [(pair.a.name, b"report")]
            assert np.array_equal(pair.dst[4 * block : 8 * block], pair.src[2 * block : 6 * block])
            break
        pair.a.drain_notifs()
    else:
        raise AssertionError("no notification")
    assert pair.wait(h) is XferStatus.DONE
    pair.a.release(h)


@pytest.mark.timeout(60)
def test_large_notification_and_cap(pair: Pair) -> None:
    table = np.arange(16_384, dtype=np.int32).tobytes()  # a block table of 16k ints (64 KiB)
    pair.a.send_notif(pair.b.name, table)
    assert pair.wait_notifs(pair.b, 1) == [(pair.a.name, table)]
    biggest = bytes(MAX_NOTIF_NBYTES)
    pair.a.send_notif(pair.b.name, biggest)
    assert pair.wait_notifs(pair.b, 2)[1] == (pair.a.name, biggest)
    with pytest.raises(LocalProtocolError) as e:
        pair.a.send_notif(pair.b.name, bytes(MAX_NOTIF_NBYTES + 1))
    assert e.value.field == "notif"


@pytest.mark.timeout(60)
def test_close_refuses_live_handles(pair: Pair) -> None:
    h = pair.a.post_write(pair.b.name, [(pair.src_addr, 4 * KIB)], [(pair.dst_addr, 4 * KIB)],
                          MemKind.DRAM, notif=b"n")
    with pytest.raises(LocalProtocolError) as e:
        pair.a.close()
    assert e.value.field == "live_handles"
    with pytest.raises(LocalProtocolError):
        pair.a.remove_peer(pair.b.name)
    assert pair.wait(h) is XferStatus.DONE
    pair.a.release(h)
    pair.a.remove_peer(pair.b.name)
    assert pair.a.peers == frozenset()
    pair.a.close()
    pair.a.close()  # idempotent
    with pytest.raises(LocalProtocolError):
        pair.a.metadata()


@pytest.mark.timeout(60)
def test_bad_arguments_raise_typed_errors(pair: Pair) -> None:
    a, b, s, d = pair.a, pair.b, pair.src_addr, pair.dst_addr
    with pytest.raises(LocalProtocolError) as e:
        a.post_write("nobody", [(s, 8)], [(d, 8)], MemKind.DRAM)
    assert e.value.field == "peer"
    with pytest.raises(LocalProtocolError):
        a.send_notif("nobody", b"x")
    with pytest.raises(LocalProtocolError):
        a.post_write(b.name, [(s, 8)], [(d, 16)], MemKind.DRAM)
    stray = np.zeros(8 * KIB, dtype=np.uint8)  # never registered anywhere
    with pytest.raises(AdapterError) as e:
        a.post_write(b.name, [(s, 4 * KIB)], [(stray.ctypes.data, 4 * KIB)], MemKind.DRAM)
    assert e.value.posted is False and e.value.op == "initialize_xfer" and e.value.cause is not None
    with pytest.raises(AdapterError) as e:
        a.post_write(b.name, [(stray.ctypes.data, 4 * KIB)], [(d, 4 * KIB)], MemKind.DRAM)
    assert e.value.posted is False
    with pytest.raises(AdapterError) as e:
        a.prep_blocks(stray.ctypes.data, 4 * KIB, 2, MemKind.DRAM, peer=b.name)
    assert e.value.op == "prep_xfer_dlist"
    assert a.live_handles == 0
    with pytest.raises(AdapterError) as e:
        a.add_peer(b"not metadata")
    assert e.value.op == "add_remote_agent"
    with pytest.raises(AdapterError):
        a.add_peer(a.metadata())  # our own metadata
    with pytest.raises(AdapterError) as e:
        a.register(0x10000, 4 * KIB, MemKind.VRAM)  # no CUDA-aware memory at this address
    assert e.value.op == "register_memory"
    with pytest.raises(LocalProtocolError):
        a.register(s, 4 * KIB, "DRAM")  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_wrong_typed_values_name_their_field_in_both_builds(pair: Pair) -> None:
    """Rule 9: a value of the wrong type in a public parameter is ``LocalProtocolError`` naming it - in the
    compiled build too, where a parameter typed ``str`` would be refused by mypyc as a bare ``TypeError``
    before the endpoint's own check runs. Nothing is posted, sent or released."""
    a, b, s, d = pair.a, pair.b, pair.src_addr, pair.dst_addr
    local = a.prep_blocks(s, 4 * KIB, 2, MemKind.DRAM)
    remote = a.prep_blocks(d, 4 * KIB, 2, MemKind.DRAM, peer=b.name)
    h = a.post_write(b.name, [(s, 8)], [(d, 8)], MemKind.DRAM)
    calls = {
        "peer": [lambda: a.send_notif(7, b"x"), lambda: a.remove_peer(None),
                 lambda: a.post_write(b.name.encode(), [(s, 8)], [(d, 8)], MemKind.DRAM),
                 lambda: a.post_write_blocks(7, local, [0], remote, [0])],
        "notif": [lambda: a.send_notif(b.name, "text"), lambda: a.send_notif(b.name, None),
                  lambda: a.post_write(b.name, [(s, 8)], [(d, 8)], MemKind.DRAM, notif=3),
                  lambda: a.post_write_blocks(b.name, local, [0], remote, [0], notif=["x"])],
        "mem": [lambda: a.post_write(b.name, [(s, 8)], [(d, 8)], "DRAM")],
        "remote_mem": [lambda: a.post_write(b.name, [(s, 8)], [(d, 8)], MemKind.DRAM, remote_mem=0)],
        "local_prep": [lambda: a.post_write_blocks(b.name, "prep", [0], remote, [0])],
        "remote_prep": [lambda: a.post_write_blocks(b.name, local, [0], None, [0])],
        "handle": [lambda: a.poll(h.xfer_id), lambda: a.release("handle"), lambda: b.poll(h)],
        "prep": [lambda: a.release_prepped(0)],
    }
    for field, bad_calls in calls.items():
        for call in bad_calls:
            with pytest.raises(LocalProtocolError) as e:
                call()
            assert e.value.field == field
    assert a.live_handles == 1 and a.peers == {b.name}  # nothing changed: the one good WRITE is all
    assert pair.wait(h) is XferStatus.DONE
    a.release(h)
    assert a.post_write_blocks(b.name, local, [0], remote, [1]) is not None  # the preps are still live


@pytest.mark.timeout(60)
def test_late_registration_needs_fresh_metadata(pair: Pair) -> None:
    late = np.zeros(8 * KIB, dtype=np.uint8)
    pair.b.register(late.ctypes.data, late.nbytes, MemKind.DRAM)
    with pytest.raises(AdapterError) as e:
        pair.a.post_write(pair.b.name, [(pair.src_addr, 4 * KIB)], [(late.ctypes.data, 4 * KIB)], MemKind.DRAM)
    assert e.value.posted is False
    pair.a.add_peer(pair.b.metadata())
    h = pair.a.post_write(pair.b.name, [(pair.src_addr, 4 * KIB)], [(late.ctypes.data, 4 * KIB)], MemKind.DRAM)
    assert pair.wait(h) is XferStatus.DONE
    pair.a.release(h)
    assert np.array_equal(late[: 4 * KIB], pair.src[: 4 * KIB])


@pytest.mark.timeout(60)
def test_register_tensor(pair: Pair) -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(1024, dtype=torch.float32)
    region = pair.a.register_tensor(t)
    assert (region.addr, region.nbytes, region.mem) == (t.data_ptr(), 4096, MemKind.DRAM)
    with pytest.raises(LocalProtocolError):
        pair.a.register_tensor(torch.zeros(8, 8).t())  # not contiguous


# --------------------------------------------------------------------------- fake-only fault knobs


@pytest.fixture
def fake() -> Pair:
    p = Pair("fake", nbytes=64 * KIB)
    yield p
    p.fabric.land_all()
    p.close()


@pytest.mark.timeout(30)
def test_fake_error_is_in_doubt_bytes_land_after_release(fake: Pair) -> None:
    fake.fabric.inject_write(WriteFault(delay_polls=2, outcome=FakeOutcome.ERR, land_after_ticks=3))
    h = fake.a.post_write(fake.b.name, [(fake.src_addr, 4 * KIB)], [(fake.dst_addr, 4 * KIB)], MemKind.DRAM)
    assert [fake.a.poll(h) for _ in range(3)] == [XferStatus.IN_PROGRESS] * 2 + [XferStatus.ERROR]
    assert isinstance(h.error, AdapterError)
    fake.a.release(h)  # allowed after ERROR, but it is no fence:
    assert not fake.dst.any() and fake.fabric.pending_ghosts == 1
    for _ in range(3):
        fake.b.drain_notifs()  # any call ticks the fabric
    assert np.array_equal(fake.dst[: 4 * KIB], fake.src[: 4 * KIB])
    assert fake.fabric.pending_ghosts == 0


@pytest.mark.timeout(30)
def test_fake_error_can_resolve_to_done_on_the_same_handle(fake: Pair) -> None:
    fake.fabric.inject_write(WriteFault(at=FaultPoint.POST_RAISES, delay_polls=1, land_after_ticks=None))
    with pytest.raises(AdapterError) as e:
        fake.a.post_write(fake.b.name, [(fake.src_addr, 64)], [(fake.dst_addr, 64)], MemKind.DRAM)
    assert e.value.posted is None and e.value.op == "transfer"
    h = e.value.handle
    assert fake.a.live_handles == 1 and h.posted is None  # rooted while in doubt
    with pytest.raises(LocalProtocolError):
        fake.a.release(h)
    assert fake.a.poll(h) is XferStatus.IN_PROGRESS
    assert fake.a.poll(h) is XferStatus.DONE
    assert np.array_equal(fake.dst[:64], fake.src[:64])
    fake.a.release(h)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fault", [
    WriteFault(delay_polls=0, outcome=FakeOutcome.ERR_THEN_DONE, err_polls=2),
    WriteFault(at=FaultPoint.POST_RAISES, delay_polls=1),
    WriteFault(at=FaultPoint.POST_ERR, land_after_ticks=0),
], ids=["err_then_done", "post_raises", "post_err"])
def test_fake_drops_the_notification_of_a_write_that_errored(fake: Pair, fault: WriteFault) -> None:
    """Fake rule 4, as NIXL's UCX backend does (nixl rule 7): an error first means no notification,
    even if the same handle later reports DONE and its bytes landed."""
    fake.fabric.inject_write(fault)
    try:
        h = fake.a.post_write(fake.b.name, [(fake.src_addr, 64)], [(fake.dst_addr, 64)], MemKind.DRAM,
                              notif=b"report")
    except AdapterError as e:
        h = e.value.handle if hasattr(e, "value") else e.handle
    for _ in range(6):
        fake.a.poll(h)
        fake.pump()
    assert fake.inbox[fake.b.name] == []
    fake.fabric.land_all()
    if h.status is XferStatus.IN_PROGRESS:
        fake.wait(h)
    fake.a.release(h)


@pytest.mark.timeout(30)
def test_fake_prep_failure_posts_nothing(fake: Pair) -> None:
    fake.fabric.inject_write(WriteFault(at=FaultPoint.PREP))
    with pytest.raises(AdapterError) as e:
        fake.a.post_write(fake.b.name, [(fake.src_addr, 64)], [(fake.dst_addr, 64)], MemKind.DRAM)
    assert e.value.posted is False and fake.a.live_handles == 0
    fake.fabric.inject_write(WriteFault(at=FaultPoint.POST_ERR, land_after_ticks=0))
    h = fake.a.post_write(fake.b.name, [(fake.src_addr, 64)], [(fake.dst_addr, 64)], MemKind.DRAM)
    assert h.status is XferStatus.ERROR and h.posted is True
    assert fake.a.poll(h) is XferStatus.ERROR
    assert np.array_equal(fake.dst[:64], fake.src[:64])  # ERROR, yet the bytes landed
    fake.a.release(h)


@pytest.mark.timeout(30)
def test_fake_poll_exception_is_error_with_cause(fake: Pair) -> None:
    fake.fabric.inject_write(WriteFault(delay_polls=0, outcome=FakeOutcome.RAISE))
    h = fake.a.post_write(fake.b.name, [(fake.src_addr, 64)], [(fake.dst_addr, 64)], MemKind.DRAM)
    assert fake.a.poll(h) is XferStatus.ERROR
    assert isinstance(h.error, AdapterError) and isinstance(h.error.cause, RuntimeError)
    assert h.error.op == "check_xfer_state"
    fake.a.release(h)
    assert not fake.dst.any()


@pytest.mark.timeout(30)
def test_fake_notifications_drop_and_delay(fake: Pair) -> None:
    fake.fabric.inject_notif(NotifFault(drop=True))
    fake.fabric.inject_notif(NotifFault(delay_drains=2))
    for m in (b"dropped", b"late", b"first"):
        fake.a.send_notif(fake.b.name, m)
    assert fake.b.drain_notifs() == [(fake.a.name, b"first")]
    assert fake.b.drain_notifs() == []
    assert fake.b.drain_notifs() == [(fake.a.name, b"late")]
    assert fake.b.drain_notifs() == []


@pytest.mark.timeout(30)
def test_fake_writes_to_a_closed_peer_fail(fake: Pair) -> None:
    fake.b.close()
    h = fake.a.post_write(fake.b.name, [(fake.src_addr, 64)], [(fake.dst_addr, 64)], MemKind.DRAM)
    assert h.status is XferStatus.ERROR
    fake.a.release(h)
    assert not fake.dst.any()


def test_fake_endpoint_holds_its_name_until_closed() -> None:
    fabric = FakeFabric()
    first = FakeNixlEndpoint("same-name", fabric=fabric)
    with pytest.raises(AdapterError) as err:
        FakeNixlEndpoint("same-name", fabric=fabric)
    assert err.value.fields["op"] == "create_agent"
    first.close()
    first.close()  # idempotent
    second = FakeNixlEndpoint("same-name", fabric=fabric)  # the close freed the name
    assert second.name == "same-name" and second.live_handles == 0
    second.close()


# --------------------------------------------------------------------------- real NIXL across processes


def _child(conn) -> None:  # runs in a spawned process: receive a WRITE, echo its notification
    import numpy as np

    from kvown.adapters.nixl import MemKind, NixlEndpoint

    ep = NixlEndpoint(f"child-{os.getpid()}")
    buf = np.zeros(1 << 20, dtype=np.uint8)
    ep.register(buf.ctypes.data, buf.nbytes, MemKind.DRAM)
    conn.send((ep.metadata(), buf.ctypes.data))
    if not conn.poll(30):
        return
    parent = ep.add_peer(conn.recv())
    for _ in range(20_000_000):
        got = ep.drain_notifs()
        if got:
            sender, payload = got[0]
            ep.send_notif(parent, b"echo:" + payload)
            conn.send((sender, payload, int(buf.astype(np.uint64).sum()), int(buf[:8].sum())))
            break
    for _ in range(200_000):  # keep progressing until the parent is done with us
        ep.drain_notifs()
        if conn.poll(0):
            break
    ep.close()


@pytest.mark.timeout(120)
def test_real_write_and_notification_across_processes() -> None:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(there,), daemon=True)
    proc.start()
    try:
        assert here.poll(90), "child did not start"  # a spawned interpreter importing torch and NIXL: slow under load
        child_md, child_addr = here.recv()
        ep = NixlEndpoint(f"parent-{os.getpid()}")
        src = np.full(1 << 20, 3, dtype=np.uint8)
        ep.register(src.ctypes.data, src.nbytes, MemKind.DRAM)
        child = ep.add_peer(child_md)
        here.send(ep.metadata())
        h = ep.post_write(child, [(src.ctypes.data, 1 << 20)], [(child_addr, 1 << 20)], MemKind.DRAM,
                          notif=b"table:1,2,3")
        echo: list[tuple[str, bytes]] = []
        for _ in range(20_000_000):
            if h.status is not XferStatus.DONE:
                ep.poll(h)
            echo += ep.drain_notifs()
            if echo and h.status is XferStatus.DONE:
                break
        assert h.status is XferStatus.DONE
        assert echo == [(child, b"echo:table:1,2,3")]
        assert here.poll(30)
        sender, payload, total, _ = here.recv()
        assert (sender, payload, total) == (ep.name, b"table:1,2,3", 3 << 20)
        ep.release(h)
        here.send("bye")
        ep.close()
    finally:
        proc.join(20)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    assert proc.exitcode == 0

