"""Events: past-tense facts fed into a core machine by its driver.

Owns: the input vocabulary of ``SenderCore.handle`` and ``ReceiverCore.handle``.

Rules:
  1. Events are facts that already happened (``WriteCompleted``) or requests the embedding server
     made (``CancelRequested``); the machine decides what follows.
  2. Adapters translate each library outcome into exactly one event (a NIXL ``DONE`` is one
     ``WriteCompleted``; an exception while posting is one ``WriteSubmitFailed``).
  3. ``Tick`` carries no fact: only time passed (the driver calls it at ``next_deadline_ns()``).
  4. Event and message classes are final: the cores dispatch on the exact type (``type(e) is X``,
     tables keyed by type), so a subclass would be refused as an unknown input.
  5. Every event is a ``Record`` (``kvown.core.record``): immutable, equal by type and fields.
"""

from __future__ import annotations

from typing import Final

from kvown.core.fence import CancelOrigin
from kvown.core.messages import Envelope
from kvown.core.record import Record


class Event(Record):
    __slots__ = ()


class Tick(Event):
    """Only time passed."""


class MessageReceived(Event):
    """An authenticated control message, delivered in stream order by ``InboundStreams``.

    ``carried``: the message came as a WRITE's notification (a final SUCCESS report,
    ``kvown.core.sender`` rule 6), outside the ordered stream, so it is ordered against nothing.
    """

    def __init__(self, envelope: Envelope, carried: bool = False) -> None:
        self.envelope: Final = envelope
        self.carried: Final = carried


class WatermarkSet(Event):
    """The embedding server will never again admit a request id of an epoch below ``epoch``."""

    def __init__(self, epoch: int) -> None:
        self.epoch: Final = epoch


# ---- receiver (generation side) -------------------------------------------------------------------


class OpenReceive(Event):
    """Publish ``dst_blocks`` to ``writers``. Writer ``i`` owns head slice ``i % num_slices``; with more
    writers than slices (broadcast publication) only one cohort of ``num_slices`` writers delivers."""

    def __init__(self, request_id: int, dst_blocks: tuple[int, ...], writers: tuple[int, ...],
                 num_slices: int = 1, aux_slot: int = -1) -> None:
        self.request_id: Final = request_id
        self.dst_blocks: Final = dst_blocks
        self.writers: Final = writers
        self.num_slices: Final = num_slices
        self.aux_slot: Final = aux_slot


class CancelRequested(Event):
    """The embedding server cancels a request (either side). Idempotent; installs a permanent fence."""

    def __init__(self, request_id: int, origin: CancelOrigin = CancelOrigin.CLIENT,
                 notify: tuple[int, ...] = ()) -> None:
        self.request_id: Final = request_id
        self.origin: Final = origin
        # Receiver only: writers to tell even though nothing was published to them (a request that will
        # never be published here - a host that computed the KV itself - so they release what they hold).
        self.notify: Final = notify


class LocalCompletionPending(Event):
    """A local copy into the destination (for example a scatter kernel) was queued; ``token`` names it."""

    def __init__(self, request_id: int, token: int) -> None:
        self.request_id: Final = request_id
        self.token: Final = token


class LocalCompletionDone(Event):
    """The event recorded after that local copy completed."""

    def __init__(self, request_id: int, token: int) -> None:
        self.request_id: Final = request_id
        self.token: Final = token


class ReleaseRequested(Event):
    """The consumer is done with delivered blocks: retire them once every writer is settled."""

    def __init__(self, request_id: int) -> None:
        self.request_id: Final = request_id


# ---- sender (context side) -------------------------------------------------------------------------


class OpenSend(Event):
    """The prefill server will send ``src_blocks`` for ``request_id`` in ``num_pieces`` pieces to
    ``num_receivers`` receiver ranks (each publishes with REQUEST_DATA)."""

    def __init__(self, request_id: int, src_blocks: tuple[int, ...], num_pieces: int = 1,
                 num_receivers: int = 1, dst_suffix: bool = False,
                 ready_pieces: tuple[int, ...] = ()) -> None:
        self.request_id: Final = request_id
        self.src_blocks: Final = src_blocks
        self.num_pieces: Final = num_pieces
        self.num_receivers: Final = num_receivers
        # A receiver may publish fewer blocks than the source: it holds the prefix already (a prefix-cache
        # hit), so the WRITE covers the LAST len(dst_blocks) source blocks. One piece only.
        self.dst_suffix: Final = dst_suffix
        # Pieces whose KV is written already when the send opens: each counts as its SourceReady (the driver
        # folds tokens that are ready at once into the open, one core input fewer per session).
        self.ready_pieces: Final = ready_pieces


class SourceReady(Event):
    """The write-ready event for source piece ``piece`` completed: its KV has been written."""

    def __init__(self, request_id: int, piece: int) -> None:
        self.request_id: Final = request_id
        self.piece: Final = piece


class WriteSubmitted(Event):

    def __init__(self, op_id: int) -> None:
        self.op_id: Final = op_id


class WriteNotSubmitted(Event):
    """Refused before anything was posted: nothing can touch memory for this op."""

    def __init__(self, op_id: int, reason: str) -> None:
        self.op_id: Final = op_id
        self.reason: Final = reason


class WriteSubmitFailed(Event):
    """Posting raised part-way: the backend may or may not touch memory (in doubt)."""

    def __init__(self, op_id: int, reason: str) -> None:
        self.op_id: Final = op_id
        self.reason: Final = reason


class WriteCompleted(Event):
    """The exact retained handle reported DONE (flush included: the bytes landed)."""

    def __init__(self, op_id: int) -> None:
        self.op_id: Final = op_id


class WriteFailed(Event):
    """The handle reported an error, or polling it raised: no proof the backend stopped (in doubt)."""

    def __init__(self, op_id: int, reason: str) -> None:
        self.op_id: Final = op_id
        self.reason: Final = reason
