"""The connector's scheduler half: which requests move KV, between which blocks, and when to let go.

Owns: per request, the scheduler's decision (receive, send, cancel) and the step's ``StepPlan`` that
ships them to the workers. Imports neither vLLM nor kvown's runtime (tested with plain stand-ins).

Rules:
  1. kvown's request id comes from ``kv_transfer_params["kvown_request_id"]`` (the proxy mints one per
     client request, never reused) and the writer's kvown rank from ``["kvown_writer"]``. A request
     without valid ones is an ordinary vLLM request: nothing here touches it.
  2. Decode (``do_remote_prefill``): every prompt token not held locally is loaded, asynchronously.
     The destination is the request's new (unhashed) blocks, one per prompt block after the local
     prefix-cache hit; the writer sends the same token blocks (kvown's ``dst_suffix``: the LAST source
     blocks), never the prefix. Each request is received at most once, and every request vLLM parked
     in WAITING_FOR_REMOTE_KVS is reported finished exactly once (by the worker, after retirement).
  3. A decode request that will never be published - aborted before it was, or a full local hit -
     still tells its writer (a cancel naming it), so the writer's source blocks come back at once.
  4. Prefill (``do_remote_decode``): the send opens in the step whose forward completes the prompt
     (the worker records the ready token after that forward). ``request_finished`` then returns
     ``delay_free=True``: vLLM keeps the source blocks until the worker reports the send released. A
     request that ends before its send opened only fences the id (``send_cancels``).
  5. ``build`` resets the step's plan and never changes vLLM's objects.
  6. Both sides name the prompt they mean: a digest of its token ids travels with the KV (kvown's aux
     payload) and the decode worker compares it with its own before the request may decode, so a
     pairing or tokenisation mismatch fails the request instead of serving another prompt's KV.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvown.core.ids import is_valid_request_id
from kvown.core.messages import MAX_RANK


DIGEST_NBYTES = 16


def prompt_digest(token_ids: Sequence[int]) -> bytes:
    """Rule 6: what both sides compute from the prompt's token ids (16 bytes of BLAKE2b)."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=DIGEST_NBYTES).digest()


@dataclass(frozen=True, slots=True)
class Receive:
    req_id: str
    request_id: int  # kvown's
    writer: int
    blocks: tuple[int, ...]
    digest: bytes = b""  # rule 6: the prompt this destination is for


@dataclass(frozen=True, slots=True)
class Send:
    req_id: str
    request_id: int
    blocks: tuple[int, ...]
    digest: bytes = b""


@dataclass(frozen=True, slots=True)
class Cancel:
    req_id: str
    request_id: int
    notify: tuple[int, ...] = ()  # writers to tell, for a request that was never published (rule 3)
    report: bool = False  # vLLM waits for it in WAITING_FOR_REMOTE_KVS: report it finished (failed)


@dataclass(slots=True)
class StepPlan:
    """What the workers do this step (vLLM ships it as the step's connector metadata)."""

    receives: list[Receive] = field(default_factory=list)
    sends: list[Send] = field(default_factory=list)
    cancels: list[Cancel] = field(default_factory=list)  # decode side
    send_cancels: list[Cancel] = field(default_factory=list)  # prefill side

    def empty(self) -> bool:
        return not (self.receives or self.sends or self.cancels or self.send_cancels)


def transfer_ids(params: dict[str, Any] | None) -> tuple[int, int] | None:
    """Rule 1: ``(kvown request id, writer rank)`` from a request's ``kv_transfer_params``, or None."""
    if not isinstance(params, dict):
        return None
    rid, writer = params.get("kvown_request_id"), params.get("kvown_writer", 0)
    if not is_valid_request_id(rid) or type(writer) is not int or not 0 <= writer <= MAX_RANK:
        return None
    return rid, writer


class Planner:
    """The scheduler half of ``KvownConnector`` (one per vLLM engine core)."""

    def __init__(self, *, block_size: int, consumer: bool, producer: bool) -> None:
        self.block_size = block_size
        self.consumer, self.producer = consumer, producer
        self._plan = StepPlan()
        self._recv_new: dict[str, Receive] = {}  # decided, not yet shipped
        self._recv_live: dict[str, Receive] = {}  # shipped; not yet reported finished
        self._recv_seen: set[str] = set()  # every decode request decided once (rule 2)
        self._sendable: dict[str, tuple[int, Any]] = {}  # prefill requests whose send is not open yet
        self._sent: dict[str, int] = {}  # sends shipped; not yet reported released

    # ---- decode side --------------------------------------------------------------------------

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """``get_num_new_matched_tokens``: side-effect free (vLLM may ask again)."""
        params = request.kv_transfer_params
        if not self.consumer or not params or not params.get("do_remote_prefill") or transfer_ids(params) is None:
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Any, unhashed_blocks: list[int], num_hashed_blocks: int,
                    num_external_tokens: int) -> None:
        """``update_state_after_alloc`` (rule 2; may be called twice for one request)."""
        params, req_id = request.kv_transfer_params, request.request_id
        ids = transfer_ids(params)
        if ids is None or not params:
            return
        if self.producer and params.get("do_remote_decode") and req_id not in self._sent:
            self._sendable.setdefault(req_id, (ids[0], request))
        if not self.consumer or not params.get("do_remote_prefill") or req_id in self._recv_seen:
            return
        self._recv_seen.add(req_id)
        rid, writer = ids
        if num_external_tokens <= 0:  # a full local hit: never published here (rule 3)
            self._plan.cancels.append(Cancel(req_id, rid, (writer,)))
            return
        need = math.ceil(request.num_prompt_tokens / self.block_size) - num_hashed_blocks
        if need < 1 or len(unhashed_blocks) < need:  # vLLM allocated otherwise than assumed: do not load
            self._plan.cancels.append(Cancel(req_id, rid, (writer,), report=True))
            return
        self._recv_new[req_id] = Receive(req_id, rid, writer, tuple(unhashed_blocks[:need]),
                                         prompt_digest(request.prompt_token_ids))

    def finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` (called once per request, abort included)."""
        req_id = request.request_id
        rid = self._sent.get(req_id)
        if rid is not None:  # rule 4: vLLM keeps the source blocks until the send is released
            return True, {"kvown_request_id": rid}
        entry = self._sendable.pop(req_id, None)
        if entry is not None:
            self._plan.send_cancels.append(Cancel(req_id, entry[0]))
        new = self._recv_new.pop(req_id, None)
        if new is not None:  # parked but never shipped: the worker reports it (rule 2) and tells P
            self._plan.cancels.append(Cancel(req_id, new.request_id, (new.writer,), report=True))
        elif req_id in self._recv_live:
            live = self._recv_live[req_id]
            self._plan.cancels.append(Cancel(req_id, live.request_id))
        elif req_id not in self._recv_seen and self.consumer:
            ids = transfer_ids(request.kv_transfer_params)
            params = request.kv_transfer_params or {}
            if ids is not None and params.get("do_remote_prefill"):  # ended before vLLM admitted it
                self._plan.cancels.append(Cancel(req_id, ids[0], (ids[1],)))
        self._recv_seen.discard(req_id)
        return False, None

    # ---- prefill side -------------------------------------------------------------------------

    def _due_sends(self, scheduled: dict[str, int], block_ids_of: Any) -> None:
        """Rule 4: a send opens in the step that completes its prompt."""
        for req_id, (rid, request) in list(self._sendable.items()):
            n = scheduled.get(req_id, 0)
            if n and request.num_computed_tokens + n >= request.num_prompt_tokens:
                blocks = tuple(block_ids_of(req_id)[: math.ceil(request.num_prompt_tokens / self.block_size)])
                del self._sendable[req_id]
                self._sent[req_id] = rid
                self._plan.sends.append(Send(req_id, rid, blocks, prompt_digest(request.prompt_token_ids)))

    # ---- every step ---------------------------------------------------------------------------

    def build(self, scheduled: dict[str, int], block_ids_of: Any) -> StepPlan:
        """``build_connector_meta``: this step's plan (rule 5). ``scheduled``: req_id -> tokens
        scheduled this step; ``block_ids_of(req_id)``: the request's block ids (group 0)."""
        if self.producer:
            self._due_sends(scheduled, block_ids_of)
        plan = self._plan
        plan.receives += self._recv_new.values()
        self._recv_live.update(self._recv_new)
        self._recv_new.clear()
        self._plan = StepPlan()
        return plan

    def reported(self, finished_sending: set[str] | None, finished_recving: set[str] | None) -> None:
        """``update_connector_output``: the workers reported these ids (each once)."""
        for req_id in finished_sending or ():
            self._sent.pop(req_id, None)
        for req_id in finished_recving or ():
            self._recv_live.pop(req_id, None)

    def pending(self) -> dict[str, int]:
        """Sizes of the tables (tests and diagnostics)."""
        return {"receives_new": len(self._recv_new), "receives_live": len(self._recv_live),
                "sendable": len(self._sendable), "sends_live": len(self._sent)}


__all__ = ["Cancel", "Planner", "Receive", "Send", "StepPlan", "transfer_ids"]
