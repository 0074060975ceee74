"""Test hooks: the few things only a qualification, a soak's self-check or a test does on purpose.

Owns: ``TestHooks`` (``RankRuntime.testing``). Each hook runs on the engine thread (``Engine.call``),
so the single-writer rule holds; none is needed by a server, and none is reachable from the API.

Rules:
  1. A hook plants a known defect or hostile input so that a check can prove it catches it; it never
     repairs anything and never frees a block.
  2. Every hook is bounded by its caller's ``timeout_s``.
"""

from __future__ import annotations

from typing import Any

from kvown.core.messages import Envelope, seal
from kvown.runtime.engine import Engine


class TestHooks:
    """Planted bugs and raw frames for qualification and self-checks (rule 1)."""

    __test__ = False  # not a pytest class

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def plant_leak(self, request_id: int, num_blocks: int = 1, timeout_s: float = 10.0) -> tuple[int, ...]:
        """Allocate ``num_blocks`` for ``request_id`` and never give them back: a leak the audit must see."""
        return self._engine.call(lambda d: d.pool.allocate(num_blocks, owner=request_id), timeout_s)  # type: ignore[no-any-return]

    def plant_scribble(self, timeout_s: float = 10.0) -> int:
        """Flip one byte of the lowest free block (a late write after retirement); returns the block.

        The allocator hands out low runs first, so that block was used and retired with a canary.
        """

        def scribble(d: Any) -> int:
            block = d.pool.free_blocks()[0]
            d.pool.block_view(block).view(-1)[0] ^= 0xFF
            return int(block)

        return self._engine.call(scribble, timeout_s)  # type: ignore[no-any-return]

    def send_raw(self, dst_rank: int, data: bytes, timeout_s: float = 10.0) -> None:
        """Send ``data`` to ``dst_rank`` as a control notification, as-is: no framing, no seal, and past
        any fault wrapper (the agent itself sends it)."""
        agent = self._engine.view.peers[dst_rank].agent_name
        self._engine.call(lambda d: d.transport.endpoint.send_notif(agent, bytes(data)), timeout_s)

    def encode(self, envelope: Envelope, key: bytes | None = None) -> bytes:
        """A frame for ``envelope`` sealed with this job's key (or ``key``): an insider's forgery."""
        from kvown.adapters import codec

        return codec.encode(envelope, key if key is not None else self._engine.driver.key)

    def seal(self, body: bytes) -> bytes:
        """``body`` sealed with this job's key (a well-signed, malformed frame)."""
        return seal(body, self._engine.driver.key)


__all__ = ["TestHooks"]
