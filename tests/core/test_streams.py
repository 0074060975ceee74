"""Ordered control streams: in-order delivery, held gaps, duplicates, replays, far-ahead frames."""

from __future__ import annotations

import itertools

import pytest

from kvown.core.errors import PeerProtocolError
from kvown.core.messages import Envelope, SessionQuiesced
from kvown.core.streams import InboundStreams, OutboundStreams


def _env(src: int, seq: int, dst: int = 9) -> Envelope:
    return Envelope(src, dst, seq, SessionQuiesced(src, seq))


@pytest.mark.timeout(10)
def test_outbound_numbers_each_destination_separately() -> None:
    out = OutboundStreams(1)
    seqs = [out.stamp(d, SessionQuiesced(1, 0)).seq for d in (9, 9, 8, 9, 8)]
    assert seqs == [0, 1, 0, 2, 1]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_any_arrival_order_delivers_in_sequence_exactly_once(order) -> None:
    inbound = InboundStreams(9)
    got = []
    for seq in order:
        got += [e.seq for e in inbound.deliver(_env(1, seq))]
        got += [e.seq for e in inbound.deliver(_env(1, seq))]  # every frame also duplicated
    assert got == [0, 1, 2, 3]  # INV-ST1
    assert inbound.duplicates == 4 and inbound.held_count() == 0


@pytest.mark.timeout(10)
def test_streams_from_different_sources_are_independent() -> None:
    inbound = InboundStreams(9)
    assert inbound.deliver(_env(1, 1)) == []
    assert [e.src_rank for e in inbound.deliver(_env(2, 0))] == [2]
    assert [e.seq for e in inbound.deliver(_env(1, 0))] == [0, 1]


@pytest.mark.timeout(10)
def test_far_ahead_and_misaddressed_frames_are_refused_without_change() -> None:
    inbound = InboundStreams(9, max_held=4)
    inbound.deliver(_env(1, 2))
    with pytest.raises(PeerProtocolError) as info:
        inbound.deliver(_env(1, 4))
    assert info.value.field == "seq" and inbound.held_count() == 1
    with pytest.raises(PeerProtocolError) as info:
        inbound.deliver(_env(1, 0, dst=8))
    assert info.value.field == "dst_rank" and inbound.held_count() == 1
    assert [e.seq for e in inbound.deliver(_env(1, 0))] == [0]
    assert [e.seq for e in inbound.deliver(_env(1, 1))] == [1, 2]
