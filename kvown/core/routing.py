"""Routing: which core each message of a decoded frame goes to, and carried reports handed over once.

Owns: one rank's ledger of the carried reports already handed to its receiver core, per live request.

Rules:
  1. A frame's ``src_rank`` must be the rank the transport named, and a carried frame (sender rule 6)
     must be addressed to this rank; otherwise ``frame`` raises ``PeerProtocolError`` and changes
     nothing (neither the streams nor the ledger).
  2. An ordered frame goes through ``InboundStreams.deliver`` (gaps, duplicates, replays refused
     there). Each message it releases goes to one core: REQUEST_DATA and CANCEL_SESSION to the
     sender, WATERMARK to every core, every other kind to the receiver. A message for a role this rank
     does not have is a ``Delivery`` with no core and ``Drop.NO_ROLE``.
  3. A carried frame is outside the ordered streams. Each report (one per session the WRITE wrote) goes
     to the receiver core at most once per (writer, kind, piece) while its request is live: a copy is
     ``Drop.DUPLICATE``, one for a request with no live receive session is ``Drop.STALE`` (retired, or
     never ours: the core would refuse it too). A carried frame for a rank without the receiver role
     raises ``PeerProtocolError``.
  4. Pure: no clock, no I/O, no logging. The caller counts drops, records, and feeds each delivery's
     event to its cores in order; it calls ``forget`` when a request retires.

Invariants:
  INV-RT1: a carried report reaches the receiver core at most once while its request is live.
"""

from __future__ import annotations

import enum
from typing import Any, Final

from kvown.core.errors import PeerProtocolError
from kvown.core.events import MessageReceived
from kvown.core.machine import RankCore
from kvown.core.messages import AuxResult, CancelSession, Envelope, Frame, KvResult, RequestData, Watermark
from kvown.core.record import Record
from kvown.core.streams import InboundStreams


class Drop(enum.Enum):
    """Why a delivery reaches no core; the value is the driver's counter name."""

    NO_ROLE = "rejected_frames"  # a message for a role this rank does not have
    DUPLICATE = "duplicate_carried"  # a copy of a carried report already handed over
    STALE = "stale_carried"  # a carried report for a request with no live receive session


class Delivery(Record):
    """One message and the cores it goes to (none when ``drop`` says why)."""

    def __init__(self, event: MessageReceived, index: int, cores: tuple[RankCore[Any], ...],
                 drop: Drop | None = None) -> None:
        self.event: Final = event
        self.index: Final = index  # the message's position in its frame
        self.cores: Final = cores
        self.drop: Final = drop


class Router:
    """One rank's routing of decoded frames to its sender and receiver cores. Sans-IO."""

    def __init__(self, rank: int, sender: RankCore[Any] | None, receiver: RankCore[Any] | None,
                 streams: InboundStreams) -> None:
        self.rank = rank
        self.sender = sender
        self.receiver = receiver
        self.streams = streams
        self._cores = tuple(c for c in (sender, receiver) if c is not None)
        self._carried_seen: dict[int, set[tuple[int, Any, int]]] = {}  # rid -> reports handed over

    def frame(self, src: int, frame: Frame) -> list[Delivery]:
        """Route one decoded frame from ``src`` (rules 1-3).

        Called: per arriving frame, engine thread. After error: ``PeerProtocolError``; nothing changed.
        """
        if frame.src_rank != src:
            raise PeerProtocolError("frame claims another source rank", field="src_rank",
                                    got=frame.src_rank, transport=src)
        if frame.carried:
            if frame.dst_rank != self.rank:
                raise PeerProtocolError("carried frame addressed to another rank", field="dst_rank",
                                        got=frame.dst_rank, want=self.rank)
            if self.receiver is None:  # before any report is remembered: the frame changes nothing
                raise PeerProtocolError("carried result for a rank without the receiver role",
                                        field="carried")
            return [self._carried(src, m, index) for index, m in enumerate(frame.messages)]
        out = []
        for f in self.streams.deliver(frame):
            for index, message in enumerate(f.messages):
                event = MessageReceived(Envelope(f.src_rank, f.dst_rank, f.seq, message))
                cores = self.cores_for(message)
                out.append(Delivery(event, index, cores, None if cores else Drop.NO_ROLE))
        return out

    def cores_for(self, message: Any) -> tuple[RankCore[Any], ...]:
        """Rule 2: the cores an ordered message goes to (empty: this rank lacks the role)."""
        if isinstance(message, (RequestData, CancelSession)):
            return (self.sender,) if self.sender is not None else ()
        if isinstance(message, Watermark):
            return self._cores
        return (self.receiver,) if self.receiver is not None else ()

    def _carried(self, src: int, message: Any, index: int) -> Delivery:
        """Rule 3: one report of a WRITE's notification (final SUCCESS; ``frame_from_wire`` checked)."""
        assert isinstance(message, (KvResult, AuxResult))
        rx = self.receiver
        assert rx is not None
        event = MessageReceived(Envelope(src, self.rank, 0, message), carried=True)
        rid = message.request_id
        key = (src, message.KIND, message.piece)
        seen = self._carried_seen.get(rid)
        if seen is not None and key in seen:
            return Delivery(event, index, (), Drop.DUPLICATE)
        if rid not in rx.sessions:
            return Delivery(event, index, (), Drop.STALE)
        if seen is None:  # remembered until the session retires (``forget``)
            seen = self._carried_seen[rid] = set()
        seen.add(key)
        return Delivery(event, index, (rx,))

    def forget(self, request_id: int) -> None:
        """The request retired: its carried reports need no remembering. Called: engine thread."""
        self._carried_seen.pop(request_id, None)

    def remembered(self) -> int:
        """Pure: requests whose carried reports are remembered (for audits)."""
        return len(self._carried_seen)


__all__ = ["Delivery", "Drop", "Router"]
