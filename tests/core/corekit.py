"""Small builders shared by the core tests (no clock, no I/O)."""

from __future__ import annotations

from kvown.core.actions import Action, SendControl
from kvown.core.events import MessageReceived
from kvown.core.machine import CoreConfig
from kvown.core.messages import Envelope, Message
from kvown.core.receiver import ReceiverCore
from kvown.core.sender import SenderCore

T = 1000  # timeout_ns
G = 500  # grace_ns
RX = 9  # the receiver's rank


def receiver(rank: int = RX, timeout: int = T, grace: int = G) -> ReceiverCore:
    return ReceiverCore(CoreConfig(rank=rank, timeout_ns=timeout, grace_ns=grace))


def sender(rank: int = 1, timeout: int = T, grace: int = G, carry: bool = True) -> SenderCore:
    return SenderCore(CoreConfig(rank=rank, timeout_ns=timeout, grace_ns=grace), carry_results=carry)


def msg(src: int, dst: int, message: Message, seq: int = 0) -> MessageReceived:
    return MessageReceived(Envelope(src, dst, seq, message))


def kinds(actions: list[Action]) -> list[str]:
    """Action names, with the message kind for SendControl: ['SendControl:RequestData', 'RetireBlocks']."""
    out = []
    for a in actions:
        name = type(a).__name__
        if isinstance(a, SendControl):
            name += ":" + type(a.message).__name__
        out.append(name)
    return out
