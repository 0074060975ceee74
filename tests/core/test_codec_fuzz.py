"""Fuzzing the untrusted-bytes path: decode raises PeerProtocolError naming a field, and nothing else.

Frames are sealed with the real key first, so the fuzzed bytes get past the HMAC and reach msgpack
and the field validators (an attacker holding the key: the strongest case).
"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvown.adapters import codec
from kvown.core.errors import PeerProtocolError
from kvown.core.messages import Envelope, KvResult, ResultStatus, seal

KEY = b"k" * 32
FUZZ = settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])

plain = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=8) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=30,
)


def _decode_or_reject(frame: bytes) -> None:
    try:
        codec.decode(frame, KEY)
    except PeerProtocolError as exc:
        assert exc.fields.get("field"), exc


@FUZZ
@given(st.binary(max_size=256))
def test_random_sealed_bytes_only_raise_peer_protocol_errors(body):
    _decode_or_reject(seal(body, KEY))


@FUZZ
@given(st.lists(plain, max_size=12))
def test_random_msgpack_arrays_only_raise_peer_protocol_errors(items):
    _decode_or_reject(seal(msgpack.packb(items, use_bin_type=True), KEY))


@FUZZ
@given(st.integers(min_value=0, max_value=10), st.lists(plain, min_size=6, max_size=6))
def test_every_kind_with_random_fields_only_raises_peer_protocol_errors(kind, fields):
    _decode_or_reject(seal(msgpack.packb([1, kind, 0, 1, 0, *fields], use_bin_type=True), KEY))


@FUZZ
@given(st.data())
def test_any_bit_flip_in_a_valid_frame_is_caught_by_the_tag(data):
    frame = codec.encode(Envelope(0, 1, 3, KvResult(0, 7, 0, True, ResultStatus.SUCCESS, 4096)), KEY)
    i = data.draw(st.integers(min_value=0, max_value=len(frame) - 1))
    bit = data.draw(st.integers(min_value=0, max_value=7))
    flipped = bytearray(frame)
    flipped[i] ^= 1 << bit
    with pytest.raises(PeerProtocolError) as info:
        codec.decode(bytes(flipped), KEY)
    assert info.value.fields["field"] == "tag"
