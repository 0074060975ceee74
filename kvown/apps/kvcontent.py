"""What a test program's "prefill" writes into a request's KV blocks, and how a receiver checks them.

Owns: ``KVContent``, used by ``kvown demo`` and ``kvown qualify`` on both of their devices.

Rules:
  1. Content is a pure function of (request id, index of the block in the request): every writer of
     a fan-in request writes the same full blocks, and a receiver regenerates them to compare.
  2. Pattern layouts (standard, MLA): ``fill_pattern(request, 0, index)`` per block.
  3. NVFP4 layouts: for every ``<name>_values`` plane, float32 values drawn from a generator seeded
     with the request id on the pool's device, quantised by ``kvown.kernels.ops`` with a fixed global scale
     into the value plane and its ``<name>_scales`` plane (inline in the block, or in the scale pool
     of a "separate" layout).
  4. A landed NVFP4 block is good when its 64-bit checksum (and its scale-pool block's) equals that of
     the block regenerated here, and its values dequantised with its landed scales equal the
     regenerated ones bit for bit.

Called: by one thread per pool (the rank's main thread); nothing here is shared.
"""

from __future__ import annotations

import dataclasses

import torch

from kvown.cache.pool import KVPool
from kvown.kernels import ops
from kvown.kernels.nvfp4 import NVFP4Tensor

NVFP4_GLOBAL_SCALE = 0.05  # the per-layer constant "calibration" gives N(0, 1) values: fits E4M3 scales


class KVContent:
    """The content rules above for the blocks of ``pool`` (requests of at most ``max_blocks``)."""

    def __init__(self, pool: KVPool, *, max_blocks: int = 16) -> None:
        self.pool, self.device = pool, pool.tensor.device
        layout = pool.layout
        self.names = tuple(p.name[: -len("_values")] for p in layout.planes if p.name.endswith("_values"))
        self.nvfp4 = bool(layout.scale_layout)
        if self.nvfp4:  # receivers regenerate the expected blocks here, then compare checksums
            self.expected = KVPool(dataclasses.replace(layout, num_blocks=max_blocks), device=self.device)

    def write(self, pool: KVPool, rid: int, blocks: tuple[int, ...]) -> None:
        """Write request ``rid``'s content into ``blocks`` of ``pool`` (on CUDA: enqueued on the current stream)."""
        if not self.nvfp4:
            for j, b in enumerate(blocks):
                ops.fill_pattern(pool.block_view(b), rid, 0, j)
            return
        ids = torch.tensor(blocks, device=self.device)
        g = torch.Generator(self.device).manual_seed(rid)
        for name in self.names:
            values = pool.plane_view(f"{name}_values")
            x = torch.randn(len(blocks), *values.shape[1:-1], values.shape[-1] * 2, generator=g, device=self.device)
            q = ops.quantize(x, NVFP4_GLOBAL_SCALE)
            values[ids] = q.values
            (pool.scales or pool).plane_view(f"{name}_scales")[ids] = q.scales

    def bad_blocks(self, rid: int, blocks: tuple[int, ...]) -> int:
        """How many of the landed ``blocks`` of request ``rid`` differ from what its writers wrote."""
        if not self.nvfp4:
            return sum(not ops.verify_pattern(self.pool.block_view(b), rid, 0, j) for j, b in enumerate(blocks))
        mine = tuple(range(len(blocks)))
        self.write(self.expected, rid, mine)
        bad = (_checksums(self.pool, blocks) != _checksums(self.expected, mine)).any(dim=0)
        for name in self.names:
            landed, want = _dequantized(self.pool, name, blocks), _dequantized(self.expected, name, mine)
            bad |= (landed.view(torch.int32) != want.view(torch.int32)).flatten(1).any(dim=1).cpu()
        return int(bad.sum())


def _checksums(pool: KVPool, blocks: tuple[int, ...]) -> torch.Tensor:
    """(pools, blocks) checksums: each block's bytes, and its scale-pool block's where scales live apart."""
    return torch.stack([ops.checksums(p.tensor.view(p.layout.num_blocks, -1), list(blocks)).cpu()
                        for p in (pool, pool.scales) if p is not None])


def _dequantized(pool: KVPool, name: str, blocks: tuple[int, ...]) -> torch.Tensor:
    ids = torch.tensor(blocks, device=pool.tensor.device)
    q = NVFP4Tensor(pool.plane_view(f"{name}_values")[ids], (pool.scales or pool).plane_view(f"{name}_scales")[ids],
                    NVFP4_GLOBAL_SCALE)
    return ops.dequantize(q)
