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
"""

from __future__ import annotations

from dataclasses import dataclass

from kvown.core.fence import CancelOrigin
from kvown.core.messages import Envelope


class Event:
    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Tick(Event):
    """Only time passed."""


@dataclass(frozen=True, slots=True)
class MessageReceived(Event):
    """An authenticated control message, delivered in stream order by ``InboundStreams``.

    ``carried``: the message came as a WRITE's notification (a final SUCCESS report,
    ``kvown.core.sender`` rule 6), outside the ordered stream, so it is ordered against nothing.
    """

    envelope: Envelope
    carried: bool = False


@dataclass(frozen=True, slots=True)
class WatermarkSet(Event):
    """The embedding server will never again admit a request id of an epoch below ``epoch``."""

    epoch: int


# ---- receiver (generation side) -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OpenReceive(Event):
    """Publish ``dst_blocks`` to ``writers``. Writer ``i`` owns head slice ``i % num_slices``; with more
    writers than slices (broadcast publication) only one cohort of ``num_slices`` writers delivers."""

    request_id: int
    dst_blocks: tuple[int, ...]
    writers: tuple[int, ...]
    num_slices: int = 1
    aux_slot: int = -1


@dataclass(frozen=True, slots=True)
class CancelRequested(Event):
    """The embedding server cancels a request (either side). Idempotent; installs a permanent fence."""

    request_id: int
    origin: CancelOrigin = CancelOrigin.CLIENT
    # Receiver only: writers to tell even though nothing was published to them (a request that will
    # never be published here - a host that computed the KV itself - so they release what they hold).
    notify: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class LocalCompletionPending(Event):
    """A local copy into the destination (for example a scatter kernel) was queued; ``token`` names it."""

    request_id: int
    token: int


@dataclass(frozen=True, slots=True)
class LocalCompletionDone(Event):
    """The event recorded after that local copy completed."""

    request_id: int
    token: int


@dataclass(frozen=True, slots=True)
class ReleaseRequested(Event):
    """The consumer is done with delivered blocks: retire them once every writer is settled."""

    request_id: int


# ---- sender (context side) -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OpenSend(Event):
    """The prefill server will send ``src_blocks`` for ``request_id`` in ``num_pieces`` pieces to
    ``num_receivers`` receiver ranks (each publishes with REQUEST_DATA)."""

    request_id: int
    src_blocks: tuple[int, ...]
    num_pieces: int = 1
    num_receivers: int = 1
    # A receiver may publish fewer blocks than the source: it holds the prefix already (a prefix-cache
    # hit), so the WRITE covers the LAST len(dst_blocks) source blocks. One piece only.
    dst_suffix: bool = False
    # Pieces whose KV is written already when the send opens: each counts as its SourceReady (the driver
    # folds tokens that are ready at once into the open, one core input fewer per session).
    ready_pieces: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SourceReady(Event):
    """The write-ready event for source piece ``piece`` completed: its KV has been written."""

    request_id: int
    piece: int


@dataclass(frozen=True, slots=True)
class WriteSubmitted(Event):
    op_id: int


@dataclass(frozen=True, slots=True)
class WriteNotSubmitted(Event):
    """Refused before anything was posted: nothing can touch memory for this op."""

    op_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class WriteSubmitFailed(Event):
    """Posting raised part-way: the backend may or may not touch memory (in doubt)."""

    op_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class WriteCompleted(Event):
    """The exact retained handle reported DONE (flush included: the bytes landed)."""

    op_id: int


@dataclass(frozen=True, slots=True)
class WriteFailed(Event):
    """The handle reported an error, or polling it raised: no proof the backend stopped (in doubt)."""

    op_id: int
    reason: str
