"""Write readiness: CUDA events (or host events on CPU) as ownership state.

Owns: ``ReadyToken`` (the one question "has the work before this point finished?") and
``WriteTracker``, which hands out tokens for a device.

Quirk kept here: a CUDA event that was never recorded also reports done, so a ``CudaReadyToken``
exists only for an event ``WriteTracker.record`` recorded (what CUDA promises: docs/design.md s. 14).

Rules:
  1. A sender posts a WRITE of KV bytes only after the token recorded after the producer's KV write
     reports done. The engine *polls* tokens (``query``/``poll``); it never calls ``wait`` (which is
     for consumers and tests, and is always bounded by ``timeout_s``).
  2. A receiver's own local copies (e.g. a staging copy into the pool) are evidence only once their
     token reports done; a "KV landed" signal for consumers is a ``HostReadyToken`` the engine signals.
  3. On CPU the same interface is backed by host events: ``record`` returns a token that is already
     done (CPU writes are synchronous, so the write before ``record`` has finished), and ``pending``
     gives an unsignalled token that a producer signals later. The gating logic is thus testable
     without a GPU.
  4. A CUDA failure surfacing through an event (a sticky error from an earlier kernel) is an
     ``AdapterError`` with the CUDA error as ``.cause``; it is never read as "not ready".

Invariants:
  1. A token's ``query`` goes from False to True at most once and never back.
  2. ``query`` and ``poll`` never block.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from kvown.core.errors import AdapterError, ConfigError, LocalProtocolError

# How long CudaReadyToken.wait sleeps between queries: short against a KV write, long enough not to spin.
_CUDA_WAIT_POLL_S = 0.0002


def _check_timeout(timeout_s: float) -> float:
    is_number = isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
    if not is_number or not math.isfinite(timeout_s) or timeout_s < 0:
        raise LocalProtocolError("wait needs a finite, non-negative timeout_s", field="timeout_s", value=timeout_s)
    return float(timeout_s)


@runtime_checkable
class ReadyToken(Protocol):
    """Has the work that came before this token finished?"""

    def query(self) -> bool:
        """True once done. Never blocks. Called: by the engine thread, every loop turn it cares."""
        ...

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s``; True if done. Not for the engine thread (rule 1)."""
        ...


class HostReadyToken:
    """A token backed by ``threading.Event``: done once someone calls ``signal``.

    Used on CPU for producer readiness, and on any device as the "KV landed" signal for consumers.
    """

    def __init__(self, *, signalled: bool = False) -> None:
        self._event = threading.Event()
        if signalled:
            self._event.set()

    def signal(self) -> None:
        """Mark done. Idempotent.

        Called: once, by the producer (any thread) after its write has finished.
        """
        self._event.set()

    def query(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self._event.wait(_check_timeout(timeout_s))


class CudaReadyToken:
    """A token backed by a recorded ``torch.cuda.Event`` (timing disabled: cheaper to record)."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event
        self._done = False  # invariant 1: once seen done, stay done without asking CUDA again

    def query(self) -> bool:
        """Called: by the engine thread. After error: ``AdapterError``; the token stays not done."""
        if not self._done:
            try:
                self._done = bool(self._event.query())
            except RuntimeError as error:  # rule 4: a CUDA error is not "not ready"
                raise AdapterError("CUDA event query failed", cause=error, device="cuda") from error
        return self._done

    def wait(self, timeout_s: float) -> bool:
        # Polling instead of event.synchronize(): synchronize cannot be bounded by a timeout.
        deadline_s = time.monotonic() + _check_timeout(timeout_s)
        while not self.query():
            if time.monotonic() >= deadline_s:
                return False
            time.sleep(_CUDA_WAIT_POLL_S)
        return True


class WriteTracker:
    """Hands out ready tokens for one device ("cpu" or "cuda[:n]")."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("WriteTracker on CUDA, but torch sees no CUDA device", field="device", value=str(device))
        if self.device.type not in {"cpu", "cuda"}:
            raise ConfigError("WriteTracker device must be cpu or cuda", field="device", value=str(device))

    def record(self, stream: torch.cuda.Stream | None = None) -> ReadyToken:
        """A token that is done once the work enqueued so far (on ``stream``) has finished.

        Called: by the producer, right after enqueueing a KV write (any thread that owns the stream).
        Ownership: the sender may post a WRITE of those bytes only once the token is done (rule 1).
        After error: ``AdapterError`` if CUDA refuses the event; ``LocalProtocolError`` for a stream on CPU.
        """
        if self.device.type == "cpu":
            if stream is not None:
                raise LocalProtocolError("a CPU WriteTracker takes no CUDA stream", field="stream")
            return HostReadyToken(signalled=True)  # rule 3: the CPU write before this call is finished
        try:
            event = torch.cuda.Event(enable_timing=False)
            event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        except RuntimeError as error:
            raise AdapterError("CUDA event record failed", cause=error, device=str(self.device)) from error
        return CudaReadyToken(event)

    def pending(self) -> HostReadyToken:
        """An unsignalled host token; the producer calls ``signal()`` when its write is done.

        Called: by whoever starts a write whose end is known only on the host (CPU copies, callbacks).
        """
        return HostReadyToken()

    def poll(self, tokens: Sequence[ReadyToken]) -> list[bool]:
        """``[token.query() for token in tokens]``: never blocks (invariant 2).

        Called: by the engine thread (or a CUDA event poller thread that enqueues events), each turn.
        After error: ``AdapterError`` from the first failing CUDA token; the others are unchanged.
        """
        return [token.query() for token in tokens]
