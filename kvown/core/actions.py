"""Actions: what a core machine tells its driver to do, in the order it must be done.

Owns: the output vocabulary of ``SenderCore.handle`` and ``ReceiverCore.handle``.

Rules:
  1. Actions are imperative (``PostWrite``, ``RetireBlocks``); events are past-tense facts.
  2. The driver executes the returned list in order. Order is meaningful: a ``SendControl`` list for one
     destination rank is the order on that rank's stream (for example every result before the
     ``SessionQuiesced`` that follows it).
  3. The core never performs an action itself: no I/O, no clock, no callbacks. ``FailStop`` is an action
     too; the runtime's fail-stop executor carries it out.
  4. Every action is a ``Record`` (``kvown.core.record``): immutable, equal by type and fields.
"""

from __future__ import annotations

import enum
from typing import Final

# A real import, not a TYPE_CHECKING one: a compiled (mypyc) class checks its fields' types at run time.
from kvown.core.messages import Message
from kvown.core.record import Record


class PieceKind(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: C-level hashing (enum's is Python)

    KV = "kv"
    AUX = "aux"


class Outcome(enum.Enum):
    """A session's logical outcome. Committed once; never changes afterwards."""

    __hash__ = object.__hash__  # members are singletons: C-level hashing (enum's is Python)

    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"
    TIMED_OUT = "timed_out"


class FatalReason(enum.Enum):
    """Why a rank fail-stops. The runtime maps each to an exit code (see ``kvown.runtime.failstop``)."""

    DEADLINE = "deadline"  # a claim was still unproven at its drain deadline
    INVARIANT = "invariant"  # an INV-* check failed
    ENGINE_CRASH = "engine_crash"  # an exception escaped a kvown thread
    HANG = "hang"  # the heartbeat lapsed
    RANK_CRASH = "rank_crash"  # the embedding server's executor loop died, or a rank left its program early
    CONTROL_LOST = "control_lost"  # a control frame could not be sent within the resend budget


class Action(Record):
    __slots__ = ()


class SendControl(Action):
    """Send ``message`` to ``dst_rank`` on our ordered stream to it."""

    def __init__(self, dst_rank: int, message: Message) -> None:
        self.dst_rank: Final = dst_rank
        self.message: Final = message


class PostWrite(Action):
    """Post one RDMA WRITE: source blocks ``src_blocks`` into the receiver's ``dst_blocks``.

    The source KV is ready (its write-ready event completed) when this is emitted. The driver answers
    with exactly one of ``WriteSubmitted`` / ``WriteNotSubmitted`` / ``WriteSubmitFailed`` and later,
    for a submitted write, ``WriteCompleted`` or ``WriteFailed`` for the same ``op_id``.
    ``result``: when set, the driver attaches it to the WRITE as its NIXL notification (a carried
    frame, delivered only after the data and flush completed; ``kvown.core.sender`` rule 6).
    """

    def __init__(self, op_id: int, request_id: int, receiver_rank: int, piece: int, kind: PieceKind,
                 src_blocks: tuple[int, ...], dst_blocks: tuple[int, ...], slice_index: int, num_slices: int,
                 aux_slot: int, result: Message | None = None) -> None:
        self.op_id: Final = op_id
        self.request_id: Final = request_id
        self.receiver_rank: Final = receiver_rank
        self.piece: Final = piece
        self.kind: Final = kind
        self.src_blocks: Final = src_blocks
        self.dst_blocks: Final = dst_blocks
        self.slice_index: Final = slice_index
        self.num_slices: Final = num_slices
        self.aux_slot: Final = aux_slot  # -1 when kind is KV
        self.result: Final = result


class Deliver(Action):
    """Receiver: the logical transfer completed; the consumer may read the destination blocks."""

    def __init__(self, request_id: int) -> None:
        self.request_id: Final = request_id


class Conclude(Action):
    """A session's logical outcome was committed (the API resolves futures on this)."""

    def __init__(self, request_id: int, outcome: Outcome, reason: str) -> None:
        self.request_id: Final = request_id
        self.outcome: Final = outcome
        self.reason: Final = reason


class RetireBlocks(Action):
    """Receiver: every published writer is proven quiescent; return the destination blocks to the pool."""

    def __init__(self, request_id: int) -> None:
        self.request_id: Final = request_id


class ReleaseSource(Action):
    """Sender: no writer reads these source blocks any more; the prefill server may reuse them."""

    def __init__(self, request_id: int) -> None:
        self.request_id: Final = request_id


class Disputed(Action):
    """Receiver: a peer's evidence cannot be honest (receiver rules 1 and 3). Admission is quarantined
    and, for an invalid result, the session will never retire. The driver records and counts it."""

    def __init__(self, request_id: int, reason: str) -> None:
        self.request_id: Final = request_id
        self.reason: Final = reason


class AdmissionRefused(Action):
    """A new session was refused (fatal latched, quarantined, stale epoch). Nothing was created."""

    def __init__(self, request_id: int, reason: str) -> None:
        self.request_id: Final = request_id
        self.reason: Final = reason


class FailStop(Action):
    """Kill the whole world. Sticky: once returned, the machine keeps every claim forever."""

    def __init__(self, reason: FatalReason, request_id: int | None, detail: str) -> None:
        self.reason: Final = reason
        self.request_id: Final = request_id
        self.detail: Final = detail
