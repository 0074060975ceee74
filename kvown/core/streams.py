"""Ordered control streams: per (src_rank, dst_rank) sequence numbers, applied strictly in order.

Owns: the next sequence number to send to each peer and the next one expected from each peer, plus
the frames held while a gap is open. A position is a frame: an ``Envelope`` (one message) or a
``Frame`` (a batch, applied in order); ``deliver`` reads only ``src_rank``, ``dst_rank`` and ``seq``.

Rules:
  1. Ordering is a protocol property: the transport may reorder (NIXL promises no notification order)
     or duplicate; this layer turns that back into the sender's order or rejects the frame.
  2. A frame with ``seq`` below the next expected, or equal to one already held, is a duplicate or a
     replay: rejected, counted, and nothing else changes.
  3. A frame ahead of the next expected is held (at most ``max_held`` per stream) until the gap fills.
     A frame beyond that window is a ``PeerProtocolError`` (a peer cannot be that far ahead honestly).
  4. A frame addressed to another rank is a ``PeerProtocolError`` (field ``dst_rank``).

Invariants:
  INV-ST1: ``deliver`` yields each (src, seq) at most once, in increasing seq order per src, with no gaps.
"""

from __future__ import annotations

from typing import Any

from kvown.core.errors import PeerProtocolError
from kvown.core.messages import Envelope, Message


class OutboundStreams:
    """Stamps outgoing messages with the next sequence number of their stream."""

    __slots__ = ("rank", "_next")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._next: dict[int, int] = {}

    def stamp(self, dst_rank: int, message: Message) -> Envelope:
        """One message as one stream position. Called: in send order, from the engine thread."""
        return Envelope(self.rank, dst_rank, self.next_seq(dst_rank), message)

    def next_seq(self, dst_rank: int) -> int:
        """Take the next position on the stream to ``dst_rank`` (one per frame; a batch frame's messages
        share it). Called: once per outgoing frame, in send order, from the engine thread."""
        seq = self._next.get(dst_rank, 0)
        self._next[dst_rank] = seq + 1
        return seq


class InboundStreams:
    """Reorders and de-duplicates incoming envelopes for one local rank."""

    __slots__ = ("rank", "max_held", "_expected", "_held", "duplicates")

    def __init__(self, rank: int, *, max_held: int = 4096) -> None:
        self.rank = rank
        self.max_held = max_held
        self._expected: dict[int, int] = {}
        self._held: dict[int, dict[int, Any]] = {}
        self.duplicates = 0  # rejected duplicates and replays (rule 2)

    def deliver(self, envelope: Any) -> list[Any]:
        """Accept one authenticated envelope or frame; return those now deliverable, in order.

        Called: once per received frame, from the engine thread.
        After error: nothing changed; the stream continues.
        """
        if envelope.dst_rank != self.rank:
            raise PeerProtocolError(
                "frame addressed to another rank", field="dst_rank", got=envelope.dst_rank, want=self.rank
            )
        src, seq = envelope.src_rank, envelope.seq
        expected = self._expected.get(src, 0)
        held = self._held.get(src)
        if seq < expected or (held is not None and seq in held):
            self.duplicates += 1
            return []
        if seq >= expected + self.max_held:
            raise PeerProtocolError("sequence number too far ahead", field="seq", src_rank=src, seq=seq, expected=expected)
        if seq > expected:
            self._held.setdefault(src, {})[seq] = envelope
            return []
        out = [envelope]
        expected += 1
        while held and expected in held:
            out.append(held.pop(expected))
            expected += 1
        self._expected[src] = expected
        if held is not None and not held:
            del self._held[src]
        return out

    def held_count(self) -> int:
        return sum(len(h) for h in self._held.values())
