"""Request ids and admission epochs.

Owns: the layout of a request id.

Rules:
  1. A request id is an immutable, never-reused non-negative integer: ``(epoch << 32) | seq``.
     ``epoch`` is the admission epoch the embedding server was in when it minted the id; ``seq`` is
     unique within that epoch. Retrying a request means minting a new id.
  2. Epochs only grow. A rank advertises a *low watermark*: the lowest epoch it may still admit. Below
     the world-wide watermark (the minimum over every rank) no id can ever be admitted again, so its
     cancellation fences can be compacted away (see ``fence``).

Invariants:
  INV-ID1: 0 <= epoch < 2**31 and 0 <= seq < 2**32 - 1 for every id kvown accepts.
"""

from __future__ import annotations

from kvown.core.errors import LocalProtocolError

EPOCH_BITS = 31
SEQ_BITS = 32
MAX_EPOCH = (1 << EPOCH_BITS) - 1
MAX_SEQ = (1 << SEQ_BITS) - 2  # seq + 1 must fit in 32 bits (the fence stores seq + 1)
MAX_REQUEST_ID = (MAX_EPOCH << SEQ_BITS) | MAX_SEQ


def make_request_id(epoch: int, seq: int) -> int:
    """Mint an id. Called by the embedding server once per request (never for a retry)."""
    if not (0 <= epoch <= MAX_EPOCH):
        raise LocalProtocolError("epoch out of range", field="epoch", value=epoch)
    if not (0 <= seq <= MAX_SEQ):
        raise LocalProtocolError("seq out of range", field="seq", value=seq)
    return (epoch << SEQ_BITS) | seq


def is_valid_request_id(request_id: object) -> bool:
    if type(request_id) is not int or not (0 <= request_id <= MAX_REQUEST_ID):
        return False
    return (request_id & ((1 << SEQ_BITS) - 1)) <= MAX_SEQ


def split_request_id(request_id: int) -> tuple[int, int]:
    """Return ``(epoch, seq)``. The id must be valid (callers validate untrusted ids first)."""
    return request_id >> SEQ_BITS, request_id & ((1 << SEQ_BITS) - 1)
