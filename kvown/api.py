"""The embedding API: what a prefill server and a decode server call.

Owns: ``Sender`` and ``Receiver``, thin thread-safe facades that validate every argument in the
calling thread, then queue one typed command for the rank's engine and hand back a handle the engine
completes.

How a prefill and a decode server call it, in five lines each: docs/design.md section 13.

Rules:
  1. Blocks come back to the pool only through kvown (retirement with proof, or never: fail-stop).
  2. Every method may be called from any thread; ``cancel`` is idempotent and takes any valid id
     (cancelling before the session exists fences it: it will be born cancelled).
  3. Bad input raises a typed error in the caller, naming the argument (``LocalProtocolError`` with
     ``field``), before anything is queued: the engine never sees it, the pool is unchanged.
  4. A request id has at most one live session per role on a rank; a second ``send`` / ``receive``
     with a live id is refused (rule 3) - it would overwrite the first session's handle.
  5. Closing never races into an error: ``release`` / ``cancel`` of a session that already retired
     (or concluded by itself) is a no-op that returns a ``CloseResult`` naming what happened and the
     outcome; only an id this rank never saw (or forgot: it remembers the last 65,536 per role) is
     an error.
  6. Validation reads only the rank's immutable ``RankView`` (peers, geometry, aux size) and the
     handles; never the engine's mutable tables.
  7. A handle's callbacks run on the engine thread: from there the API never waits for the engine (a
     ``receive`` raises; a receive the engine has not taken yet reads as not open).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from kvown.adapters.transport import Role
from kvown.core.errors import KvownError, LocalProtocolError
from kvown.core.ids import is_valid_request_id
from kvown.runtime.commands import (
    AdmissionError,
    Cancel,
    CloseResult,
    CloseStatus,
    LocalCopy,
    Receive,
    ReceiveHandle,
    ReceivePhase,
    ReceiveStatus,
    Release,
    Send,
    SendHandle,
    SendPhase,
    SendStatus,
    Ticket,
)
from kvown.runtime.engine import Engine
from kvown.runtime.view import RankView

_INT_ONLY = {int}  # exactly int: a bool or an int subclass is not a block id
WITHDRAWN_WAIT_S = 60.0  # a taken receive resolves within one engine step; this only bounds a dead engine


def _check_open(engine: Engine, request_id: int) -> None:
    """A rank that latched a fail-stop admits nothing (its engine is parked, waiting to die)."""
    fatal = engine.fail_stopping()
    if fatal is not None:
        raise AdmissionError("this rank is fail-stopping", request_id=request_id, reason=fatal.detail)


def _check_rid(request_id: Any) -> int:
    if not is_valid_request_id(request_id):
        raise LocalProtocolError("invalid request id (use kvown.make_request_id)", field="request_id",
                                 request_id=request_id)
    return request_id


def _positive_int(value: Any, field: str, *, at_most: int | None = None) -> int:
    if type(value) is not int or value < 1 or (at_most is not None and value > at_most):
        bound = f" and at most {at_most}" if at_most is not None else ""
        raise LocalProtocolError(f"{field} must be a positive int{bound}", field=field, value=value)
    return value


def _block_ids(blocks: Any, num_blocks: int, field: str) -> tuple[int, ...]:
    if type(blocks) is range and blocks.step == 1 and 0 <= blocks.start < blocks.stop <= num_blocks:
        return tuple(blocks)  # a contiguous run in bounds, checked by its ends (any other range: below)
    try:
        out = tuple(blocks)
    except TypeError:
        raise LocalProtocolError(f"{field} must be a sequence of block ids", field=field) from None
    if not out:
        raise LocalProtocolError(f"{field} must not be empty", field=field)
    if set(map(type, out)) != _INT_ONLY or min(out) < 0 or max(out) >= num_blocks:  # C-level scans first
        bad = [b for b in out if type(b) is not int or not 0 <= b < num_blocks]
        raise LocalProtocolError("block id out of range", field=field, blocks=bad[:4], num_blocks=num_blocks)
    return out


def _check_callback(callback: Any, field: str) -> None:
    if callback is not None and not callable(callback):
        raise LocalProtocolError(f"{field} must be callable", field=field, value=type(callback).__name__)


def _token(token: Any, field: str) -> Any:
    if token is None:
        return None
    if not callable(getattr(token, "query", None)):
        raise LocalProtocolError("a ready token needs a query() method (e.g. WriteTracker.record())",
                                 field=field, value=type(token).__name__)
    return token


class Sender:
    """Context side. ``Called:`` from the prefill server's threads."""

    def __init__(self, engine: Engine) -> None:
        if Role.SENDER not in engine.view.roles:
            raise LocalProtocolError("this rank was started without the sender role", field="roles")
        self._engine = engine

    def send(
        self,
        request_id: int,
        src_blocks: Sequence[int],
        *,
        ready: Any | Sequence[Any] | None = None,
        num_pieces: int = 1,
        num_receivers: int = 1,
        aux: bytes | None = None,
        on_done: Callable[[SendHandle], None] | None = None,
        dst_suffix: bool = False,
    ) -> SendHandle:
        """Open a send session: write ``src_blocks`` to whoever publishes ``request_id``.

        ``ready`` is the write-ready token (``WriteTracker.record()``) of the KV write, one per piece or
        one for all; no WRITE is posted before it reports ready. Generation-first (the receiver
        published already) and context-first (it publishes later) both work. ``dst_suffix=True`` (one
        piece): a receiver that already holds a prefix of the KV (a prefix-cache hit) may publish only
        the blocks it lacks; they get the LAST that many source blocks (the same token blocks).
        Ownership: ``src_blocks`` must not be reused until ``handle.released`` is set; ``on_done(handle)``
        is then called once, on the engine thread (quick, thread-safe, must not raise: a server's
        allocator hand-back).
        After error: nothing was queued (rules 3 and 4).
        """
        engine, view = self._engine, self._engine.view
        _check_rid(request_id)
        blocks = _block_ids(src_blocks, view.num_blocks, "src_blocks")
        _positive_int(num_pieces, "num_pieces", at_most=len(blocks))
        _positive_int(num_receivers, "num_receivers", at_most=max(1, len(view.peers)))
        if ready is None or not isinstance(ready, (list, tuple)):
            tokens = [_always_ready if ready is None else _token(ready, "ready")] * num_pieces
        else:
            tokens = [_token(t, "ready") for t in ready]
            if len(tokens) != num_pieces:
                raise LocalProtocolError("one ready token per piece", field="ready", tokens=len(tokens),
                                         num_pieces=num_pieces)
        if aux is not None:
            if not isinstance(aux, (bytes, bytearray)):
                raise LocalProtocolError("aux must be bytes", field="aux", value=type(aux).__name__)
            if len(aux) > view.aux_slot_nbytes:
                raise LocalProtocolError("aux payload larger than an aux slot", field="aux", nbytes=len(aux),
                                         max_nbytes=view.aux_slot_nbytes)
            aux = bytes(aux)
        _check_callback(on_done, "on_done")
        if not isinstance(dst_suffix, bool) or (dst_suffix and num_pieces != 1):
            raise LocalProtocolError("dst_suffix is True or False, and needs num_pieces=1", field="dst_suffix",
                                     value=dst_suffix, num_pieces=num_pieces)
        _check_open(engine, request_id)
        handle = SendHandle(request_id, on_done=on_done)
        engine.live.claim(Role.SENDER, request_id, handle)
        engine.submit(Send(request_id, blocks, tuple(tokens), num_receivers, aux, handle, dst_suffix))
        return handle

    def cancel(self, request_id: int) -> CloseResult:
        """Abort on the prefill side: fence the id, refuse unposted writes, let posted ones drain.

        Any valid id is accepted (one with no session yet is fenced: a later send is born cancelled).
        A send that already released is a no-op (rule 5). ``handle.released`` still means what it
        says: no WRITE reads the source blocks any more.
        """
        rid = _check_rid(request_id)
        entry, closed = self._engine.live.lookup(Role.SENDER, rid)
        if closed is not None:
            return closed
        self._engine.submit(Cancel(Role.SENDER, rid, self._engine.clock()))
        return CloseResult(rid, CloseStatus.QUEUED, None if entry is None else entry.result())

    def status(self, request_id: int) -> SendStatus:
        """Where a send is: ``phase`` open / published / posted / released (or refused), and its outcome.

        Pure read of the handle (any thread). After error: ``LocalProtocolError(field="request_id")``
        for an id this rank never sent (or forgot, rule 5).
        """
        rid = _check_rid(request_id)
        entry, closed = self._engine.live.lookup(Role.SENDER, rid)
        if entry is not None:
            return SendStatus(rid, entry.phase, entry.result())
        if closed is None:
            raise LocalProtocolError("no send session for this request on this rank", field="request_id",
                                     request_id=rid)
        phase = SendPhase.REFUSED if closed.status is CloseStatus.REFUSED else SendPhase.RELEASED
        return SendStatus(rid, phase, closed.outcome)


class Receiver:
    """Generation side. ``Called:`` from the decode server's threads."""

    def __init__(self, engine: Engine) -> None:
        if Role.RECEIVER not in engine.view.roles:
            raise LocalProtocolError("this rank was started without the receiver role", field="roles")
        self._engine = engine

    def receive(
        self,
        request_id: int,
        num_blocks: int | None,
        writers: Sequence[int],
        *,
        num_slices: int = 1,
        aux: bool = False,
        timeout_s: float = 10.0,
        blocks: Sequence[int] | None = None,
        on_done: Callable[[ReceiveHandle], None] | None = None,
        on_landed: Callable[[ReceiveHandle], None] | None = None,
    ) -> ReceiveHandle:
        """Allocate destination blocks and publish them to ``writers``.

        ``writers[i]`` writes head slice ``i % num_slices``; more writers than slices is a broadcast
        publication (one cohort delivers, the others must acknowledge). Raises ``PoolExhausted`` when
        the pool has too few free blocks (nothing changed: retry later), ``AdmissionError`` when the
        rank refuses new sessions, and ``TimeoutError`` when the engine did not take the command within
        ``timeout_s`` (it was withdrawn: nothing was allocated or published).
        Bring-your-own memory (``kvown.cache.lent``): pass ``blocks=`` (the server's own block ids, lent
        to kvown) and ``num_blocks=None``; they go back through ``on_done`` / the ledger's
        ``on_returned`` at retirement, never earlier.
        Ownership: ``handle.blocks`` belong to kvown until ``handle.retired`` is set; ``on_done(handle)``
        is then called once on the engine thread (quick, thread-safe, must not raise). ``on_landed(handle)``
        is called once on the engine thread when the KV landed (``landed`` set, outcome COMPLETED).
        Callbacks may call the non-blocking methods (``Sender.send``, ``submit_receive``, ``release``,
        ``cancel``); ``receive`` itself waits for the engine, so on its thread it raises (rule 7).
        """
        if self._engine.on_engine_thread():
            raise LocalProtocolError("receive() waits for the engine: from a callback use submit_receive",
                                     field="receive")
        ticket = self.submit_receive(request_id, num_blocks, writers, num_slices=num_slices, aux=aux,
                                     timeout_s=timeout_s, blocks=blocks, on_done=on_done,
                                     on_landed=on_landed)  # validates all
        try:
            handle = ticket.future.result(timeout_s)
        except TimeoutError:
            if ticket.withdraw():  # never leave blocks allocated and published with no handle
                raise TimeoutError(f"kvown engine did not take receive({request_id}) within {timeout_s} s; "
                                   "withdrawn, nothing was allocated") from None
            handle = ticket.future.result(WITHDRAWN_WAIT_S)  # taken: it resolves within one step
        self._engine.live.replace(Role.RECEIVER, request_id, handle)
        return handle

    def submit_receive(
        self, request_id: int, num_blocks: int | None, writers: Sequence[int], *, num_slices: int = 1,
        aux: bool = False, timeout_s: float = 10.0, blocks: Sequence[int] | None = None,
        on_done: Callable[[ReceiveHandle], None] | None = None,
        on_landed: Callable[[ReceiveHandle], None] | None = None,
    ) -> Ticket:
        """``receive`` without the wait: validate, queue, and return the ticket whose ``future`` resolves
        to the handle (or ``PoolExhausted`` / ``LocalProtocolError``). For event-loop servers and the
        simulator, which must not block. After error: as ``receive``; nothing was queued.
        """
        engine, view = self._engine, self._engine.view
        _check_rid(request_id)
        lent: tuple[int, ...] = ()
        if view.lent:  # the server's own memory: it names the blocks it lends
            if num_blocks is not None or blocks is None:
                raise LocalProtocolError("this rank's KV memory belongs to the server: pass blocks= and "
                                         "num_blocks=None", field="blocks")
            lent = _block_ids(blocks, view.num_blocks, "blocks")
            if len(set(lent)) != len(lent):
                raise LocalProtocolError("blocks must be distinct", field="blocks")
            num_blocks = len(lent)
        elif blocks is not None:
            raise LocalProtocolError("kvown allocates from its own pool here: pass num_blocks, not blocks",
                                     field="blocks")
        _positive_int(num_blocks, "num_blocks", at_most=view.num_blocks)
        _check_callback(on_done, "on_done")
        _check_callback(on_landed, "on_landed")
        writers = _writers(writers, view)
        _positive_int(num_slices, "num_slices", at_most=len(writers))
        if len(writers) % num_slices:
            raise LocalProtocolError("num_slices must divide the number of writers", field="num_slices",
                                     num_slices=num_slices, writers=len(writers))
        heads = view.num_kv_heads
        if heads % num_slices:
            raise LocalProtocolError("num_slices must divide the KV heads", field="num_slices",
                                     num_slices=num_slices, num_kv_heads=heads)
        if not isinstance(aux, bool):
            raise LocalProtocolError("aux must be True or False", field="aux", value=aux)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
            math.isfinite(timeout_s) and timeout_s > 0
        ):
            raise LocalProtocolError("timeout_s must be a finite number > 0", field="timeout_s", value=timeout_s)
        _check_open(engine, request_id)
        ticket = Ticket()
        engine.live.claim(Role.RECEIVER, request_id, ticket)
        engine.submit(Receive(request_id, num_blocks, writers, num_slices, aux, ticket, lent, on_done, on_landed))
        return ticket

    def cancel(self, request_id: int, *, ready: Any = None, writers: Sequence[int] = ()) -> CloseResult:
        """Cancel at any point; blocks retire once every published writer has quiesced.

        Any valid id is accepted (one with no session yet is fenced: a later receive is born
        cancelled). ``writers``: for an id with no session here, writers to tell as well, so one that
        holds source blocks for a publication that will now never come releases them at once (a host
        that decided to compute the KV itself). A landed session is thereby released: pass ``ready``
        (the token recorded after the consumer's last read, as for ``release``) if a read may still be
        in flight. A session that already retired is a no-op (rule 5).
        """
        rid = _check_rid(request_id)
        token = _token(ready, "ready")
        notify = _writers(writers, self._engine.view) if writers else ()
        entry, closed = self._engine.live.lookup(Role.RECEIVER, rid)
        if closed is not None:
            return closed
        handle = _resolved(entry, self._engine)
        if handle is not None:
            if handle.closing:
                return CloseResult(rid, CloseStatus.ALREADY_CLOSING, handle.result())
            handle.closing = True
        self._engine.submit(Cancel(Role.RECEIVER, rid, self._engine.clock(), token, notify))
        return CloseResult(rid, CloseStatus.QUEUED, None if handle is None else handle.result())

    def release(self, request_id: int, *, ready: Any = None) -> CloseResult:
        """The consumer is done with delivered blocks; kvown retires them with proof.

        ``ready``: the token recorded after the consumer's last read of the blocks (on a GPU
        ``WriteTracker.record(stream)`` after the decode kernel that reads them; a host event on CPU).
        Nothing retires - no canary fill, no republication to the next writer - before it reports done.
        Without a token the caller promises that every read of the blocks has finished.
        Returns what happened (rule 5): ``QUEUED``, or a no-op ``ALREADY_CLOSING`` / ``ALREADY_RETIRED``
        with the outcome (a cancel or timeout that won the race with the landing already closed it).
        After error: ``LocalProtocolError`` naming ``request_id`` for an id never received here, or for a
        live session whose KV has not landed and that has not concluded (cancel it instead); nothing
        was queued.
        """
        rid = _check_rid(request_id)
        token = _token(ready, "ready")
        entry, closed = self._engine.live.lookup(Role.RECEIVER, rid)
        if closed is not None:
            return closed
        handle = _resolved(entry, self._engine)
        if handle is None:
            raise LocalProtocolError("release: no receive session for this request on this rank",
                                     field="request_id", request_id=rid)
        if handle.closing or (handle.outcome.done() and not handle.landed.is_set()):
            return CloseResult(rid, CloseStatus.ALREADY_CLOSING, handle.result())
        if not handle.landed.is_set():
            raise LocalProtocolError("release before the KV landed; cancel instead", field="request_id",
                                     request_id=rid)
        handle.closing = True
        self._engine.submit(Release(rid, self._engine.clock(), token))
        return CloseResult(rid, CloseStatus.QUEUED, handle.result())

    def status(self, request_id: int) -> ReceiveStatus:
        """Where a receive is: ``phase`` published / landed / concluded / closing / retired (or refused),
        and its outcome. After error: ``LocalProtocolError(field="request_id")`` for an unknown id."""
        rid = _check_rid(request_id)
        entry, closed = self._engine.live.lookup(Role.RECEIVER, rid)
        handle = _resolved(entry, self._engine)
        if handle is not None:
            return ReceiveStatus(rid, handle.phase, handle.result())
        if closed is None:
            if entry is not None:  # a ticket the engine has not answered yet
                return ReceiveStatus(rid, ReceivePhase.PUBLISHED)
            raise LocalProtocolError("no receive session for this request on this rank", field="request_id",
                                     request_id=rid)
        phase = ReceivePhase.REFUSED if closed.status is CloseStatus.REFUSED else ReceivePhase.RETIRED
        return ReceiveStatus(rid, phase, closed.outcome)

    def local_copy(self, request_id: int, ready: Any) -> None:
        """Declare a local copy into the destination (e.g. a scatter kernel) as pending evidence.

        ``ready`` is the token recorded after the copy (``WriteTracker.record(stream)``); the blocks
        cannot retire, whatever the writers say, until it reports done.
        Called: by the decode server after queueing the copy, any thread.
        """
        _token(ready, "ready")
        handle = self._live_handle(request_id, "local_copy")
        if handle.closing:
            raise LocalProtocolError("local_copy after release or cancel: the blocks are no longer yours to fill",
                                     field="request_id", request_id=request_id)
        self._engine.submit(LocalCopy(request_id, ready))

    def _live_handle(self, request_id: int, what: str) -> ReceiveHandle:
        handle = _resolved(self._engine.live.live(Role.RECEIVER, _check_rid(request_id)), self._engine)
        if handle is None:
            raise LocalProtocolError(f"{what}: no live receive session for this request", field="request_id",
                                     request_id=request_id)
        return handle

    def read_aux(self, handle: ReceiveHandle) -> bytes:
        """The auxiliary payload of a landed request."""
        if handle.aux_slot < 0 or not handle.landed.is_set():
            raise LocalProtocolError("no landed aux payload", field="aux_slot", request_id=handle.request_id)
        return self._engine.read_aux(handle)


def _resolved(entry: Any, engine: Engine) -> ReceiveHandle | None:
    """The handle behind a live entry (a ticket resolves within one engine step), or None. On the
    engine thread an unanswered ticket is None: its step cannot come while we wait (rule 7)."""
    if isinstance(entry, Ticket):
        if not entry.future.done() and engine.on_engine_thread():
            return None
        try:
            return entry.future.result(WITHDRAWN_WAIT_S)  # type: ignore[no-any-return]
        except KvownError:  # refused (pool exhausted, admission): no session
            return None
    return entry  # type: ignore[no-any-return]


def _writers(writers: Any, view: RankView) -> tuple[int, ...]:
    try:
        out = tuple(writers)
    except TypeError:
        raise LocalProtocolError("writers must be a sequence of ranks", field="writers") from None
    if not out:
        raise LocalProtocolError("writers must not be empty", field="writers")
    if len(set(out)) != len(out):
        raise LocalProtocolError("writers must be distinct", field="writers", writers=out)
    for w in out:
        if type(w) is not int or w not in view.peers:
            raise LocalProtocolError("writer is not a peer rank of this world", field="writers", writer=w,
                                     peers=sorted(view.peers))
        if Role.SENDER not in view.peers[w].roles:
            raise LocalProtocolError("writer rank has no sender role", field="writers", writer=w)
    return out


class _AlwaysReady:
    def query(self) -> bool:
        return True

    def wait(self, timeout_s: float) -> bool:
        return True


_always_ready = _AlwaysReady()
