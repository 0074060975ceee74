"""Retirement canaries: prove that nothing wrote into a block between its retirement and its reuse.

Owns: the canary pattern of a (pool, block, retirement epoch) and the per-block epoch counter.

Rules:
  1. On retirement a block is filled with ``pattern(pool_id, block, epoch)``, where ``epoch`` counts
     that block's retirements. Before the block is handed out again the pattern is verified.
  2. A mismatch means a write landed after retirement (a writer that was not quiescent, or a bug):
     ``check`` reports the block, its epoch and the first bad byte offset; the caller fail-stops.
  3. The pattern differs per block and per epoch, so a late write of another block's (or an earlier
     epoch's) canary is caught too.
  4. Device-agnostic: the pattern is computed with torch on the pool's own device.

Invariants:
  INV-CN1  ``check(blocks)`` right after ``fill(blocks)`` reports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: consecutive seeds land far apart
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class CanaryBroken:
    block: int
    epoch: int
    offset: int  # first byte that differs from the canary


class Canaries:
    """Canary state of one pool. Called: on the engine thread only (retire and allocate paths)."""

    def __init__(self, pool_tensor: torch.Tensor, block_nbytes: int, num_blocks: int, pool_id: int = 0) -> None:
        self._tensor = pool_tensor
        self._block_nbytes = block_nbytes
        self._pool_id = pool_id
        self._epochs = [0] * num_blocks
        steps = torch.arange(block_nbytes, dtype=torch.int64, device=pool_tensor.device)
        self._steps = steps * 0x2545F491  # per-byte increments; the seed adds per (pool, block, epoch)

    def pattern(self, block: int, epoch: int) -> torch.Tensor:
        seed = ((self._pool_id * 1_000_003 + block) * _MIX + epoch * 0xBF58476D1CE4E5B9) & _MASK64
        return ((self._steps + (seed >> 8)) >> 7).to(torch.uint8)

    def _view(self, block: int) -> torch.Tensor:
        start = block * self._block_nbytes
        return self._tensor[start : start + self._block_nbytes]

    def fill(self, blocks: tuple[int, ...]) -> None:
        """Rule 1: stamp freshly retired blocks."""
        for block in blocks:
            self._epochs[block] += 1
            self._view(block).copy_(self.pattern(block, self._epochs[block]))

    def check(self, blocks: tuple[int, ...]) -> list[CanaryBroken]:
        """Rule 2: the blocks about to be handed out, each verified against its last canary."""
        broken = []
        for block in blocks:
            epoch = self._epochs[block]
            if epoch == 0:  # never retired: nothing to verify
                continue
            bad = torch.nonzero(self._view(block) != self.pattern(block, epoch))
            if bad.numel():
                broken.append(CanaryBroken(block, epoch, int(bad[0, 0])))
        return broken
