"""The crash points of ``FaultyTransport`` (kvown.testing.faults) fire at the protocol instant they name.

The production driver over the fake NIXL library, stepped with the test's own clock (no threads). The
crash action is replaced by one that records what the world looked like at that instant, so each
point is pinned to a protocol fact (e.g. at ``write-done`` the driver still counts the WRITE in flight; at
``retire`` the blocks are free in the pool but the API has not heard). These facts are what the crash
matrix (tests/multiproc/test_crash_matrix.py) relies on when it kills a real rank there.
"""

from __future__ import annotations

import random

import pytest

from kvown.adapters.transport import KVTransport
from kvown.cache.layout import KVLayout
from kvown.core.errors import ConfigError
from kvown.core.ids import make_request_id
from kvown.runtime.config import TransferConfig
from kvown.testing.clockguard import forbid_real_clock
from kvown.testing.faults import CRASH_POINTS, FaultyTransport, frame_kinds, parse_plan
from kvown.testing.pair import DriverPair

LAYOUT = KVLayout.standard(
    num_layers=1, num_blocks=8, tokens_per_block=2, num_kv_heads=2, head_dim=4, dtype="uint8"
)
KEY = b"k" * 32
TX, RX = 0, 1


@pytest.fixture(autouse=True)
def _no_real_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_real_clock(monkeypatch)


class _Spied:
    """The transport, noting every frame that really left (a wrapper: the compiled ``KVTransport`` is closed
    to patching, docs/design.md 17 rule 9)."""

    def __init__(self, inner: KVTransport, sent: list[bytes]) -> None:
        self._inner, self._sent = inner, sent

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def send(self, dst: int, frame: bytes) -> None:
        self._inner.send(dst, frame)
        self._sent.append(frame)


class World(DriverPair):
    def __init__(self, plan: str, *, carry: bool = True) -> None:
        self.faulty: dict[int, FaultyTransport] = {}
        self.seen: list[tuple[int, str, dict]] = []  # (rank, point, facts at that instant)
        self.sent: dict[int, list[bytes]] = {TX: [], RX: []}  # frames that really left, WRITE notifications too

        def wrap(transport: KVTransport, rank: int) -> FaultyTransport:
            spied = _Spied(transport, self.sent[rank])
            faulty = FaultyTransport(spied, rank, lambda: self.now, plan=parse_plan(plan, rank))
            faulty.crash_action = lambda point, r=rank: self.seen.append((r, point, self.facts()))
            self.faulty[rank] = faulty
            return faulty

        config = TransferConfig(transfer_timeout_s=1e-5, grace_s=1e-5, aux_slots=4, aux_slot_nbytes=8, metrics_port=0,
                                canary=True, carry_results=carry)
        super().__init__(config, layout=LAYOUT, key=KEY, wrap_transport=wrap, on_fail_stop=lambda r, a: None)
        self.handle = None

    def facts(self) -> dict:
        rx, tx = self.drivers[RX], self.drivers[TX]

        def got(driver) -> list[str]:  # ordered frames and results carried by a WRITE
            return [e[3]["msg"] for e in driver.recorder.events() if e[1] in ("recv", "recv_carried")]

        return {
            "rx_got": got(rx),
            "tx_sent": [k.name for frame in self.sent[TX] for k in frame_kinds(frame)],
            "tx_got": got(tx),
            "rx_free": rx.pool.statistics().free,
            "tx_writes_in_flight": len(tx._writes),
            "retired_told": self.handle is not None and self.handle.retired.is_set(),
        }

    def run(self, until, steps: int = 300) -> None:
        for _ in range(steps):
            for driver in self.drivers.values():
                driver.step(self.now)
            if until():
                return
            self.now += 10

    def transfer(self, seq: int, *, cancel: bool = False) -> None:
        rid = make_request_id(1, seq)
        ticket = self.rx.submit_receive(rid, 2, (TX,))
        self.run(ticket.future.done, steps=5)
        self.handle = ticket.future.result(0)
        send = self.tx.send(rid, (0, 1))
        if cancel:
            self.run(lambda: bool(self.drivers[TX]._writes), steps=50)  # cancel while the WRITE is in flight
            self.rx.cancel(rid)
        else:
            self.run(self.handle.landed.is_set)
            self.rx.release(rid)
        self.run(lambda: self.handle.retired.is_set() and send.released.is_set())


EXPECTED = {  # point -> (observing rank, a fact that must hold at that instant)
    "before-publish": (RX, lambda f: "REQUEST_DATA" not in f["rx_got"] and f["rx_free"] == 6),
    "request-data": (RX, lambda f: f["rx_free"] == 6),
    "write-posted": (TX, lambda f: "REQUEST_DATA" in f["tx_got"] and "KV_RESULT" not in f["tx_sent"]),
    # a one-operation session's result rides on its WRITE: it left with the data, the driver has not seen DONE
    "write-done": (TX, lambda f: f["tx_sent"].count("KV_RESULT") <= 1 and f["tx_writes_in_flight"] == 1),
    "kv-result-sent": (TX, lambda f: "KV_RESULT" in f["tx_sent"] and "KV_RESULT" not in f["rx_got"]),
    "cancel-sent": (
        RX,
        lambda f: "CANCEL_SESSION" not in f["tx_got"] and "SESSION_QUIESCED" not in f["tx_sent"],
    ),
    "quiesced-sent": (
        TX,
        lambda f: "SESSION_QUIESCED" in f["tx_sent"] and "SESSION_QUIESCED" not in f["rx_got"],
    ),
    "retire": (RX, lambda f: f["rx_free"] == 8 and not f["retired_told"]),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("point", CRASH_POINTS)
def test_each_crash_point_fires_once_on_its_rank_at_its_instant(point: str) -> None:
    rank, fact = EXPECTED[point]
    cancel = point in ("cancel-sent", "quiesced-sent")
    # With carried results a cancel that meets the WRITE in flight is proven by the WRITE's own result
    # (no SESSION_QUIESCED; sender rule 6), one that comes after it by an ack: timing decides. Without
    # them every cancel of a posted WRITE ends in a SESSION_QUIESCED, so the point is always reached.
    w = World(f"crash-{point}:rank={rank}:nth=1", carry=not cancel)
    w.transfer(1, cancel=cancel)
    w.transfer(2)
    assert [(r, p) for r, p, _ in w.seen] == [(rank, point)], w.seen
    assert fact(w.seen[0][2]), (point, w.seen[0][2])
    assert w.faulty[rank].crashed_at == [point]


@pytest.mark.timeout(30)
def test_nth_picks_the_occurrence_and_other_ranks_never_fire() -> None:
    w = World("crash-retire:rank=1:nth=2,crash-write-posted:rank=1:nth=1")  # rank 1 never posts a WRITE
    w.transfer(1)
    assert w.seen == []
    w.transfer(2)
    assert [p for _, p, _ in w.seen] == ["retire"]


def test_plan_options_are_checked_and_pct_fires_on_about_that_share() -> None:
    for bad in (
        "crash-nowhere",
        "slow-writer:pct=101",
        "drop-frame:nth=-1",
        "slow-writer:pct=x",
        "crash-retire:when=1",
    ):
        with pytest.raises(ConfigError) as err:
            parse_plan(bad, 0)
        assert err.value.field == "fault"
    entry = parse_plan("send-raise:pct=25", 0)["send-raise"]
    rng = random.Random(5)
    hits = sum(entry.fires(rng) for _ in range(4000))
    assert 800 < hits < 1200
    late = parse_plan("send-raise:pct=100:nth=3", 0)["send-raise"]
    assert [late.fires(rng) for _ in range(4)] == [False, False, True, True]
