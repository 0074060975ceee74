"""The embedding API: what a prefill server and a decode server call.

Owns: ``Sender`` and ``Receiver``, thin thread-safe facades that validate every argument in the
calling thread, then queue one typed command for the rank's engine and hand back a handle the engine
completes.

A prefill (context) server::

    handle = rt.sender.send(request_id, src_blocks, ready=tracker.record(stream))
    ...
    handle.released.wait()        # now no WRITE reads src_blocks any more: reuse them

A decode (generation) server::

    rx = rt.receiver.receive(request_id, num_blocks=8, writers=(0,))
    rx.landed.wait(timeout)       # KV is in rx.blocks: run decode on it
    rt.receiver.release(request_id)   # or rt.receiver.cancel(request_id) at any time
    rx.retired.wait()             # kvown returned the blocks to the pool, with proof

Rules:
  1. Blocks come back to the pool only through kvown (retirement with proof, or never: fail-stop).
  2. Every method may be called from any thread; ``cancel`` is idempotent and takes any valid id
     (cancelling before the session exists fences it: it will be born cancelled).
  3. Bad input raises a typed error in the caller, naming the argument (``LocalProtocolError`` with
     ``field``), before anything is queued: the engine never sees it, the pool is unchanged.
  4. A request id has at most one live session per role on a rank; a second ``send`` / ``receive``
     with a live id is refused (rule 3) - it would overwrite the first session's handle.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from kvown.adapters.transport import Role
from kvown.core.errors import LocalProtocolError
from kvown.core.ids import is_valid_request_id
from kvown.runtime.commands import (
    AdmissionError,
    Cancel,
    LocalCopy,
    Receive,
    ReceiveHandle,
    Release,
    Send,
    SendHandle,
    Ticket,
)
from kvown.runtime.engine import Engine

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
    try:
        out = tuple(blocks)
    except TypeError:
        raise LocalProtocolError(f"{field} must be a sequence of block ids", field=field) from None
    if not out:
        raise LocalProtocolError(f"{field} must not be empty", field=field)
    bad = [b for b in out if type(b) is not int or not 0 <= b < num_blocks]
    if bad:
        raise LocalProtocolError("block id out of range", field=field, blocks=bad[:4], num_blocks=num_blocks)
    return out


def _check_callback(on_done: Any) -> None:
    if on_done is not None and not callable(on_done):
        raise LocalProtocolError("on_done must be callable", field="on_done", value=type(on_done).__name__)


def _token(token: Any, field: str) -> Any:
    if not callable(getattr(token, "query", None)):
        raise LocalProtocolError("a ready token needs a query() method (e.g. WriteTracker.record())",
                                 field=field, value=type(token).__name__)
    return token


class Sender:
    """Context side. ``Called:`` from the prefill server's threads."""

    def __init__(self, engine: Engine) -> None:
        if engine.driver.sender is None:
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
    ) -> SendHandle:
        """Open a send session: write ``src_blocks`` to whoever publishes ``request_id``.

        ``ready`` is the write-ready token (``WriteTracker.record()``) of the KV write, one per piece or
        one for all; no WRITE is posted before it reports ready. Generation-first (the receiver
        published already) and context-first (it publishes later) both work.
        Ownership: ``src_blocks`` must not be reused until ``handle.released`` is set; ``on_done(handle)``
        is then called once, on the engine thread (quick, thread-safe, must not raise: a server's
        allocator hand-back).
        After error: nothing was queued (rules 3 and 4).
        """
        engine = self._engine
        _check_rid(request_id)
        blocks = _block_ids(src_blocks, engine.pool.num_blocks, "src_blocks")
        _positive_int(num_pieces, "num_pieces", at_most=len(blocks))
        _positive_int(num_receivers, "num_receivers", at_most=len(engine.driver.transport.peers))
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
            if len(aux) > engine.driver.config.aux_slot_nbytes:
                raise LocalProtocolError("aux payload larger than an aux slot", field="aux", nbytes=len(aux),
                                         max_nbytes=engine.driver.config.aux_slot_nbytes)
            aux = bytes(aux)
        _check_callback(on_done)
        _check_open(engine, request_id)
        handle = SendHandle(request_id, on_done=on_done)
        engine.live.claim(Role.SENDER, request_id, handle)
        engine.submit(Send(request_id, blocks, tuple(tokens), num_receivers, aux, handle))
        return handle

    def cancel(self, request_id: int) -> None:
        """Abort on the prefill side: fence the id, refuse unposted writes, let posted ones drain."""
        self._engine.submit(Cancel(Role.SENDER, _check_rid(request_id), self._engine.clock()))


class Receiver:
    """Generation side. ``Called:`` from the decode server's threads."""

    def __init__(self, engine: Engine) -> None:
        if engine.driver.receiver is None:
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
        is then called once on the engine thread (quick, thread-safe, must not raise).
        """
        ticket = self.submit_receive(request_id, num_blocks, writers, num_slices=num_slices, aux=aux,
                                     timeout_s=timeout_s, blocks=blocks, on_done=on_done)  # validates all
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
    ) -> Ticket:
        """``receive`` without the wait: validate, queue, and return the ticket whose ``future`` resolves
        to the handle (or ``PoolExhausted`` / ``LocalProtocolError``). For event-loop servers and the
        simulator, which must not block. After error: as ``receive``; nothing was queued.
        """
        engine = self._engine
        _check_rid(request_id)
        lent: tuple[int, ...] = ()
        if hasattr(engine.pool, "lend"):  # the server's own memory: it names the blocks it lends
            if num_blocks is not None or blocks is None:
                raise LocalProtocolError("this rank's KV memory belongs to the server: pass blocks= and "
                                         "num_blocks=None", field="blocks")
            lent = _block_ids(blocks, engine.pool.num_blocks, "blocks")
            if len(set(lent)) != len(lent):
                raise LocalProtocolError("blocks must be distinct", field="blocks")
            num_blocks = len(lent)
        elif blocks is not None:
            raise LocalProtocolError("kvown allocates from its own pool here: pass num_blocks, not blocks",
                                     field="blocks")
        _positive_int(num_blocks, "num_blocks", at_most=engine.pool.num_blocks)
        _check_callback(on_done)
        writers = self._writers(writers)
        _positive_int(num_slices, "num_slices", at_most=len(writers))
        if len(writers) % num_slices:
            raise LocalProtocolError("num_slices must divide the number of writers", field="num_slices",
                                     num_slices=num_slices, writers=len(writers))
        heads = engine.pool.heads()
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
        engine.submit(Receive(request_id, num_blocks, writers, num_slices, aux, ticket, lent, on_done))
        return ticket

    def _writers(self, writers: Any) -> tuple[int, ...]:
        try:
            out = tuple(writers)
        except TypeError:
            raise LocalProtocolError("writers must be a sequence of ranks", field="writers") from None
        if not out:
            raise LocalProtocolError("writers must not be empty", field="writers")
        if len(set(out)) != len(out):
            raise LocalProtocolError("writers must be distinct", field="writers", writers=out)
        peers = self._engine.driver.transport.peers
        for w in out:
            if type(w) is not int or w not in peers:
                raise LocalProtocolError("writer is not a peer rank of this world", field="writers", writer=w,
                                         peers=sorted(peers))
            if Role.SENDER not in peers[w].roles:
                raise LocalProtocolError("writer rank has no sender role", field="writers", writer=w)
        return out

    def cancel(self, request_id: int) -> None:
        """Cancel at any point; blocks retire once every published writer has quiesced."""
        entry = self._engine.live.live(Role.RECEIVER, _check_rid(request_id))
        if isinstance(entry, ReceiveHandle):
            entry.closing = True
        self._engine.submit(Cancel(Role.RECEIVER, request_id, self._engine.clock()))

    def release(self, request_id: int) -> None:
        """The consumer is done with delivered blocks; kvown retires them with proof.

        After error: ``LocalProtocolError`` if the id has no live receive or its KV has not landed
        (cancel instead); nothing was queued.
        """
        handle = self._live_handle(request_id, "release")
        if not handle.landed.is_set():
            raise LocalProtocolError("release before the KV landed; cancel instead", field="request_id",
                                     request_id=request_id)
        handle.closing = True
        self._engine.submit(Release(request_id, self._engine.clock()))

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
        entry = self._engine.live.live(Role.RECEIVER, _check_rid(request_id))
        handle = entry.future.result(WITHDRAWN_WAIT_S) if isinstance(entry, Ticket) else entry
        if handle is None:
            raise LocalProtocolError(f"{what}: no live receive session for this request", field="request_id",
                                     request_id=request_id)
        return handle

    def read_aux(self, handle: ReceiveHandle) -> bytes:
        """The auxiliary payload of a landed request."""
        if handle.aux_slot < 0 or not handle.landed.is_set():
            raise LocalProtocolError("no landed aux payload", field="aux_slot", request_id=handle.request_id)
        return self._engine.driver.read_aux(handle)


class _AlwaysReady:
    def query(self) -> bool:
        return True

    def wait(self, timeout_s: float) -> bool:
        return True


_always_ready = _AlwaysReady()
