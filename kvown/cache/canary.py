"""Retirement canaries: prove that nothing wrote into a block between its retirement and its reuse.

Owns: the per-block retirement epoch of one pool. The pattern itself, ``canary(pool_id, block,
epoch)``, and its fill and verify kernels live in ``kvown.kernels.ops`` (CUDA on a GPU pool, the torch
reference on CPU, the same bits either way).

Rules:
  1. On retirement a block is filled with the canary of (pool, block, epoch), where ``epoch`` counts
     that block's retirements. Before the block is handed out again the canary is verified.
  2. A mismatch means a write landed after retirement (a writer that was not quiescent, or a bug):
     ``check`` reports the block, its epoch and the first bad byte offset; the caller fail-stops.
  3. The pattern differs per pool, block and epoch, so a late write of another block's (or an
     earlier epoch's) canary is caught too.

Invariants:
  INV-CN1  ``check(blocks)`` right after ``fill(blocks)`` reports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvown.kernels import ops


@dataclass(frozen=True, slots=True)
class CanaryBroken:
    block: int
    epoch: int
    offset: int  # first byte that differs from the canary


class Canaries:
    """Canary state of one pool. Called: on the engine thread only (retire and allocate paths)."""

    def __init__(self, pool_tensor: torch.Tensor, block_nbytes: int, num_blocks: int, pool_id: int = 0) -> None:
        self._blocks = pool_tensor.view(num_blocks, block_nbytes)
        self._pool_id = pool_id
        self._epochs = [0] * num_blocks

    def fill(self, blocks: tuple[int, ...]) -> None:
        """Rule 1: stamp freshly retired blocks (one launch on a GPU pool)."""
        for block in blocks:
            self._epochs[block] += 1
        ops.fill_canary(self._blocks, list(blocks), self._pool_id, [self._epochs[b] for b in blocks])

    def check(self, blocks: tuple[int, ...]) -> list[CanaryBroken]:
        """Rule 2: the blocks about to be handed out, each verified against its last canary."""
        stamped = [b for b in blocks if self._epochs[b]]  # never retired: nothing to verify
        if not stamped:
            return []
        epochs = [self._epochs[b] for b in stamped]
        first = ops.verify_canary(self._blocks, stamped, self._pool_id, epochs).tolist()
        return [CanaryBroken(b, e, off) for b, e, off in zip(stamped, epochs, first) if off >= 0]
