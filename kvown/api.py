"""The embedding API: what a prefill server and a decode server call.

Owns: nothing; ``Sender`` and ``Receiver`` are thin, thread-safe facades that queue commands for the
rank's engine thread (``kvown.runtime.engine``) and hand back handles the engine completes.

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
  2. Every method may be called from any thread, any number of times; ``cancel`` is idempotent.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Sequence

from kvown.core.errors import LocalProtocolError
from kvown.core.events import OpenSend
from kvown.core.ids import is_valid_request_id
from kvown.runtime.engine import AdmissionError, Engine, ReceiveHandle, ReceiveSpec, SendHandle


def _check_open(engine: Engine, request_id: int) -> None:
    """A rank that latched a fail-stop admits nothing (its engine is parked, waiting to die)."""
    fatal = engine.fail_stopping()
    if fatal is not None:
        raise AdmissionError("this rank is fail-stopping", request_id=request_id, reason=fatal.detail)


def _check_rid(request_id: int) -> None:
    if not is_valid_request_id(request_id):
        raise LocalProtocolError("invalid request id (use kvown.make_request_id)", field="request_id",
                                 request_id=request_id)


class Sender:
    """Context side. ``Called:`` from the prefill server's threads."""

    def __init__(self, engine: Engine) -> None:
        if engine.sender is None:
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
    ) -> SendHandle:
        """Open a send session: write ``src_blocks`` to whoever publishes ``request_id``.

        ``ready`` is the write-ready token (``WriteTracker.record()``) of the KV write, one per piece or
        one for all; no WRITE is posted before it reports ready. Generation-first (the receiver
        published already) and context-first (it publishes later) both work.
        Ownership: ``src_blocks`` must not be reused until ``handle.released`` is set.
        After error: nothing was queued.
        """
        _check_rid(request_id)
        _check_open(self._engine, request_id)
        blocks = tuple(int(b) for b in src_blocks)
        self._engine.pool.layout.check_block_ids(blocks, field="src_blocks")
        tokens = list(ready) if isinstance(ready, (list, tuple)) else [ready] * num_pieces
        if len(tokens) != num_pieces:
            raise LocalProtocolError("one ready token per piece", field="ready", pieces=num_pieces)
        tokens = [_always_ready if t is None else t for t in tokens]
        handle = SendHandle(request_id)
        event = OpenSend(request_id, blocks, num_pieces, num_receivers)
        self._engine.submit(("send", event, handle, tokens, aux))
        return handle

    def cancel(self, request_id: int) -> None:
        """Abort on the prefill side: fence the id, refuse unposted writes, let posted ones drain."""
        _check_rid(request_id)
        self._engine.submit(("cancel", "sender", request_id))


class Receiver:
    """Generation side. ``Called:`` from the decode server's threads."""

    def __init__(self, engine: Engine) -> None:
        if engine.receiver is None:
            raise LocalProtocolError("this rank was started without the receiver role", field="roles")
        self._engine = engine

    def receive(
        self,
        request_id: int,
        num_blocks: int,
        writers: Sequence[int],
        *,
        num_slices: int = 1,
        aux: bool = False,
        timeout_s: float = 10.0,
    ) -> ReceiveHandle:
        """Allocate destination blocks and publish them to ``writers``.

        ``writers[i]`` writes head slice ``i % num_slices``; more writers than slices is a broadcast
        publication (one cohort delivers, the others must acknowledge). Raises ``PoolExhausted`` when
        the pool has too few free blocks (nothing changed: retry later) and ``AdmissionError`` through
        ``handle.outcome`` when the rank refuses new sessions.
        Ownership: ``handle.blocks`` belong to kvown until ``handle.retired`` is set.
        """
        _check_rid(request_id)
        _check_open(self._engine, request_id)
        if type(num_blocks) is not int or num_blocks < 1:
            raise LocalProtocolError("num_blocks must be a positive int", field="num_blocks", value=num_blocks)
        allocated: Future = Future()
        spec = ReceiveSpec(request_id, num_blocks, tuple(int(w) for w in writers), num_slices, aux)
        self._engine.submit(("receive", spec, ReceiveHandle(request_id), allocated))
        return allocated.result(timeout_s)

    def cancel(self, request_id: int) -> None:
        """Cancel at any point; blocks retire once every published writer has quiesced."""
        _check_rid(request_id)
        self._engine.submit(("cancel", "receiver", request_id))

    def release(self, request_id: int) -> None:
        """The consumer is done with delivered blocks; kvown retires them with proof."""
        _check_rid(request_id)
        self._engine.submit(("release", request_id))

    def local_copy(self, request_id: int, ready: Any) -> None:
        """Declare a local copy into the destination (e.g. a scatter kernel) as pending evidence.

        ``ready`` is the token recorded after the copy (``WriteTracker.record(stream)``); the blocks
        cannot retire, whatever the writers say, until it reports done.
        Called: by the decode server after queueing the copy, any thread.
        """
        _check_rid(request_id)
        self._engine.submit(("local_copy", request_id, ready))

    def read_aux(self, handle: ReceiveHandle) -> bytes:
        """The auxiliary payload of a landed request."""
        if handle.aux_slot < 0 or not handle.landed.is_set():
            raise LocalProtocolError("no landed aux payload", field="aux_slot", request_id=handle.request_id)
        return bytes(self._engine._aux_view(handle.aux_slot).numpy())


class _AlwaysReady:
    def query(self) -> bool:
        return True

    def wait(self, timeout_s: float) -> bool:
        return True


_always_ready = _AlwaysReady()
