"""Coalesced WRITEs (driver rule 3a): a pump's carried whole-block WRITEs to one peer go as one transfer
whose notification carries every session's report; the protocol side (messages rule 1, routing rule 3)."""

from __future__ import annotations

import pytest
import torch

from kvown import Outcome
from kvown.adapters.codec import FrameCodec
from kvown.core.errors import ConfigError, PeerProtocolError
from kvown.core.ids import make_request_id
from kvown.cache.layout import KVLayout
from kvown.core.messages import MAX_CARRIED, KvResult, ResultStatus
from kvown.runtime.config import TransferConfig
from kvown.testing.pair import RX, TX, DriverPair

KEY = b"k" * 32
LAYOUT = KVLayout.standard(num_layers=1, num_blocks=16, tokens_per_block=2, num_kv_heads=2, head_dim=4, dtype="uint8")
NBLOCKS = 2


def _pair(layout: KVLayout = LAYOUT, **levers: bool) -> DriverPair:
    config = TransferConfig(transfer_timeout_s=1e-5, grace_s=1e-5, control_retry_s=1e-6, metrics_port=0,
                            canary=True, **levers)
    return DriverPair(config, layout=layout, key=KEY)


def _burst(p: DriverPair, n: int) -> tuple[list[int], list, list]:
    """``n`` sends open first; then ``n`` receives publish in one step, so the writer's one pump meets
    every publication and emits ``n`` carried WRITEs together. Each source block holds its own value."""
    pool = p.stacks[TX].parts.pool
    rids = [make_request_id(1, seq) for seq in range(1, n + 1)]
    sends = []
    for i, rid in enumerate(rids):
        src = tuple(range(i * NBLOCKS, (i + 1) * NBLOCKS))
        for b in src:
            pool.block_view(b).fill_(b + 1)
        sends.append(p.tx.send(rid, src))
    p.fabric.take_posted()
    tickets = [p.rx.submit_receive(rid, NBLOCKS, (TX,)) for rid in rids]
    p.run(lambda: all(t.future.done() for t in tickets), steps=5)
    handles = [t.future.result(0) for t in tickets]
    p.run(lambda: all(h.landed.is_set() for h in handles), steps=50)
    return rids, handles, sends


def _landed_bytes_match(p: DriverPair, handles: list, n: int) -> bool:
    src_pool, dst_pool = p.stacks[TX].parts.pool, p.stacks[RX].parts.pool
    return all(torch.equal(dst_pool.block_view(d), src_pool.block_view(i * NBLOCKS + j))
               for i, h in enumerate(handles[:n]) for j, d in enumerate(h.blocks))


@pytest.mark.timeout(30)
def test_sessions_ready_together_go_as_one_transfer_with_every_report() -> None:
    p = _pair()
    rids, handles, sends = _burst(p, 3)
    assert len(p.fabric.take_posted()) == 1  # three sessions, one WRITE
    assert all(h.landed.is_set() for h in handles) and _landed_bytes_match(p, handles, 3)
    for rid in rids:
        p.rx.release(rid)
    p.run(lambda: all(h.outcome.done() for h in handles) and all(s.released.is_set() for s in sends))
    assert [h.outcome.result(0) for h in handles] == [Outcome.COMPLETED] * 3
    assert all(s.released.is_set() for s in sends)
    assert p.drivers[RX].stats["rejected_frames"] == 0 and not p.fatal


@pytest.mark.timeout(30)
def test_without_coalescing_each_session_has_its_own_transfer() -> None:
    p = _pair(coalesce_writes=False)
    _, handles, _ = _burst(p, 3)
    assert len(p.fabric.take_posted()) == 3
    assert _landed_bytes_match(p, handles, 3)


@pytest.mark.timeout(30)
def test_a_group_larger_than_a_frame_holds_is_split() -> None:
    n = MAX_CARRIED + 2
    p = _pair(KVLayout.standard(num_layers=1, num_blocks=n * NBLOCKS, tokens_per_block=2, num_kv_heads=2,
                                head_dim=4, dtype="uint8"))
    _, handles, _ = _burst(p, n)
    assert len(p.fabric.take_posted()) == 2  # MAX_CARRIED reports, then the rest
    assert all(h.landed.is_set() for h in handles) and _landed_bytes_match(p, handles, n)


def _results(n: int, **over) -> list[KvResult]:
    fields = dict(piece=0, is_last=True, status=ResultStatus.SUCCESS, nbytes=4096) | over
    return [KvResult(TX, make_request_id(1, i + 1), fields["piece"], fields["is_last"], fields["status"],
                     fields["nbytes"]) for i in range(n)]


@pytest.mark.timeout(10)
def test_a_carried_frame_round_trips_with_several_reports() -> None:
    codec = FrameCodec(KEY)
    frame = codec.decode(codec.encode_carried(TX, RX, _results(3)))
    assert frame.carried and frame.seq == 0 and list(frame.messages) == _results(3)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("results, field", [
    (_results(MAX_CARRIED + 1), "messages"),
    (_results(2) + _results(1, is_last=False), "carried"),
    (_results(1, status=ResultStatus.IN_DOUBT) + _results(2), "carried"),
], ids=["too_many", "not_final", "not_success"])
def test_a_carried_frame_refuses_what_one_transfer_cannot_prove(results, field) -> None:
    codec = FrameCodec(KEY)
    with pytest.raises(PeerProtocolError) as err:
        codec.decode(codec.encode_carried(TX, RX, results))
    assert err.value.field == field


@pytest.mark.timeout(30)
def test_a_carried_batch_for_a_rank_without_the_receiver_role_changes_nothing() -> None:
    p = _pair()
    codec = FrameCodec(KEY)
    tx = p.drivers[TX]
    before = tx.audit(check_canaries=False)
    p.transports[RX].send(TX, codec.encode_carried(RX, TX, _results(2)))
    p.run(steps=3)
    assert tx.stats["rejected_frames"] == 1 and tx.stats["rejected_carried"] == 1
    assert tx.audit(check_canaries=False) == before and not p.fatal


@pytest.mark.timeout(10)
def test_the_knob_takes_only_a_bool() -> None:
    with pytest.raises(ConfigError) as err:
        TransferConfig(coalesce_writes=1)  # type: ignore[arg-type]
    assert err.value.field == "coalesce_writes"
