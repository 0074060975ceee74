"""msgpack framing of control messages: the only place kvown turns messages into bytes and back.

Owns: nothing but the translation. Validation of fields lives in ``kvown.core.messages``.

Rules:
  1. Encode: ``seal(msgpack(frame_to_wire(frame)), key)``. Decode: ``unseal`` (size cap, then HMAC in
     constant time) before msgpack sees a byte; msgpack runs with tight container limits and
     ``strict_map_key``; then ``frame_from_wire`` validates every field of either body layout.
  2. Every failure is a ``PeerProtocolError`` naming the field; msgpack's own exceptions never escape.
  3. Never pickle.
  3a. The decoders take ``object`` (messages rule on validators: a compiled function checks its
      argument types on entry, so a forged non-bytes frame must reach ``unseal`` to be named).
  4. The HMAC's keyed states are computed once per key (``messages.Mac``); a frame costs one copy of
     each plus the body (the engine's hot path: ``FrameCodec``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgpack

from kvown.core.errors import PeerProtocolError
from kvown.core.messages import (
    MAX_BATCH,
    MAX_BLOCKS,
    Envelope,
    Frame,
    Message,
    frame_from_wire,
    frame_to_wire,
    from_wire,
    mac_for,
    to_wire,
    unseal,
)

assert MAX_BATCH + 5 < MAX_BLOCKS
_LIMITS = dict(
    max_str_len=1024,
    max_bin_len=0,
    max_array_len=MAX_BLOCKS + 16,  # also bounds a batch: MAX_BATCH + 5 < MAX_BLOCKS
    max_map_len=0,
    max_ext_len=0,
)
_ERRORS = (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError)


def _unpack(body: bytes) -> object:
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True, **_LIMITS)
    except _ERRORS as e:
        raise PeerProtocolError("frame body is not valid msgpack", field="body", cause=type(e).__name__) from None


def encode(envelope: Envelope, key: bytes) -> bytes:
    """One message in the single layout. Called: by tools and tests (the engine uses ``FrameCodec``)."""
    body: bytes = msgpack.packb(to_wire(envelope), use_bin_type=True)
    return body + mac_for(key).tag(body)


def decode(frame: object, key: bytes) -> Envelope:
    """Authenticate and validate one single-layout frame from an untrusted peer.

    After error: nothing changed anywhere; drop the frame and count it.
    """
    return from_wire(_unpack(unseal(frame, key)))


def encode_frame(frame: Frame, key: bytes) -> bytes:
    """A frame of any layout (``messages.frame_to_wire``)."""
    body: bytes = msgpack.packb(frame_to_wire(frame), use_bin_type=True)
    return body + mac_for(key).tag(body)


def decode_frame(frame: object, key: bytes) -> Frame:
    """Authenticate and validate a frame of either layout. After error: as ``decode``."""
    return frame_from_wire(_unpack(unseal(frame, key)))


class FrameCodec:
    """The engine's codec: one job key, its HMAC states and a reused msgpack packer.

    Called: by one driver's engine thread only (the packer is not thread-safe).
    """

    __slots__ = ("key", "_mac", "_pack")

    def __init__(self, key: bytes) -> None:
        self.key = key
        self._mac = mac_for(key)
        self._pack: Callable[[object], bytes] = msgpack.Packer(use_bin_type=True).pack

    def encode(self, src: int, dst: int, seq: int, messages: list[Message] | tuple[Message, ...]) -> bytes:
        """A control frame at position ``seq`` holding ``messages`` in order (single layout for one)."""
        if len(messages) == 1:
            m = messages[0]
            body = self._pack([1, int(m.KIND), src, dst, seq, *m.wire_fields()])
        else:
            body = self._pack([2, src, dst, seq, 0, *([int(m.KIND), *m.wire_fields()] for m in messages)])
        return body + self._mac.tag(body)

    def encode_carried(self, src: int, dst: int, messages: Sequence[Message]) -> bytes:
        """The frame a WRITE carries as its notification: the final report of each session whose blocks
        that one transfer writes (``messages`` rule 1)."""
        body = self._pack([2, src, dst, 0, 1, *([int(m.KIND), *m.wire_fields()] for m in messages)])
        return body + self._mac.tag(body)

    def decode(self, data: object) -> Frame:
        """Authenticate and validate one frame. After error: ``PeerProtocolError(field=...)``; nothing changed."""
        return frame_from_wire(_unpack(unseal(data, self.key)))

    @staticmethod
    def message_nbytes(message: Message) -> int:
        """An upper bound of the packed size of ``message`` (used to split batches below the frame cap)."""
        blocks = getattr(message, "dst_blocks", ())
        return 64 + 9 * len(blocks)
