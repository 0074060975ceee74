"""kvown's kernel API: NVFP4 quantise / dequantise, block checksums, patterns and canaries.

Owns: argument checking and dispatch. A CUDA tensor goes to the CUDA kernel (kv_kernels.cu, launched
through CuPy on torch's current stream, memory shared by DLPack, no copies); a CPU tensor goes to the
torch reference (kernels/nvfp4.py, kernels/blocks.py), which defines the bits both must give -- or, for
NVFP4 quantise / dequantise, to the host build of the kernel's own math (kernels/host, built by
setup.py; tests/kernels/test_host_math.py holds it to the reference bit for bit), which is ~100x faster.

``backend``: ``"auto"`` (default) picks the kernel for CUDA tensors when CuPy is importable, the host
build for CPU tensors when it is built, and the reference otherwise (the reference also runs on CUDA
tensors, slowly); ``"cuda"`` insists on the kernel, ``"host"`` on the host build; ``"torch"`` insists on
the reference (tests and benchmarks compare them).

Rules:
  1. Every argument is checked before anything is written; a malformed one raises
     ``KernelInputError`` (a ``ValueError``) naming it, and nothing has changed.
  2. Outputs may be strided views (pool planes from ``KVPool.plane_view``) as long as their last
     dimension is contiguous; up to 4 leading dimensions after merging the mergeable ones.
  3. Only results that Python must read synchronise the stream: ``checksum`` (one int),
     ``verify_pattern`` / ``first_pattern_mismatch`` (one int) and the non-finite input check of
     ``quantize`` (``check_finite=False`` skips it). Block ids and epochs are checked on the host,
     before they become tensors (``kvown.kernels.blocks`` rule 4): a device tensor of ids is refused.

Called: from any thread that may use the tensors' device; there is no shared state but the
compiled-module cache in kernels/cuda_loader.py, which has its own lock.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvown.kernels import blocks, cuda_loader, nvfp4
from kvown.kernels.errors import KernelInputError
from kvown.kernels.nvfp4 import GROUP_SIZE, NVFP4Tensor

THREADS = 256
_MAX_GRID_Y = 65535
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@functools.cache
def cupy_available() -> bool:
    try:
        cuda_loader.cupy_module()
    except ModuleNotFoundError:
        return False
    return True


@functools.cache
def _host_build() -> Any:
    """The host build of the kernel math (kvown.kernels._kv_host), or None where it is not built."""
    try:
        from kvown.kernels import _kv_host  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _kv_host


def _use_host(tensor: torch.Tensor, backend: str) -> Any:
    """The host build to run a CPU ``tensor`` on, or None for the torch reference."""
    if backend == "host":
        if tensor.is_cuda:
            raise KernelInputError("backend 'host' needs CPU tensors", field="backend", device=str(tensor.device))
        if _host_build() is None:
            raise KernelInputError("backend 'host' needs the host build: run `make setup`", field="backend")
        return _host_build()
    return _host_build() if backend == "auto" and not tensor.is_cuda else None


def _use_cuda(tensor: torch.Tensor, backend: str) -> bool:
    if backend in ("torch", "host"):
        return False
    if backend == "cuda":
        if not tensor.is_cuda:
            raise KernelInputError(
                "backend 'cuda' needs CUDA tensors", field="backend", device=str(tensor.device)
            )
        cuda_loader.cupy_module()  # ModuleNotFoundError with the install hint
        return True
    if backend != "auto":
        raise KernelInputError("backend must be 'auto', 'cuda', 'host' or 'torch'", field="backend", value=backend)
    return tensor.is_cuda and cupy_available()


def _same_device(reference: torch.Tensor, tensor: torch.Tensor, field: str) -> None:
    if tensor.device != reference.device:
        raise KernelInputError(
            "tensors must be on one device",
            field=field,
            device=str(tensor.device),
            expected=str(reference.device),
        )


def _launch(device: torch.device, name: str, grid: tuple[int, ...], args: Any) -> None:
    """Launch ``name`` on torch's current stream of ``device``; ``args`` is a callable building the
    argument tuple inside the stream context, so DLPack exports happen on that same stream."""
    cupy = cuda_loader.cupy_module()
    index = device.index if device.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(index), cuda_loader.stream(index):
        cuda_loader.kernel(name)(grid, (THREADS,), args())


def _dl(tensor: torch.Tensor) -> Any:
    """A CuPy view for a kernel pointer argument; 16-bit floats travel as int16 (CuPy has no bf16)."""
    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.view(torch.int16)
    return cuda_loader.as_cupy(tensor)


def _leading_dims(
    shape: Sequence[int], tensors: Sequence[torch.Tensor], field: str
) -> tuple[list[int], list[list[int]]]:
    """Merge the leading dims of ``tensors`` (same leading shape) into at most 4 (rule 2).

    Returns sizes (4, outermost first) and, per tensor, 4 strides in its own elements.
    """
    dims: list[tuple[int, list[int]]] = []
    for axis, size in enumerate(shape):
        if size == 1:
            continue
        strides = [t.stride(axis) for t in tensors]
        if dims and all(prev == stride * size for prev, stride in zip(dims[-1][1], strides, strict=True)):
            dims[-1] = (dims[-1][0] * size, strides)
        else:
            dims.append((size, strides))
    if len(dims) > 4:
        raise KernelInputError(
            "too many leading dimensions that cannot be merged (at most 4)", field=field, shape=tuple(shape)
        )
    while len(dims) < 4:
        dims.insert(0, (1, [0] * len(tensors)))
    return [d[0] for d in dims], [[d[1][k] for d in dims] for k in range(len(tensors))]


def _check_plane(tensor: object, shape: tuple[int, ...], field: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8:
        raise KernelInputError(
            "expected a uint8 tensor", field=field, dtype=str(getattr(tensor, "dtype", None))
        )
    if tuple(tensor.shape) != shape:
        raise KernelInputError("wrong shape", field=field, shape=tuple(tensor.shape), expected=shape)
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise KernelInputError(
            "the last dimension must be contiguous", field=field, stride=tuple(tensor.stride())
        )
    return tensor


# ---- NVFP4 -----------------------------------------------------------------------------------------


def quantize(
    x: torch.Tensor,
    global_scale: float | None = None,
    *,
    rope_dim: int = 0,
    rope_global_scale: float | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    check_finite: bool = True,
    backend: str = "auto",
) -> NVFP4Tensor:
    """NVFP4-quantise ``x`` (float32 / bfloat16 / float16, rows a multiple of 16) along its last dim.

    ``out=(values, scales)`` writes into given uint8 tensors (e.g. pool plane views) of shapes
    (..., n // 2) and (..., n // 16). Global scales as in ``kvown.kernels.nvfp4.quantize`` (a missing one
    costs an amax pass and a sync). Called: per KV write, on the producer's thread and stream.
    Ownership: the caller owns ``out``; nothing is kept. After error: ``KernelInputError``, nothing
    written (rule 1) -- except a non-finite value found by the kernel, which is reported after the
    launch, with ``out`` already overwritten.
    """
    nvfp4.check_input(x)
    n = x.shape[-1]
    nvfp4.check_rope_dim(rope_dim, n)
    lead = tuple(x.shape[:-1])
    if out is not None:
        if not isinstance(out, tuple) or len(out) != 2:
            raise KernelInputError("out must be a (values, scales) tuple", field="out")
        values = _check_plane(out[0], (*lead, n // 2), "out_values")
        scales = _check_plane(out[1], (*lead, n // GROUP_SIZE), "out_scales")
        _same_device(x, values, "out_values")
        _same_device(x, scales, "out_scales")
    if not _use_cuda(x, backend):
        host = _use_host(x, backend)
        if host is None:
            q = nvfp4.quantize(x, global_scale, rope_dim=rope_dim, rope_global_scale=rope_global_scale)
        else:
            q = _host_quantize(host, x, global_scale, rope_dim, rope_global_scale)
        if out is None:
            return q
        values.copy_(q.values)
        scales.copy_(q.scales)
        return NVFP4Tensor(values, scales, q.global_scale, q.rope_dim, q.rope_global_scale)
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise KernelInputError("the last dimension must be contiguous", field="x", stride=tuple(x.stride()))
    gs, rope_gs = nvfp4.resolve_scales(x, global_scale, rope_dim, rope_global_scale)
    if out is None:
        values = torch.empty((*lead, n // 2), dtype=torch.uint8, device=x.device)
        scales = torch.empty((*lead, n // GROUP_SIZE), dtype=torch.uint8, device=x.device)
    groups = n // GROUP_SIZE
    sizes, (xs, vs, ss) = _leading_dims(lead, (x, values, scales), "x")
    rows = sizes[0] * sizes[1] * sizes[2] * sizes[3]
    bad = torch.zeros(1, dtype=torch.int32, device=x.device)
    if rows:
        _launch(
            x.device,
            "kv_nvfp4_quantize",
            ((rows * groups + THREADS - 1) // THREADS,),
            lambda: (
                _dl(x),
                np.int32(_DTYPE_CODES[x.dtype]),
                _dl(values),
                _dl(scales),
                np.int64(rows),
                np.int32(groups),
                np.int32(groups - rope_dim // GROUP_SIZE),
                np.float32(gs),
                np.float32(rope_gs or gs),
                *(np.int64(s) for s in sizes[1:]),
                *(np.int64(s) for s in (*xs, *vs, *ss)),
                _dl(bad),
            ),
        )
    if check_finite and int(bad.item()):
        raise KernelInputError("cannot quantise non-finite values", field="x")
    return NVFP4Tensor(values, scales, gs, rope_dim, rope_gs)


def dequantize(q: NVFP4Tensor, *, out: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """float32 values of ``q`` (shape (..., n)), into ``out`` when given (float32, last dim contiguous).

    Called: by verifiers and consumers of landed NVFP4 blocks. After error: ``KernelInputError``.
    """
    nvfp4.check_nvfp4(q)
    _same_device(q.values, q.scales, "scales")
    n = q.n
    lead = tuple(q.values.shape[:-1])
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or tuple(out.shape) != (*lead, n):
            raise KernelInputError(
                "out must be a float32 tensor of shape (..., n)",
                field="out",
                dtype=str(getattr(out, "dtype", None)),
                shape=tuple(getattr(out, "shape", ())),
            )
        if out.stride(-1) != 1:
            raise KernelInputError("the last dimension must be contiguous", field="out")
        _same_device(q.values, out, "out")
    for name, part in (("values", q.values), ("scales", q.scales)):
        if part.shape[-1] > 1 and part.stride(-1) != 1:
            raise KernelInputError(
                "the last dimension must be contiguous", field=name, stride=tuple(part.stride())
            )
    if not _use_cuda(q.values, backend):
        host = _use_host(q.values, backend)
        result = nvfp4.dequantize(q) if host is None else _host_dequantize(host, q)
        return result if out is None else out.copy_(result)
    if out is None:
        out = torch.empty((*lead, n), dtype=torch.float32, device=q.values.device)
    groups = n // GROUP_SIZE
    gs, rope_gs = q.group_scales()
    sizes, (vs, ss, os_) = _leading_dims(lead, (q.values, q.scales, out), "values")
    rows = sizes[0] * sizes[1] * sizes[2] * sizes[3]
    values, scales = q.values, q.scales
    if rows:
        _launch(
            out.device,
            "kv_nvfp4_dequantize",
            ((rows * groups + THREADS - 1) // THREADS,),
            lambda: (
                _dl(values),
                _dl(scales),
                _dl(out),
                np.int64(rows),
                np.int32(groups),
                np.int32(groups - q.rope_dim // GROUP_SIZE),
                np.float32(gs),
                np.float32(rope_gs),
                *(np.int64(s) for s in sizes[1:]),
                *(np.int64(s) for s in (*vs, *ss, *os_)),
            ),
        )
    return out


def _host_quantize(
    host: Any, x: torch.Tensor, global_scale: float | None, rope_dim: int, rope_global_scale: float | None
) -> NVFP4Tensor:
    """The host build's quantisation into fresh tensors (so a non-finite value changes no ``out``)."""
    gs, rope_gs = nvfp4.resolve_scales(x, global_scale, rope_dim, rope_global_scale)
    n = x.shape[-1]
    rows = x.numel() // n
    values = torch.empty((*x.shape[:-1], n // 2), dtype=torch.uint8)
    scales = torch.empty((*x.shape[:-1], n // GROUP_SIZE), dtype=torch.uint8)
    code = _DTYPE_CODES[x.dtype]
    data = x.contiguous()
    data = data.view(torch.int16) if code else data
    bad = host.quantize(data.numpy(), code, rows, n, gs, rope_gs or gs, (n - rope_dim) // GROUP_SIZE,
                        values.numpy(), scales.numpy())
    if bad:
        raise KernelInputError("cannot quantise non-finite values", field="x")
    return NVFP4Tensor(values, scales, gs, rope_dim, rope_gs)


def _host_dequantize(host: Any, q: NVFP4Tensor) -> torch.Tensor:
    n = q.n
    rows = q.values.numel() // q.values.shape[-1]
    out = torch.empty((*q.values.shape[:-1], n), dtype=torch.float32)
    gs, rope_gs = q.group_scales()
    host.dequantize(q.values.contiguous().numpy(), q.scales.contiguous().numpy(), rows, n, gs, rope_gs,
                    (n - q.rope_dim) // GROUP_SIZE, out.numpy())
    return out


# ---- checksums ---------------------------------------------------------------------------------------


def _block_grid(nbytes: int, num_blocks: int, bytes_per_thread: int) -> tuple[int, int]:
    ctas = max(1, min(4096, -(-nbytes // (THREADS * bytes_per_thread))))
    return ctas, max(1, min(num_blocks, _MAX_GRID_Y))


def _vec_ok(tensor: torch.Tensor, row_stride: int) -> int:
    return int(tensor.data_ptr() % 16 == 0 and row_stride % 16 == 0)


def checksums(
    pool_blocks: torch.Tensor, block_ids: Sequence[int] | torch.Tensor | None = None, *, backend: str = "auto"
) -> torch.Tensor:
    """64-bit checksums (int64 tensor on the blocks' device) of rows ``block_ids`` (default all) of
    ``pool_blocks``, a (num_blocks, block_nbytes) uint8 view of a pool. One launch for all blocks.

    Called: by verifiers after transfers. After error: ``KernelInputError``, nothing read.
    """
    blocks._check_blocks(pool_blocks)
    if not _use_cuda(pool_blocks, backend):
        return blocks.checksums(pool_blocks, block_ids)
    ids = (
        blocks._check_ids(block_ids, pool_blocks.shape[0], pool_blocks.device)
        if block_ids is not None
        else None
    )
    num = ids.numel() if ids is not None else pool_blocks.shape[0]
    nbytes, row_stride = pool_blocks.shape[1], pool_blocks.stride(0)
    lanes = torch.zeros(2 * num, dtype=torch.int32, device=pool_blocks.device)
    result = torch.empty(num, dtype=torch.int64, device=pool_blocks.device)
    if num:
        vec = _vec_ok(pool_blocks, row_stride) and nbytes % 16 == 0
        _launch(
            pool_blocks.device,
            "kv_checksum_lanes",
            _block_grid(nbytes, num, 64),
            lambda: (
                _dl(pool_blocks),
                np.int64(row_stride),
                np.uint64(nbytes),
                _dl(ids) if ids is not None else np.uint64(0),
                np.int64(num),
                np.int32(vec),
                _dl(lanes),
            ),
        )
        _launch(
            pool_blocks.device,
            "kv_checksum_finish",
            ((num + THREADS - 1) // THREADS,),
            lambda: (_dl(lanes), np.int64(num), np.uint64(nbytes), _dl(result)),
        )
    return result


def checksum(tensor: torch.Tensor, *, backend: str = "auto") -> int:
    """The 64-bit checksum of ``tensor``'s bytes as an unsigned int (syncs on CUDA)."""
    data = tensor.contiguous().view(torch.uint8).reshape(1, -1)
    return blocks.to_uint64(int(checksums(data, backend=backend)[0]))


# ---- patterns and canaries -------------------------------------------------------------------------


def _pattern_launch(
    name: str, target: torch.Tensor, seeds: tuple[int, int], extra: tuple[Any, ...] = ()
) -> None:
    flat = target.view(-1)
    _launch(
        flat.device,
        name,
        _block_grid(flat.numel(), 1, 64),
        lambda: (
            _dl(flat),
            np.int64(0),
            np.uint64(flat.numel()),
            np.uint64(0),
            np.uint64(0),
            np.int64(1),
            np.int32(0),
            np.uint32(0),
            np.uint32(seeds[0]),
            np.uint32(seeds[1]),
            np.int32(_vec_ok(flat, 0)),
            *(_dl(e) for e in extra),
        ),
    )


def fill_pattern(
    tensor: torch.Tensor, request_id: int | str, writer: int, block: int, *, backend: str = "auto"
) -> torch.Tensor:
    """``kvown.kernels.blocks.fill_pattern`` on the tensor's device. Returns ``tensor``."""
    blocks._check_pattern_target(tensor)
    if not _use_cuda(tensor, backend):
        return blocks.fill_pattern(tensor, request_id, writer, block)
    if tensor.numel():
        _pattern_launch("kv_pattern_fill", tensor, blocks.pattern_seeds(request_id, writer, block))
    return tensor


def first_pattern_mismatch(
    tensor: torch.Tensor, request_id: int | str, writer: int, block: int, *, backend: str = "auto"
) -> int:
    """Offset of the first byte that is not ``fill_pattern``'s, or -1 (syncs on CUDA)."""
    blocks._check_pattern_target(tensor)
    if not _use_cuda(tensor, backend):
        return blocks.first_pattern_mismatch(tensor, request_id, writer, block)
    first = torch.full((1,), -1, dtype=torch.int64, device=tensor.device)
    if tensor.numel():
        _pattern_launch(
            "kv_pattern_verify", tensor, blocks.pattern_seeds(request_id, writer, block), (first,)
        )
    return int(first.item())


def verify_pattern(
    tensor: torch.Tensor, request_id: int | str, writer: int, block: int, *, backend: str = "auto"
) -> bool:
    return first_pattern_mismatch(tensor, request_id, writer, block, backend=backend) == -1


def _canary_launch(
    name: str,
    pool_blocks: torch.Tensor,
    ids: torch.Tensor,
    epochs: torch.Tensor,
    pool_id: int,
    extra: tuple[torch.Tensor, ...] = (),
) -> None:
    nbytes, row_stride = pool_blocks.shape[1], pool_blocks.stride(0)
    _launch(
        pool_blocks.device,
        name,
        _block_grid(nbytes, ids.numel(), 64),
        lambda: (
            _dl(pool_blocks),
            np.int64(row_stride),
            np.uint64(nbytes),
            _dl(ids),
            _dl(epochs),
            np.int64(ids.numel()),
            np.int32(1),
            np.uint32(pool_id),
            np.uint32(0),
            np.uint32(0),
            np.int32(_vec_ok(pool_blocks, row_stride)),
            *(_dl(e) for e in extra),
        ),
    )


def fill_canary(
    pool_blocks: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    pool_id: int,
    epoch: int | Sequence[int] | torch.Tensor,
    *,
    backend: str = "auto",
) -> None:
    """Fill rows ``block_ids`` of ``pool_blocks`` with the canary of (pool_id, block, epoch), one launch.

    Called: at retirement (the lead's engine), on the pool's device. After error: nothing written.
    """
    blocks._check_blocks(pool_blocks)
    if not _use_cuda(pool_blocks, backend):
        blocks.fill_canary(pool_blocks, block_ids, pool_id, epoch)
        return
    ids, epochs = blocks._canary_args(pool_blocks, block_ids, pool_id, epoch)
    if ids.numel() and pool_blocks.shape[1]:
        _canary_launch("kv_pattern_fill", pool_blocks, ids, epochs, pool_id)


def verify_canary(
    pool_blocks: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    pool_id: int,
    epoch: int | Sequence[int] | torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """First byte offset per block that is not its canary, or -1 (int64 tensor on the pool's device).

    Called: before a retired block is handed out again. No sync: the caller reads the result.
    """
    blocks._check_blocks(pool_blocks)
    if not _use_cuda(pool_blocks, backend):
        return blocks.verify_canary(pool_blocks, block_ids, pool_id, epoch)
    ids, epochs = blocks._canary_args(pool_blocks, block_ids, pool_id, epoch)
    first = torch.full((ids.numel(),), -1, dtype=torch.int64, device=pool_blocks.device)
    if ids.numel() and pool_blocks.shape[1]:
        _canary_launch("kv_pattern_verify", pool_blocks, ids, epochs, pool_id, (first,))
    return first
