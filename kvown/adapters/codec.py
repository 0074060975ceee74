"""msgpack framing of control messages: the only place kvown turns messages into bytes and back.

Owns: nothing but the translation. Validation of fields lives in ``kvown.core.messages``.

Rules:
  1. Encode: ``seal(msgpack(to_wire(envelope)), key)``. Decode: ``unseal`` (size cap, then HMAC in
     constant time) before msgpack sees a byte; msgpack runs with tight container limits and
     ``strict_map_key``; then ``from_wire`` validates every field.
  2. Every failure is a ``PeerProtocolError`` naming the field; msgpack's own exceptions never escape.
  3. Never pickle.
"""

from __future__ import annotations

import msgpack

from kvown.core.errors import PeerProtocolError
from kvown.core.messages import MAX_BLOCKS, Envelope, from_wire, seal, to_wire, unseal

_LIMITS = dict(
    max_str_len=1024,
    max_bin_len=0,
    max_array_len=MAX_BLOCKS + 16,
    max_map_len=0,
    max_ext_len=0,
)


def encode(envelope: Envelope, key: bytes) -> bytes:
    """Called: once per outgoing control message, on the engine thread."""
    return seal(msgpack.packb(to_wire(envelope), use_bin_type=True), key)


def decode(frame: bytes, key: bytes) -> Envelope:
    """Authenticate and validate one frame from an untrusted peer.

    After error: nothing changed anywhere; drop the frame and count it.
    """
    body = unseal(frame, key)
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True, **_LIMITS)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise PeerProtocolError("frame body is not valid msgpack", field="body", cause=type(e).__name__) from None
    return from_wire(obj)
