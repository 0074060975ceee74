"""Messages and the codec: round trips, and every malformed, oversized, forged or replayed frame is
refused with the field named and no state changed."""

from __future__ import annotations

import msgpack
import pytest

from kvown.adapters import codec
from kvown.core.errors import ConfigError, PeerProtocolError
from kvown.core.ids import MAX_REQUEST_ID, make_request_id
from kvown.core.messages import (
    MAX_BLOCKS,
    MAX_FRAME_NBYTES,
    PROTOCOL_VERSION,
    AuxResult,
    CancelSession,
    Envelope,
    Hello,
    KvResult,
    RequestData,
    ResultStatus,
    SessionQuiesced,
    Watermark,
    check_hello,
    check_key,
    from_wire,
    seal,
    to_wire,
)
from kvown.core.streams import InboundStreams

KEY = b"k" * 32
DIGEST = "ab" * 32
RID = make_request_id(3, 7)

VALID = [
    Hello(1, PROTOCOL_VERSION, ("session_quiesced", "in_doubt"), DIGEST),
    RequestData(RID, 9, (1, 2, 3), 0, 2, -1),
    RequestData(MAX_REQUEST_ID, 65535, tuple(range(100)), 1023, 1024, 5),
    KvResult(1, RID, 0, True, ResultStatus.SUCCESS, 4096),
    AuxResult(1, RID, 0, False, ResultStatus.IN_DOUBT, 0),
    CancelSession(RID, 9),
    SessionQuiesced(1, RID),
    Watermark(4, 2),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("message", VALID, ids=lambda m: type(m).__name__)
def test_round_trip_through_wire_and_codec(message) -> None:
    env = Envelope(1, 9, 42, message)
    assert from_wire(to_wire(env)) == env  # INV-M1
    assert codec.decode(codec.encode(env, KEY), KEY) == env


def _body(items) -> bytes:
    return seal(msgpack.packb(items, use_bin_type=True), KEY)


GOOD = to_wire(Envelope(1, 9, 0, KvResult(1, RID, 0, True, ResultStatus.SUCCESS, 0)))

# (description, wire list, the field the error must name)
MALFORMED = [
    ("not an array", {"a": 1}, "body"),
    ("too short", [1, 3, 1], "body"),
    ("version", [2, *GOOD[1:]], "version"),
    ("version as bool", [True, *GOOD[1:]], "version"),
    ("kind", [1, 99, *GOOD[2:]], "kind"),
    ("src rank", [1, 3, -1, *GOOD[3:]], "src_rank"),
    ("dst rank", [1, 3, 1, 70000, *GOOD[4:]], "dst_rank"),
    ("seq", [1, 3, 1, 9, -5, *GOOD[5:]], "seq"),
    ("missing field", GOOD[:-1], "kv_result"),
    ("extra field", [*GOOD, 1], "kv_result"),
    ("writer rank type", [*GOOD[:5], "1", *GOOD[6:]], "writer_rank"),
    ("request id", [*GOOD[:6], -1, *GOOD[7:]], "request_id"),
    ("request id float", [*GOOD[:6], 1.0, *GOOD[7:]], "request_id"),
    ("piece", [*GOOD[:7], 1 << 21, *GOOD[8:]], "piece"),
    ("is_last", [*GOOD[:8], 1, *GOOD[9:]], "is_last"),
    ("status", [*GOOD[:9], 7, GOOD[10]], "status"),
    ("nbytes", [*GOOD[:10], -1], "nbytes"),
    ("blocks", [1, 2, 9, 1, 0, RID, 9, [1, -2], 0, 1, -1], "dst_blocks"),
    ("blocks type", [1, 2, 9, 1, 0, RID, 9, "ab", 0, 1, -1], "dst_blocks"),
    ("num_slices 0", [1, 2, 9, 1, 0, RID, 9, [1], 0, 0, -1], "num_slices"),
    ("digest", [1, 1, 1, 9, 0, 1, 1, ["x"], "zz"], "geometry_digest"),
    ("capability", [1, 1, 1, 9, 0, 1, 1, [""], DIGEST], "capabilities"),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("case", "items", "field"), MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_frames_name_the_field(case, items, field) -> None:
    with pytest.raises(PeerProtocolError) as info:
        codec.decode(_body(items), KEY)
    assert info.value.field == field  # INV-M2


@pytest.mark.timeout(10)
def test_forged_oversized_short_and_garbage_frames() -> None:
    frame = codec.encode(Envelope(1, 9, 0, SessionQuiesced(1, RID)), KEY)
    cases = [
        (frame[:-1] + bytes([frame[-1] ^ 1]), "tag"),  # tag flipped
        (bytes([frame[0] ^ 1]) + frame[1:], "tag"),  # body flipped
        (codec.encode(Envelope(1, 9, 0, SessionQuiesced(1, RID)), b"x" * 32), "tag"),  # other job key
        (b"\x00" * 10, "tag"),
        (b"\x00" * (MAX_FRAME_NBYTES + 1), "frame"),
        ("text", "frame"),
        (seal(b"\xc1\xc1", KEY), "body"),  # msgpack's never-used byte
        (seal(msgpack.packb([1] * (MAX_BLOCKS + 17)), KEY), "body"),  # array over the limit
    ]
    for data, field in cases:
        with pytest.raises(PeerProtocolError) as info:
            codec.decode(data, KEY)
        assert info.value.field == field


@pytest.mark.timeout(10)
def test_replayed_frame_is_dropped_by_the_stream_and_changes_nothing() -> None:
    inbound = InboundStreams(9)
    frame = codec.encode(Envelope(1, 9, 0, SessionQuiesced(1, RID)), KEY)
    assert len(inbound.deliver(codec.decode(frame, KEY))) == 1
    before = dict(inbound._expected)
    assert inbound.deliver(codec.decode(frame, KEY)) == []
    assert inbound.duplicates == 1 and inbound._expected == before


@pytest.mark.timeout(10)
def test_keys_and_hello() -> None:
    with pytest.raises(ConfigError):
        check_key(b"short")
    assert check_key(KEY) == KEY
    local = VALID[0]
    check_hello(local, local)
    cases = [
        (Hello(2, 2, local.capabilities, DIGEST), "protocol_version"),
        (Hello(2, 1, ("session_quiesced",), DIGEST), "capabilities"),
        (Hello(2, 1, local.capabilities, "cd" * 32), "geometry_digest"),
    ]
    for peer, field in cases:
        with pytest.raises(PeerProtocolError) as info:
            check_hello(local, peer)
        assert info.value.field == field
