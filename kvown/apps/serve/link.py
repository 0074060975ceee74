"""The KV link protocol: what the reference server asks of the one object that moves KV between servers.

Owns: ``Link`` (the methods the server calls), ``KVMemory`` (what a link reads of the server's KV
memory), the handles ``RecvHandle`` / ``SendHandle`` and ``TransferFailed``. Two implementations:
``kvown.apps.serve.kvownlink.KvownLink`` (kvown over NIXL, the default) and
``kvown.apps.serve.kvlink.KVLink`` (the loopback TCP reference, ``--link loopback``).

Rules:
  1. The server's ``BlockAllocator`` stays the only allocator: the server lends blocks (``receive`` on
     the decode side, ``send`` on the prefill side) and the link gives each lent set back exactly once
     through ``on_returned(request_id, blocks, outcome)``, when no transfer can touch it any more.
  2. A destination's ``landed`` resolves exactly once: to the aux bytes, or to ``TransferFailed``; a
     caller's ``Future.cancel`` cannot steal it (the future is marked running at birth).
  3. ``cancel`` is idempotent and allowed at any time; a cancelled, unlanded destination stays with the
     link until the writer is proven quiescent (how, is each implementation's business).
The method contracts, side by side: docs/embedding.md section 8.3.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvown.core.errors import KvownError


class TransferFailed(KvownError):
    """A destination will never land: ``reason`` says why (cancelled, writer_lost, writer_expired...)."""

    reason: str

    def __init__(self, reason: str, **fields: object) -> None:
        super().__init__("KV transfer failed", reason=reason, **fields)


class KVMemory(Protocol):
    """What the link needs to know about the server's KV memory (``PagedKVCache`` provides it)."""

    layers: list[torch.Tensor]  # the regions; block ids are shared by all of them
    num_blocks: int
    block_nbytes: int

    def chunks(self, block: int) -> list[tuple[int, int, int]]: ...
    def describe(self) -> dict[str, int | str]: ...


@dataclass
class RecvHandle:
    """Decode side. ``landed`` resolves to the aux bytes, or raises ``TransferFailed``; ``returned`` is
    set once the blocks went back to the server's allocator."""

    request_id: int
    blocks: tuple[int, ...]
    writer: str
    landed: concurrent.futures.Future[bytes] = field(default_factory=concurrent.futures.Future)
    returned: threading.Event = field(default_factory=threading.Event)
    state: str = "owned"  # owned -> landed -> (gone) | owned -> held -> (gone)
    outcome: str = ""

    def __post_init__(self) -> None:
        self.landed.set_running_or_notify_cancel()  # callers' cancel() cannot steal the result (rule 2)


@dataclass
class SendHandle:
    """Prefill side. ``done`` resolves to the outcome once the source blocks went back."""

    request_id: int
    blocks: tuple[int, ...]
    aux: bytes
    deadline_s: float  # time.monotonic() by which a decode must publish, else the blocks go back
    done: concurrent.futures.Future[str] = field(default_factory=concurrent.futures.Future)

    def __post_init__(self) -> None:
        self.done.set_running_or_notify_cancel()


class Link(Protocol):
    """The server's KV link. ``address``: where peers reach it ("" where discovery does that);
    ``pace_s``: a test knob (seconds between DATA frames; 0 where the link paces itself otherwise)."""

    address: str
    pace_s: float

    def receive(self, request_id: int, blocks: Sequence[int], writer: str) -> RecvHandle: ...
    def release(self, request_id: int) -> None: ...
    def cancel(self, request_id: int) -> None: ...
    def peer_gone(self, writer: str) -> None: ...
    def send(self, request_id: int, blocks: Sequence[int], aux: bytes = b"") -> SendHandle: ...
    def abort_send(self, request_id: int) -> None: ...
    def statistics(self) -> dict[str, int]: ...
    def close(self) -> None: ...


__all__ = ["KVMemory", "Link", "RecvHandle", "SendHandle", "TransferFailed"]
