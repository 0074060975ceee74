"""CPU reference (torch, vectorised) for NVFP4 KV quantisation: the semantics the CUDA kernels match.

Owns: the reference NVFP4 encoder and decoder that kv_math.cuh implements bit for bit on the GPU
(and, built for the host, in tests). Block checksums, patterns and canaries live in kernels/blocks.py
(re-exported here for older imports).

NVFP4, as used here:
  * Values are E2M1 (1 sign, 2 exponent, 1 mantissa bit): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
    Code = sign << 3 | index into that list. Two codes per byte: element 2i in the LOW nibble,
    element 2i+1 in the HIGH nibble.
  * Every 16 consecutive values along the last dimension share one scale, stored as FP8 E4M3
    (``float8_e4m3fn``) bits in a uint8 tensor, so it fits a pool plane byte for byte.
  * A float32 global scale ``gs`` (finite, > 0) keeps the block scales inside E4M3's range:
    ``value = e2m1 * scale_fp8 * gs``. For a KV cache it is a per-layer constant fixed by calibration
    and travels out of band (model config), not in the KV blocks. The MLA latent (512 + 64) may give
    its last ``rope_dim`` columns their own global scale (the rope part has another range).
  * Exact arithmetic, all float32 with round-to-nearest-even and no fused multiply-add:
        scale code = E4M3(min(amax16 / (6 * gs), 448))        (E4M3 rounding: ties to even)
        effective  = float(scale code) * gs
        value code = E2M1(x / effective), or 0 when effective == 0
        decoded    = float(E2M1 code) * effective
    E2M1 rounding: to nearest, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
    2.5 -> 2, 3.5 -> 4, 5 -> 4); magnitudes above 6 saturate to 6; a negative value that rounds to
    zero is code 0 (no negative zero). Every division here is tensor / tensor on the data's device,
    never by a Python scalar (torch on CUDA turns ``t / scalar`` into ``t * (1 / scalar)``).

Rules:
  1. No Python loop runs per element: everything is torch tensor ops.
  2. Results depend only on the bytes and the arguments, never on the device.
  3. Malformed input raises ``KernelInputError`` (a ``ValueError``) naming the argument: a dtype
     other than float32 / bfloat16 / float16, a last dimension that is not a positive multiple of
     16, non-finite values, a global scale that is not finite and > 0 as a float32.

Invariants:
  1. ``dequantize(quantize(x))`` is exact when every group of 16 is an E2M1 value times one
     power-of-two scale (and the global scale is 1).
  2. Values and scales have the same leading shape as ``x``: (..., n // 2) and (..., n // 16).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from kvown.kernels.blocks import (  # noqa: F401  (re-exported: older code imports these from here)
    _CHUNK_BYTES,
    checksum,
    checksums,
    fill_pattern,
    first_pattern_mismatch,
    verify_pattern,
)
from kvown.kernels.errors import KernelInputError

GROUP_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# (threshold, inclusive): the E2M1 index is how many of these the magnitude passes; inclusive
# thresholds are the ties that round up to an even code.
_THRESHOLDS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class NVFP4Tensor:
    values: torch.Tensor  # uint8, shape (..., n // 2): two E2M1 codes per byte
    scales: torch.Tensor  # uint8 bits of float8_e4m3fn, shape (..., n // 16)
    global_scale: float  # a float32 value
    rope_dim: int = 0  # the last rope_dim columns use rope_global_scale (MLA latent)
    rope_global_scale: float | None = None

    @property
    def n(self) -> int:
        return self.values.shape[-1] * 2

    def group_scales(self) -> tuple[float, float]:
        return self.global_scale, self.rope_global_scale if self.rope_dim else self.global_scale


def as_float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (the precision every scale is used at)."""
    return float(torch.tensor(value, dtype=torch.float32))


def check_global_scale(value: object, field: str = "global_scale") -> float:
    """``value`` as a float32 that is finite and > 0, or ``KernelInputError`` naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KernelInputError("global scale must be a number", field=field, value=value)
    rounded = as_float32(float(value)) if math.isfinite(value) else float(value)
    if not math.isfinite(rounded) or rounded <= 0.0:
        raise KernelInputError("global scale must be finite and > 0 (as a float32)", field=field, value=value)
    return rounded


def default_global_scale(amax: float) -> float:
    """amax / (6 * 448) as a float32, so the largest block scale is E4M3's largest; 1.0 for amax 0."""
    scale = as_float32(amax / (E2M1_MAX * E4M3_MAX)) if amax > 0 else 0.0
    return scale if scale > 0 else 1.0


def check_input(x: object, field: str = "x") -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in INPUT_DTYPES:
        raise KernelInputError(
            "expected a float32, bfloat16 or float16 tensor",
            field=field,
            dtype=str(getattr(x, "dtype", type(x).__name__)),
        )
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % GROUP_SIZE:
        raise KernelInputError(
            "rows (the last dimension) must be a positive multiple of 16", field=field, shape=tuple(x.shape)
        )


def check_rope_dim(rope_dim: object, n: int) -> int:
    if (
        isinstance(rope_dim, bool)
        or not isinstance(rope_dim, int)
        or not 0 <= rope_dim < n
        or rope_dim % GROUP_SIZE
    ):
        raise KernelInputError(
            "rope_dim must be a multiple of 16 in [0, n)", field="rope_dim", value=rope_dim, n=n
        )
    return rope_dim


def resolve_scales(
    x: torch.Tensor, global_scale: float | None, rope_dim: int, rope_global_scale: float | None
) -> tuple[float, float | None]:
    """The float32 global scales of a quantisation: given ones checked, missing ones from amax.

    A missing scale needs amax over x (or its rope columns): one pass and, on CUDA, one sync.
    """

    def amax(part: torch.Tensor) -> float:
        value = float(part.abs().max()) if part.numel() else 0.0
        if not math.isfinite(value):
            raise KernelInputError("cannot quantise non-finite values", field="x")
        return value

    if global_scale is None:
        global_scale = default_global_scale(amax(x[..., : x.shape[-1] - rope_dim]))
    gs = check_global_scale(global_scale)
    if not rope_dim:
        if rope_global_scale is not None:
            raise KernelInputError("rope_global_scale needs rope_dim > 0", field="rope_global_scale")
        return gs, None
    if rope_global_scale is None:
        rope_global_scale = default_global_scale(amax(x[..., x.shape[-1] - rope_dim :]))
    return gs, check_global_scale(rope_global_scale, "rope_global_scale")


def _group_scales(
    num_groups: int, rope_dim: int, gs: float, rope_gs: float | None, device: torch.device
) -> torch.Tensor:
    scales = torch.full((num_groups,), gs, dtype=torch.float32, device=device)
    if rope_dim:
        scales[num_groups - rope_dim // GROUP_SIZE :] = rope_gs
    return scales


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round already-scaled float32 values to E2M1 codes (uint8 in 0..15), ties to even, saturating at 6."""
    magnitude = x.abs()
    index = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for threshold, inclusive in _THRESHOLDS:
        index += (magnitude >= threshold) if inclusive else (magnitude > threshold)
    negative = (x < 0) & (index > 0)  # no negative zero: 0 is always code 0
    return index | (negative.to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    magnitude = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)  # code 8 decodes to -0.0


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def quantize(
    x: torch.Tensor,
    global_scale: float | None = None,
    *,
    rope_dim: int = 0,
    rope_global_scale: float | None = None,
) -> NVFP4Tensor:
    """NVFP4-quantise ``x`` (float32 / bfloat16 / float16) along its last dimension (a multiple of 16).

    ``global_scale`` defaults to ``amax(|x|) / (6 * 448)``; with ``rope_dim`` the last ``rope_dim``
    columns use ``rope_global_scale`` (default: their own amax / (6 * 448)).
    After error: ``KernelInputError`` (a ValueError) naming the argument.
    """
    check_input(x)
    check_rope_dim(rope_dim, x.shape[-1])
    values = x.float()
    if not bool(torch.isfinite(values).all()):
        raise KernelInputError("cannot quantise non-finite values", field="x")
    gs, rope_gs = resolve_scales(values, global_scale, rope_dim, rope_global_scale)
    num_groups = values.shape[-1] // GROUP_SIZE
    groups = values.reshape(*values.shape[:-1], num_groups, GROUP_SIZE)
    group_gs = _group_scales(num_groups, rope_dim, gs, rope_gs, values.device)
    denominator = torch.tensor(E2M1_MAX, dtype=torch.float32, device=values.device) * group_gs
    wanted = groups.abs().amax(dim=-1) / denominator
    wanted = torch.where(wanted <= E4M3_MAX, wanted, E4M3_MAX)  # also catches inf
    scales_fp8 = wanted.to(torch.float8_e4m3fn)
    effective = scales_fp8.float() * group_gs
    positive = effective > 0
    divisor = torch.where(positive, effective, 1.0).unsqueeze(-1)
    scaled = torch.where(positive.unsqueeze(-1), groups / divisor, 0.0)
    codes = encode_e2m1(scaled).reshape(values.shape)
    return NVFP4Tensor(pack_nibbles(codes), scales_fp8.view(torch.uint8), gs, rope_dim, rope_gs)


def check_nvfp4(q: object) -> NVFP4Tensor:
    """``q`` if it is a well-formed NVFP4Tensor, else ``KernelInputError`` naming the part."""
    if not isinstance(q, NVFP4Tensor):
        raise KernelInputError("expected an NVFP4Tensor", field="q", type=type(q).__name__)
    for name in ("values", "scales"):
        part = getattr(q, name)
        if not isinstance(part, torch.Tensor) or part.dtype != torch.uint8 or part.dim() == 0:
            raise KernelInputError(
                "expected a uint8 tensor", field=name, dtype=str(getattr(part, "dtype", None))
            )
    n = q.values.shape[-1] * 2
    if n == 0 or n % GROUP_SIZE or q.scales.shape != (*q.values.shape[:-1], n // GROUP_SIZE):
        raise KernelInputError(
            "values must be (..., n / 2) and scales (..., n / 16) with n a multiple of 16",
            field="scales",
            values=tuple(q.values.shape),
            scales=tuple(q.scales.shape),
        )
    check_global_scale(q.global_scale)
    check_rope_dim(q.rope_dim, n)
    if q.rope_dim:
        check_global_scale(q.rope_global_scale, "rope_global_scale")
    return q


def dequantize(q: NVFP4Tensor) -> torch.Tensor:
    """float32 values of ``q`` (shape (..., n))."""
    check_nvfp4(q)
    codes = unpack_nibbles(q.values)
    num_groups = codes.shape[-1] // GROUP_SIZE
    groups = decode_e2m1(codes).reshape(*codes.shape[:-1], num_groups, GROUP_SIZE)
    gs, rope_gs = q.group_scales()
    group_gs = _group_scales(num_groups, q.rope_dim, gs, rope_gs, codes.device)
    effective = q.scales.view(torch.float8_e4m3fn).float() * group_gs
    return (groups * effective.unsqueeze(-1)).reshape(codes.shape)
