"""The ordered control resend queue: stamped frames that still have to reach the transport.

Owns: per peer, the sealed frames whose send raised (and every later frame to that peer, queued
behind them), when the first of them failed, and how many attempts failed.

Rules:
  1. Ordered streams never keep a hole. A frame is stamped once; a send that raised may or may not
     have been delivered, so the same sealed frame is sent again on every ``resend`` until one send
     goes through (the receiver drops a duplicate by its sequence number). Later frames to that peer
     wait behind it, so the stream leaves in order.
  2. ``resend`` returns a ``FailStop(CONTROL_LOST)`` naming the peer and the first stuck frame once a
     peer's queue has waited ``control_retry_s``; the driver executes it. Nothing else gives up a frame.
  3. Engine thread only; the counters go to the driver's ``stats``, the first failure of each wait to
     the flight recorder.

Invariants:
  INV-RS1  Every stamped frame is handed to ``transport.send`` until one call returns, or a
           CONTROL_LOST verdict is returned for its peer.
"""

from __future__ import annotations

import collections
from typing import Any

from kvown.adapters.transport import Transport
from kvown.core.actions import FailStop, FatalReason
from kvown.core.errors import AdapterError
from kvown.core.messages import Message


class Outgoing:
    """Stamped frames to one peer that still have to reach the transport. ``what`` names the frame's
    messages for the CONTROL_LOST report."""

    __slots__ = ("frames", "since_ns", "failures")

    def __init__(self, since_ns: int) -> None:
        self.frames: collections.deque[tuple[bytes, str]] = collections.deque()  # (frame, what)
        self.since_ns = since_ns
        self.failures = 0


class ResendQueue:
    """The control frames of one rank that a send could not (yet) prove delivered."""

    def __init__(self, transport: Transport, *, retry_s: float, stats: collections.Counter[str],
                 recorder: Any) -> None:
        self.transport = transport
        self.retry_s = retry_s
        self._retry_ns = int(retry_s * 1e9)
        self.stats = stats
        self.recorder = recorder
        self.pending: dict[int, Outgoing] = {}

    def __bool__(self) -> bool:
        return bool(self.pending)

    def frames(self) -> int:
        """Pure: frames waiting, over every peer (statistics, audits)."""
        return sum(len(o.frames) for o in self.pending.values())

    def send(self, dst: int, frame: bytes, seq: int, messages: list[Message], now_ns: int) -> None:
        """Send one stamped frame, or queue it behind ``dst``'s waiting ones (rule 1). Engine thread."""
        pending = self.pending.get(dst)
        if pending is not None:  # earlier frames to dst are still waiting: keep the stream in order
            pending.frames.append((frame, _what(seq, messages)))
            return
        try:
            self.transport.send(dst, frame)
            self.stats["control_sent"] += 1
            self.stats["control_messages"] += len(messages)
        except AdapterError as exc:  # delivered or not: nobody knows, so it will be sent again
            pending = self.pending[dst] = Outgoing(now_ns)
            pending.frames.append((frame, _what(seq, messages)))
            self._note_failure(dst, pending, exc)

    def resend(self, now_ns: int) -> tuple[bool, FailStop | None]:
        """Try every waiting frame again, in order. Returns (anything sent, the CONTROL_LOST verdict or
        None) (rule 2). Engine thread, once per step while frames wait."""
        moved = False
        for dst, pending in list(self.pending.items()):
            while pending.frames:
                frame, _ = pending.frames[0]
                try:
                    self.transport.send(dst, frame)
                except AdapterError as exc:
                    self._note_failure(dst, pending, exc)
                    break
                pending.frames.popleft()
                self.stats["control_resent"] += 1
                moved = True
            if not pending.frames:
                del self.pending[dst]
            elif now_ns - pending.since_ns >= self._retry_ns:
                return True, FailStop(
                    FatalReason.CONTROL_LOST, None,
                    f"control stream to rank {dst} is broken: {pending.frames[0][1]} could not be sent in "
                    f"{self.retry_s} s ({pending.failures} attempts); its sessions cannot be proven",
                )
        return moved, None

    def _note_failure(self, dst: int, pending: Outgoing, exc: AdapterError) -> None:
        pending.failures += 1
        self.stats["control_send_failures"] += 1
        if pending.failures == 1:
            self.recorder.record("send_failed", None, dst=dst, what=pending.frames[0][1], error=str(exc))


def _what(seq: int, messages: list[Message]) -> str:
    """A frame's description for the CONTROL_LOST report."""
    names = ", ".join(m.KIND.name for m in messages[:4]) + (", ..." if len(messages) > 4 else "")
    return f"{names} seq {seq}"


__all__ = ["Outgoing", "ResendQueue"]
