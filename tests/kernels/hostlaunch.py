"""Runs kvown.kernels.ops' CUDA launches on the CPU, reading every argument as a GPU would.

A kernel gets addresses, not tensors: each pointer argument is read here as a flat array from the
tensor's ``data_ptr()``, whatever its strides, and each block's bytes come from the host build of the
kernels' own arithmetic (``kvown.kernels._kv_host``). So an argument that is not what the kernel
assumes (ids or epochs that are a strided view, two tensors swapped) gives wrong bytes here as it
would on a GPU, where the torch reference, which indexes by strides, would hide it.

Emulated: ``kv_pattern_fill``, ``kv_pattern_verify`` (patterns and canaries) and the checksum pair,
whose two passes are folded: the lanes hold each block's final checksum as two 32-bit halves.
Every read and write is bounds-checked against the tensor's storage, so a wrong id fails the test
instead of corrupting the test process.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch
from kernelsig import signatures


def _inside(t: torch.Tensor, nbytes: int) -> None:
    storage = t.untyped_storage()
    assert t.data_ptr() >= storage.data_ptr(), "a launch argument starts before its tensor's storage"
    end = storage.data_ptr() + storage.nbytes()
    assert t.data_ptr() + nbytes <= end, "the launch touches memory past its tensor"


def _array(ptr: Any, ctype: Any, count: int) -> Any:
    """The ``count`` elements at a pointer argument, as a writable NumPy view; None for NULL."""
    if not isinstance(ptr, torch.Tensor):
        assert int(ptr) == 0, "a pointer argument that is neither a tensor nor NULL"
        return None
    _inside(ptr, ctypes.sizeof(ctype) * count)
    return np.ctypeslib.as_array((ctype * count).from_address(ptr.data_ptr())) if count else np.zeros(0)


def _row(base: torch.Tensor, offset: int, nbytes: int) -> Any:
    _inside(base, offset + nbytes)
    return (ctypes.c_uint8 * nbytes).from_address(base.data_ptr() + offset)


class HostLaunch:
    """A stand-in for ``ops._launch`` (with ``ops._dl`` the identity): runs each launch on the host."""

    def __init__(self, host: Any) -> None:
        self.host = host
        self.signatures = signatures()
        self.launched: list[str] = []

    def __call__(self, device: torch.device, name: str, grid: tuple[int, ...], args: Any) -> None:
        params = [pname for _, pname in self.signatures[name]]
        getattr(self, name)(**dict(zip(params, args(), strict=True)))
        self.launched.append(name)

    def _seeds(self, mode: int, pool_id: int, block: int, epoch: int, seed_a: int,
               seed_b: int) -> tuple[int, int]:
        if int(mode) == 0:
            return int(seed_a), int(seed_b)
        return self.host.canary_seeds(int(pool_id), block & 0xFFFFFFFF, epoch & 0xFFFFFFFFFFFFFFFF)  # type: ignore[no-any-return]

    def _blocks(self, ids: Any, epochs: Any, nblocks: int) -> list[tuple[int, int, int]]:
        """(launch index b, row, epoch) per block, ids and epochs read as the kernel reads them."""
        n = int(nblocks)
        id_values, epoch_values = _array(ids, ctypes.c_int64, n), _array(epochs, ctypes.c_int64, n)
        return [(b, int(id_values[b]) if id_values is not None else b,
                 int(epoch_values[b]) if epoch_values is not None else 0) for b in range(n)]

    def kv_pattern_fill(self, base: torch.Tensor, row_stride: Any, nbytes: Any, ids: Any, epochs: Any,
                        nblocks: Any, mode: Any, pool_id: Any, seed_a: Any, seed_b: Any, vec: Any) -> None:
        for _, row, epoch in self._blocks(ids, epochs, nblocks):
            seeds = self._seeds(mode, pool_id, row, epoch, seed_a, seed_b)
            self.host.pattern_fill(_row(base, row * int(row_stride), int(nbytes)), *seeds)

    def kv_pattern_verify(self, base: torch.Tensor, row_stride: Any, nbytes: Any, ids: Any, epochs: Any,
                          nblocks: Any, mode: Any, pool_id: Any, seed_a: Any, seed_b: Any, vec: Any,
                          first_bad: torch.Tensor) -> None:
        first = _array(first_bad, ctypes.c_uint64, int(nblocks))
        for b, row, epoch in self._blocks(ids, epochs, nblocks):
            seeds = self._seeds(mode, pool_id, row, epoch, seed_a, seed_b)
            bad = self.host.pattern_first_bad(_row(base, row * int(row_stride), int(nbytes)), *seeds)
            if bad >= 0:
                first[b] = min(int(first[b]), bad)

    def kv_checksum_lanes(self, base: torch.Tensor, row_stride: Any, nbytes: Any, ids: Any, nblocks: Any,
                          vec: Any, lanes: torch.Tensor) -> None:
        out = _array(lanes, ctypes.c_uint32, 2 * int(nblocks))
        one = np.zeros(1, dtype=np.uint64)
        for b, row, _ in self._blocks(ids, 0, nblocks):
            self.host.checksums(_row(base, row * int(row_stride), int(nbytes)), 1, int(nbytes), one)
            out[2 * b], out[2 * b + 1] = int(one[0]) & 0xFFFFFFFF, int(one[0]) >> 32

    def kv_checksum_finish(self, lanes: torch.Tensor, nblocks: Any, nbytes: Any, out: torch.Tensor) -> None:
        n = int(nblocks)
        halves, result = _array(lanes, ctypes.c_uint32, 2 * n), _array(out, ctypes.c_uint64, n)
        for b in range(n):
            result[b] = int(halves[2 * b]) | int(halves[2 * b + 1]) << 32
