"""CPU reference (torch, vectorised) for block checksums, test patterns and retirement canaries.

Owns: the bit-exact semantics that kv_math.cuh / kv_kernels.cu implement on the GPU. Everything here
is integer arithmetic on 32-bit words held in int64 tensors, so no product or shift can overflow.

Words: byte k of a block is byte (k % 4) of little-endian 32-bit word k // 4; a last partial word
is zero-padded. ``mix32`` is a bijective xorshift-multiply mixer on 32 bits.

  * Checksum of a block of ``nbytes`` bytes with words ``w_j``, ``t_j = j * 0x61C88647 mod 2**32``:
        lane_a = sum_j mix32(w_j ^ t_j)             mod 2**32
        lane_b = sum_j mix32(w_j + rotl16(t_j))     mod 2**32
        lo = mix32(lane_a ^ mix32(nbytes_lo + 0x68E31DA4)),  hi = mix32(lane_b ^ mix32(nbytes_hi ^ lo))
        checksum = hi << 32 | lo   (64 bits; an int64 tensor holds the same bits)
    The lanes are sums, so a GPU adds them in any order over many blocks in one launch.
  * Pattern word j with seeds (a, b): ``mix32((mix32(j ^ a) + b) mod 2**32)``. ``fill_pattern``
    takes (a, b) from a blake2b digest of (request, writer, block); a canary takes them from
    ``canary_seeds(pool, block, epoch)``, all mix32 steps, so a GPU derives them itself.

Rules:
  1. No Python loop runs per element of a block: loops run per MiB chunk (or per row batch) only;
     block ids and epochs are checked one Python int each (rule 4).
  2. Results depend only on the bytes and the arguments, never on the device or the chunking.
  3. Malformed arguments raise ``KernelInputError`` (a ``ValueError``) naming the argument.
  4. Block ids and epochs are checked on the host, as Python ints, before they become device
     tensors: no check reads a GPU tensor (a ``.min()`` there waits for all queued GPU work, usually
     the model's). They arrive as ints or a CPU int64 tensor; a device tensor is refused. What the
     kernels get is a fresh contiguous int64 tensor (a kernel reads ids as a flat array), copied from
     pinned memory without a sync.

Invariants:
  1. Changing any one 32-bit word of a block (one byte or up to four adjacent aligned bytes) always
     changes its checksum: lane_a changes by a non-zero amount and ``lo`` is a bijection of lane_a.
  2. ``verify_pattern(t, r, w, b)`` is True right after ``fill_pattern(t, r, w, b)`` and, with
     overwhelming likelihood, False for any other (r, w, b) or a shifted copy; the same holds for
     canaries and (pool, block, epoch).
  3. A pattern does not repeat within a block: word j -> pattern word is a bijection for j < 2**32.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Sequence

import torch

from kvown.kernels.errors import KernelInputError

M32 = 0xFFFFFFFF
WORD_STEP = 0x61C88647
_CHUNK_BYTES = 1 << 20  # bytes of temporaries' worth per step: bounds int64 temporaries to ~8 MiB
MAX_BLOCK_NBYTES = 4 << 30  # word indices are 32-bit; 4 GiB keeps 16 * quads inside too

if sys.byteorder != "little":  # pragma: no cover - every platform kvown runs on is little-endian
    raise ImportError("kvown.kernels.blocks assumes a little-endian host (uint8 <-> int32 views)")


def _mix32_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """kv_mix32 in place on an int64 tensor of values in [0, 2**32); ``scratch`` has x's shape.

    In place because fresh multi-MiB temporaries cost page faults on every chunk.
    """
    torch.bitwise_right_shift(x, 16, out=scratch)
    x.bitwise_xor_(scratch).mul_(0x21F0AAAD).bitwise_and_(M32)
    torch.bitwise_right_shift(x, 15, out=scratch)
    x.bitwise_xor_(scratch).mul_(0x735A2D97).bitwise_and_(M32)
    torch.bitwise_right_shift(x, 15, out=scratch)
    return x.bitwise_xor_(scratch)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """kv_mix32 on int64 tensors holding values in [0, 2**32); returns a new tensor."""
    return _mix32_(x.clone(), torch.empty_like(x))


def _rotl16(t: torch.Tensor) -> torch.Tensor:
    return ((t << 16) & M32) | (t >> 16)


def _as_int64_bits(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """hi << 32 | lo as int64 two's-complement bits, without overflowing int64."""
    signed_hi = hi - (hi >= (1 << 31)).to(torch.int64) * (1 << 32)
    return signed_hi * (1 << 32) + lo


def to_uint64(value: int) -> int:
    """A checksum from an int64 tensor element, as the unsigned 64-bit integer it holds."""
    return value & 0xFFFFFFFFFFFFFFFF


def _words(chunk: torch.Tensor) -> torch.Tensor:
    """uint8 (N, C) -> int64 (N, ceil(C / 4)) little-endian words, zero-padded."""
    pad = -chunk.shape[1] % 4
    if pad:
        chunk = torch.nn.functional.pad(chunk, (0, pad))
    chunk = chunk.contiguous()
    if chunk.storage_offset() % 4:
        chunk = chunk.clone()
    return chunk.view(torch.int32).to(torch.int64) & M32


def _word_bytes(words: torch.Tensor) -> torch.Tensor:
    """int64 (N, W) words in [0, 2**32) -> uint8 (N, 4W) little-endian bytes.

    int64 -> int32 keeps the low 32 bits (two's complement wrap, as C++20 defines the cast and every
    compiler torch is built with does); tests compare the bytes with the host build of kv_math.cuh.
    """
    return words.to(torch.int32).view(torch.uint8)


def _check_blocks(blocks: torch.Tensor, field: str = "blocks") -> None:
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise KernelInputError(
            "expected a 2-D uint8 tensor (num_blocks, block_nbytes)",
            field=field,
            dtype=str(getattr(blocks, "dtype", type(blocks).__name__)),
            shape=tuple(getattr(blocks, "shape", ())),
        )
    if blocks.shape[1] and blocks.stride(1) != 1:
        raise KernelInputError(
            "each block (row) must be contiguous", field=field, stride=tuple(blocks.stride())
        )
    if blocks.shape[1] > MAX_BLOCK_NBYTES:
        raise KernelInputError(
            "blocks larger than 4 GiB are not supported", field=field, nbytes=blocks.shape[1]
        )


def _host_ints(values: Sequence[int] | torch.Tensor, field: str) -> list[int]:
    """Rule 4: ``values`` as Python ints, read on the host (a CPU tensor's, or the sequence's)."""
    if isinstance(values, torch.Tensor):
        if values.dtype != torch.int64 or values.dim() != 1 or values.device.type != "cpu":
            raise KernelInputError(
                "expected a 1-D int64 CPU tensor (checked on the host: a device tensor would need a sync)",
                field=field, dtype=str(values.dtype), device=str(values.device),
            )
        return values.tolist()  # type: ignore[no-any-return]
    out = list(values)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in out):
        raise KernelInputError("expected ints", field=field)
    return out


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """Rule 4: checked ints as a contiguous int64 tensor on ``device``; to a GPU from pinned memory,
    asynchronously on the current stream (the caching host allocator keeps the buffer until then)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _check_ids(
    block_ids: Sequence[int] | torch.Tensor | None,
    num_rows: int,
    device: torch.device,
    field: str = "block_ids",
) -> torch.Tensor:
    """``block_ids`` (default: every row) checked on the host (rule 4), contiguous on ``device``."""
    if block_ids is None:
        return torch.arange(num_rows, dtype=torch.int64, device=device)
    values = _host_ints(block_ids, field)
    bad = next((v for v in values if not 0 <= v < num_rows), None)
    if bad is not None:
        raise KernelInputError("block id out of range", field=field, block=bad, num_blocks=num_rows)
    return _to_device(values, device)


def _check_uint(value: object, bits: int, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < (1 << bits):
        raise KernelInputError(f"must be an int in [0, 2**{bits})", field=field, value=value)
    return value


# ---- checksums ---------------------------------------------------------------------------------


def checksums(blocks: torch.Tensor, block_ids: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
    """64-bit checksums of rows ``block_ids`` (default: all) of ``blocks``, as an int64 tensor.

    ``blocks`` is a pool seen as (num_blocks, block_nbytes) uint8, e.g. ``pool.tensor.view(n, -1)``.
    Called: by verifiers after a transfer; O(bytes). After error: ``KernelInputError``, nothing read.
    """
    _check_blocks(blocks)
    ids = _check_ids(block_ids, blocks.shape[0], blocks.device)
    num, nbytes = ids.numel(), blocks.shape[1]
    lane_a = torch.zeros(num, dtype=torch.int64, device=blocks.device)
    lane_b = torch.zeros_like(lane_a)
    step = max(16, (_CHUNK_BYTES // max(num, 1)) // 16 * 16)
    for start in range(0, nbytes, step):
        chunk = (
            blocks[ids, start : start + step] if block_ids is not None else blocks[:, start : start + step]
        )
        words = _words(chunk)
        index = torch.arange(start // 4, start // 4 + words.shape[1], dtype=torch.int64, device=blocks.device)
        t = (index * WORD_STEP) & M32
        scratch = torch.empty_like(words)
        term = torch.bitwise_xor(words, t)
        lane_a = (lane_a + _mix32_(term, scratch).sum(dim=1)) & M32
        torch.add(words, _rotl16(t), out=term).bitwise_and_(M32)
        lane_b = (lane_b + _mix32_(term, scratch).sum(dim=1)) & M32
    length_lo = torch.tensor((nbytes & M32) + 0x68E31DA4, dtype=torch.int64, device=blocks.device) & M32
    lo = mix32(lane_a ^ mix32(length_lo))
    hi = mix32(lane_b ^ mix32(lo ^ (nbytes >> 32)))
    return _as_int64_bits(hi, lo)


def checksum(tensor: torch.Tensor) -> int:
    """The 64-bit checksum of ``tensor``'s bytes (any dtype, any device, made contiguous), as an int.

    Not cryptographic: it catches corruption and misplaced bytes, not forgery.
    """
    data = tensor.contiguous().view(torch.uint8).reshape(1, -1)
    return to_uint64(int(checksums(data)[0]))


# ---- patterns ----------------------------------------------------------------------------------


def pattern_words(
    seed_a: torch.Tensor | int, seed_b: torch.Tensor | int, index: torch.Tensor
) -> torch.Tensor:
    """kv_pattern_word for word indices ``index`` (int64), seeds broadcast against it."""
    words = torch.bitwise_xor(index, seed_a)
    scratch = torch.empty_like(words)
    _mix32_(words, scratch).add_(seed_b).bitwise_and_(M32)
    return _mix32_(words, scratch)


def pattern_seeds(request_id: int | str, writer: int, block: int) -> tuple[int, int]:
    """(seed_a, seed_b) of ``fill_pattern``'s pattern for (request, writer, block)."""
    digest = hashlib.blake2b(f"{request_id!r}/{writer}/{block}".encode(), digest_size=8).digest()
    word = int.from_bytes(digest, "little")
    return word & M32, word >> 32


def _pattern_chunk(start: int, count: int, seeds: tuple[int, int], device: torch.device) -> torch.Tensor:
    first = start // 4  # start is a multiple of 4 (chunks are)
    index = torch.arange(first, first + (count + 3) // 4, dtype=torch.int64, device=device)
    return _word_bytes(pattern_words(seeds[0], seeds[1], index).unsqueeze(0))[0, :count]


def _check_pattern_target(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or not tensor.is_contiguous():
        raise KernelInputError(
            "pattern target must be a contiguous uint8 tensor",
            field="tensor",
            dtype=str(getattr(tensor, "dtype", type(tensor).__name__)),
        )
    if tensor.numel() > MAX_BLOCK_NBYTES:
        raise KernelInputError("pattern targets larger than 4 GiB are not supported", field="tensor")
    return tensor.view(-1)


def fill_seeded(tensor: torch.Tensor, seeds: tuple[int, int]) -> torch.Tensor:
    """Fill a contiguous uint8 ``tensor`` in place with the pattern of ``seeds``. Returns ``tensor``."""
    flat = _check_pattern_target(tensor)
    for start in range(0, flat.numel(), _CHUNK_BYTES):
        count = min(_CHUNK_BYTES, flat.numel() - start)
        flat[start : start + count] = _pattern_chunk(start, count, seeds, flat.device)
    return tensor


def first_seeded_mismatch(tensor: torch.Tensor, seeds: tuple[int, int]) -> int:
    """Offset of the first byte of ``tensor`` that differs from the pattern of ``seeds``, or -1."""
    flat = _check_pattern_target(tensor)
    for start in range(0, flat.numel(), _CHUNK_BYTES):
        count = min(_CHUNK_BYTES, flat.numel() - start)
        bad = flat[start : start + count] != _pattern_chunk(start, count, seeds, flat.device)
        if bool(bad.any()):
            return start + int(torch.nonzero(bad)[0, 0])
    return -1


def fill_pattern(tensor: torch.Tensor, request_id: int | str, writer: int, block: int) -> torch.Tensor:
    """Fill a contiguous uint8 ``tensor`` in place with the pattern of (request, writer, block).

    Each byte depends on its offset and on all three ids, so a block written to the wrong slot, by
    the wrong writer or shifted fails ``verify_pattern``. Returns ``tensor``.
    """
    return fill_seeded(tensor, pattern_seeds(request_id, writer, block))


def first_pattern_mismatch(tensor: torch.Tensor, request_id: int | str, writer: int, block: int) -> int:
    """Offset of the first byte that is not ``fill_pattern``'s, or -1 when the whole tensor matches."""
    return first_seeded_mismatch(tensor, pattern_seeds(request_id, writer, block))


def verify_pattern(tensor: torch.Tensor, request_id: int | str, writer: int, block: int) -> bool:
    """True if ``tensor`` holds exactly ``fill_pattern``'s bytes for these ids (no scratch copy)."""
    return first_pattern_mismatch(tensor, request_id, writer, block) == -1


# ---- canaries ------------------------------------------------------------------------------------


def canary_seeds(
    pool_id: int, block_ids: torch.Tensor, epochs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_canary_seeds, vectorised: int64 tensors (N,) of seed_a and seed_b."""
    h = mix32(torch.full_like(block_ids, (pool_id ^ 0x6B43A9B5) & M32))
    h = mix32(h ^ (block_ids & M32))
    h = mix32(h ^ (epochs & M32))
    h = mix32(h ^ ((epochs >> 32) & M32))
    return h, mix32(h ^ 0x1B873593)


def _check_epochs(
    epoch: int | Sequence[int] | torch.Tensor, count: int, device: torch.device
) -> torch.Tensor:
    """One retirement epoch for all ``count`` blocks, or one each, checked on the host (rule 4)."""
    if isinstance(epoch, int) and not isinstance(epoch, bool):
        values = [_check_uint(epoch, 63, "epoch")] * count
    else:
        values = [_check_uint(e, 63, "epoch") for e in _host_ints(epoch, "epoch")]
        if len(values) != count:
            raise KernelInputError("one epoch per block", field="epoch", epochs=len(values), blocks=count)
    return _to_device(values, device)


def _canary_args(
    blocks: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    pool_id: int,
    epoch: int | Sequence[int] | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_blocks(blocks)
    _check_uint(pool_id, 32, "pool_id")
    ids = _check_ids(block_ids, blocks.shape[0], blocks.device)
    if blocks.shape[0] > (1 << 32):
        raise KernelInputError("block ids must fit 32 bits", field="blocks")
    return ids, _check_epochs(epoch, ids.numel(), blocks.device)


def _canary_rows(seed_a: torch.Tensor, seed_b: torch.Tensor, start: int, count: int) -> torch.Tensor:
    index = torch.arange(start // 4, start // 4 + (count + 3) // 4, dtype=torch.int64, device=seed_a.device)
    words = pattern_words(seed_a.unsqueeze(1), seed_b.unsqueeze(1), index.unsqueeze(0))
    return _word_bytes(words)[:, :count]


def _row_step(num: int) -> int:
    return max(16, (_CHUNK_BYTES // max(num, 1)) // 16 * 16)


def fill_canary(
    blocks: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    pool_id: int,
    epoch: int | Sequence[int] | torch.Tensor,
) -> None:
    """Fill rows ``block_ids`` of ``blocks`` with the canary of (pool_id, block id, epoch).

    ``epoch`` is one retirement epoch for all blocks, or one per block.
    Called: at retirement, before a block goes back to FREE. After error: nothing written.
    """
    ids, epochs = _canary_args(blocks, block_ids, pool_id, epoch)
    seed_a, seed_b = canary_seeds(pool_id, ids, epochs)
    step = _row_step(ids.numel())
    for start in range(0, blocks.shape[1], step):
        count = min(step, blocks.shape[1] - start)
        blocks[ids, start : start + count] = _canary_rows(seed_a, seed_b, start, count)


def verify_canary(
    blocks: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    pool_id: int,
    epoch: int | Sequence[int] | torch.Tensor,
) -> torch.Tensor:
    """First byte offset in each block that is not its canary, or -1 (int64 tensor, one per id).

    Called: before a retired block is handed out again; a value >= 0 means a late write landed.
    """
    ids, epochs = _canary_args(blocks, block_ids, pool_id, epoch)
    seed_a, seed_b = canary_seeds(pool_id, ids, epochs)
    first = torch.full((ids.numel(),), -1, dtype=torch.int64, device=blocks.device)
    step = _row_step(ids.numel())
    for start in range(0, blocks.shape[1], step):
        count = min(step, blocks.shape[1] - start)
        bad = blocks[ids, start : start + count] != _canary_rows(seed_a, seed_b, start, count)
        found = bad.any(dim=1) & (first < 0)
        if bool(found.any()):
            first = torch.where(found, start + bad.to(torch.int32).argmax(dim=1), first)
    return first
