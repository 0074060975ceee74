"""Retirement canaries: prove that nothing wrote into a block between its retirement and its reuse.

Owns: the per-block retirement epoch of one pool, and (on a GPU pool) kvown's own CUDA stream for the
canary work. The pattern itself, ``canary(pool_id, block, epoch)``, and its fill and verify kernels
live in ``kvown.kernels.ops`` (CUDA on a GPU pool, the torch reference on CPU, the same bits either way).

Rules:
  1. On retirement a block is filled with the canary of (pool, block, epoch), where ``epoch`` counts
     that block's retirements. Before the block is handed out again the canary is verified.
  2. A mismatch means a write landed after retirement (a writer that was not quiescent, or a bug):
     ``check`` reports the block, its epoch, the plane and the first bad byte offset; the caller
     fail-stops.
  3. The pattern differs per pool, plane, block and epoch, so a late write of another block's (or an
     earlier epoch's) canary is caught too.
  4. Every plane of a block is guarded: the value pool and, for a "separate" NVFP4 layout, its scale
     pool at the same block index (``of_pool``). A late write of scales is as wrong as one of values.
  5. On a GPU pool, fill and verify run on a side stream that kvown owns, never on the default
     stream, and ``check`` waits for that stream's event alone: kvown never queues behind, or
     synchronises with, the model's work. Ids and epochs are checked on the host from the ints kept
     here (``kvown.kernels.blocks`` rule 4). Ordering against the model is the caller's: a block is
     retired only after the consumer's ready token reports done. On CPU nothing of this applies.

Invariants:
  INV-CN1  ``check(blocks)`` right after ``fill(blocks)`` reports nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvown.cache.pool import KVPool
from kvown.kernels import ops

PLANE_VALUES, PLANE_SCALES = 0, 1
_PLANE_SALT = (0, 0x5CA1E500)  # plane k's canaries use pool id ``pool_id ^ salt[k]`` (rule 3)


@dataclass(frozen=True, slots=True)
class CanaryBroken:
    block: int
    epoch: int
    offset: int  # first byte that differs from the canary, within the plane's block
    plane: int = PLANE_VALUES  # PLANE_VALUES, or PLANE_SCALES: the separate scale pool's block


class Canaries:
    """Canary state of one pool. Called: on the engine thread only (retire and allocate paths)."""

    def __init__(self, pool_tensor: torch.Tensor, block_nbytes: int, num_blocks: int, pool_id: int = 0, *,
                 scales: tuple[torch.Tensor, int] | None = None) -> None:
        """``scales``: the separate scale pool's tensor and its bytes per block (rule 4)."""
        planes = [pool_tensor.view(num_blocks, block_nbytes)]
        if scales is not None:
            planes.append(scales[0].view(num_blocks, scales[1]))
        self._planes = tuple(planes)
        self._pool_id = pool_id
        self._epochs = [0] * num_blocks
        self._stream = _side_stream(pool_tensor)

    @classmethod
    def of_pool(cls, pool: KVPool, pool_id: int = 0) -> Canaries:
        """The canaries of every plane of ``pool``: its blocks and, if it has one, its scale pool's."""
        scales = None if pool.scales is None else (pool.scales.tensor, pool.scales.layout.block_nbytes)
        return cls(pool.tensor, pool.layout.block_nbytes, pool.num_blocks, pool_id, scales=scales)

    @property
    def planes(self) -> int:
        return len(self._planes)

    def fill(self, blocks: tuple[int, ...]) -> None:
        """Rule 1: stamp freshly retired blocks (one launch per plane on a GPU pool, none waited for)."""
        for block in blocks:
            self._epochs[block] += 1
        epochs = [self._epochs[b] for b in blocks]
        with self._on_side_stream():
            for k, plane in enumerate(self._planes):
                ops.fill_canary(plane, list(blocks), self._pool_id ^ _PLANE_SALT[k], epochs)

    def check(self, blocks: tuple[int, ...]) -> list[CanaryBroken]:
        """Rule 2: the blocks about to be handed out, each verified against its last canary; for each
        broken block the first plane found broken (values before scales)."""
        stamped = [b for b in blocks if self._epochs[b]]  # never retired: nothing to verify
        if not stamped:
            return []
        epochs = [self._epochs[b] for b in stamped]
        with self._on_side_stream():
            firsts = [ops.verify_canary(plane, stamped, self._pool_id ^ _PLANE_SALT[k], epochs)
                      for k, plane in enumerate(self._planes)]
            offsets = self._read(torch.stack(firsts))
        broken = []
        for i, (block, epoch) in enumerate(zip(stamped, epochs, strict=True)):
            plane = next((k for k in range(len(offsets)) if offsets[k][i] >= 0), None)
            if plane is not None:
                broken.append(CanaryBroken(block, epoch, offsets[plane][i], plane))
        return broken

    @contextlib.contextmanager
    def _on_side_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            yield

    def _read(self, firsts: torch.Tensor) -> Any:
        """Rule 5: the verify results on the host, waiting for the side stream's work alone."""
        if self._stream is None:
            return firsts.tolist()
        host = firsts.to("cpu", non_blocking=True)  # into pinned memory, queued on the side stream
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(self._stream)
        done.synchronize()
        return host.tolist()


def _side_stream(tensor: torch.Tensor) -> Any:
    """Rule 5: kvown's stream for a CUDA pool (None on CPU), ordered once after the work queued on
    the current stream so far: the pool's zero fill."""
    if not tensor.is_cuda:
        return None
    stream = torch.cuda.Stream(device=tensor.device)  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream(tensor.device))
    return stream
