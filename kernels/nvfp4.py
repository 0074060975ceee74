"""CPU reference (torch, vectorised) for NVFP4 KV quantisation, block checksums and test patterns.

Owns: the reference semantics that the CUDA kernels in this folder must match bit for bit.

NVFP4, as used here:
  * Values are E2M1 (1 sign, 2 exponent, 1 mantissa bit): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
    Code = sign << 3 | index into that list. Two codes per byte: element 2i in the LOW nibble,
    element 2i+1 in the HIGH nibble.
  * Every 16 consecutive values along the last dimension share one scale, stored as FP8 E4M3
    (``float8_e4m3fn``) bits in a uint8 tensor, so it fits a pool plane byte for byte.
  * A per-tensor float32 ``global_scale`` keeps the block scales inside E4M3's range (max 448):
    ``value = e2m1 * scale_fp8 * global_scale``. For a KV cache it is a per-layer constant fixed by
    calibration and travels out of band (model config), not in the KV blocks.
  * Rounding: to nearest, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
    3.5 -> 4, 5 -> 4); magnitudes above 6 saturate to 6.

Rules:
  1. No Python loop runs per element: everything is torch tensor ops (loops run per MiB chunk only).
  2. Results depend only on the bytes and the arguments, never on the device or the chunking.

Invariants:
  1. ``dequantize(quantize(x))`` is exact when every group of 16 is an E2M1 value times one
     power-of-two scale (and the global scale is 1).
  2. ``checksum`` changes when any byte changes, or when bytes move (it weights bytes by position).
  3. ``verify_pattern(t, r, w, b)`` is True right after ``fill_pattern(t, r, w, b)`` and, with
     overwhelming likelihood, False for any other (r, w, b) or a shifted copy.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from kvown.core.errors import LocalProtocolError

GROUP_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between consecutive magnitudes

_CHUNK_BYTES = 1 << 20  # chunk for checksum/patterns: bounds int64 temporaries to 8 MiB
_CHECKSUM_PRIME = (1 << 61) - 1
_CHECKSUM_MIX = 1_000_003


@dataclasses.dataclass(frozen=True)
class NVFP4Tensor:
    values: torch.Tensor  # uint8, shape (..., n // 2): two E2M1 codes per byte
    scales: torch.Tensor  # uint8 bits of float8_e4m3fn, shape (..., n // 16)
    global_scale: float


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to E2M1 codes (uint8 in 0..15), ties to even, saturating at 6."""
    magnitude = x.abs().clamp(max=E2M1_MAX)
    midpoints = torch.tensor(_MIDPOINTS, dtype=magnitude.dtype, device=x.device)
    index = torch.bucketize(magnitude, midpoints)  # on a midpoint k this picks the lower code k
    on_midpoint = magnitude == midpoints[index.clamp(max=len(_MIDPOINTS) - 1)]
    index = index + (on_midpoint & (index % 2 == 1)).to(index.dtype)  # ...so odd k rounds up to even
    negative = (x < 0) & (index > 0)  # no negative zero: 0 is always code 0
    return (index | (negative.to(index.dtype) << 3)).to(torch.uint8)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    magnitude = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def quantize(x: torch.Tensor, global_scale: float | None = None) -> NVFP4Tensor:
    """NVFP4-quantise ``x`` along its last dimension (a multiple of 16).

    ``global_scale`` defaults to ``amax(|x|) / (6 * 448)`` so every block scale fits E4M3.
    After error: ``LocalProtocolError`` for a bad shape or non-finite input.
    """
    if x.dim() == 0 or x.shape[-1] % GROUP_SIZE:
        raise LocalProtocolError("last dimension must be a multiple of 16", field="x", shape=tuple(x.shape))
    values = x.float()
    if not bool(torch.isfinite(values).all()):
        raise LocalProtocolError("cannot quantise non-finite values", field="x")
    if global_scale is None:
        amax = float(values.abs().max()) if values.numel() else 0.0
        global_scale = amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else 1.0
    groups = values.reshape(*values.shape[:-1], values.shape[-1] // GROUP_SIZE, GROUP_SIZE)
    wanted_scale = groups.abs().amax(dim=-1) / E2M1_MAX / global_scale
    scales_fp8 = wanted_scale.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    scale = scales_fp8.float().unsqueeze(-1) * global_scale
    scaled = torch.where(scale > 0, groups / torch.where(scale > 0, scale, 1.0), 0.0)
    codes = encode_e2m1(scaled).reshape(values.shape)
    return NVFP4Tensor(pack_nibbles(codes), scales_fp8.view(torch.uint8), float(global_scale))


def dequantize(q: NVFP4Tensor) -> torch.Tensor:
    """float32 values of ``q`` (shape (..., n))."""
    codes = unpack_nibbles(q.values)
    groups = decode_e2m1(codes).reshape(*codes.shape[:-1], codes.shape[-1] // GROUP_SIZE, GROUP_SIZE)
    scale = q.scales.view(torch.float8_e4m3fn).float().unsqueeze(-1) * q.global_scale
    return (groups * scale).reshape(codes.shape)


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8).reshape(-1)


def _position_weights(count: int, device: torch.device) -> torch.Tensor:
    index = torch.arange(1, count + 1, dtype=torch.int64, device=device)
    return (((index * 0x9E3779B1) & 0xFFFFFFFF) >> 1) | 1  # odd, < 2**31: byte * weight < 2**39


def checksum(tensor: torch.Tensor) -> int:
    """A cheap content fingerprint of ``tensor``'s bytes (any dtype, any device), as a Python int.

    A position-weighted sum per MiB chunk (fits int64 exactly), chained over chunks modulo 2**61 - 1,
    with the length mixed in. Not cryptographic: it catches corruption and misplaced bytes, not forgery.
    Called: by verifiers after a transfer; O(nbytes), about a few ms per MiB on CPU.
    """
    data = _flat_bytes(tensor)
    total = 0
    for start in range(0, data.numel(), _CHUNK_BYTES):
        chunk = data[start : start + _CHUNK_BYTES].to(torch.int64)
        chunk_sum = int((chunk * _position_weights(chunk.numel(), chunk.device)).sum())
        total = (total * _CHECKSUM_MIX + chunk_sum + 1) % _CHECKSUM_PRIME
    return (total * _CHECKSUM_MIX + data.numel()) % _CHECKSUM_PRIME


def _pattern_seed(request_id: int | str, writer: int, block: int) -> tuple[int, int]:
    digest = hashlib.blake2b(f"{request_id!r}/{writer}/{block}".encode(), digest_size=8).digest()
    word = int.from_bytes(digest, "little")
    return (word & 0x3FFFFFFF) | 1, (word >> 32) & 0x7FFFFFFF  # odd multiplier < 2**30, offset


def _pattern_chunk(start: int, count: int, seeds: tuple[int, int], device: torch.device) -> torch.Tensor:
    multiplier, offset = seeds
    index = torch.arange(start, start + count, dtype=torch.int64, device=device) & 0xFFFFFFFF
    mixed = index * multiplier + offset  # < 2**63 for index < 2**32: no int64 overflow
    mixed = mixed ^ (mixed >> 17)
    return ((mixed >> 7) & 0xFF).to(torch.uint8)


def _check_pattern_target(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype != torch.uint8 or not tensor.is_contiguous():
        raise LocalProtocolError("pattern target must be a contiguous uint8 tensor", field="tensor",
                                 dtype=str(tensor.dtype))
    return tensor.view(-1)


def fill_pattern(tensor: torch.Tensor, request_id: int | str, writer: int, block: int) -> torch.Tensor:
    """Fill a contiguous uint8 ``tensor`` in place with the pattern of (request, writer, block).

    Each byte depends on its offset and on all three ids, so a block written to the wrong slot, by
    the wrong writer or shifted fails ``verify_pattern``. Returns ``tensor``.
    """
    flat = _check_pattern_target(tensor)
    seeds = _pattern_seed(request_id, writer, block)
    for start in range(0, flat.numel(), _CHUNK_BYTES):
        count = min(_CHUNK_BYTES, flat.numel() - start)
        flat[start : start + count] = _pattern_chunk(start, count, seeds, flat.device)
    return tensor


def verify_pattern(tensor: torch.Tensor, request_id: int | str, writer: int, block: int) -> bool:
    """True if ``tensor`` holds exactly ``fill_pattern``'s bytes for these ids (no scratch copy)."""
    flat = _check_pattern_target(tensor)
    seeds = _pattern_seed(request_id, writer, block)
    for start in range(0, flat.numel(), _CHUNK_BYTES):
        count = min(_CHUNK_BYTES, flat.numel() - start)
        if not torch.equal(flat[start : start + count], _pattern_chunk(start, count, seeds, flat.device)):
            return False
    return True
