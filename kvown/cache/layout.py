"""KV block geometry: how many bytes a block holds and where each part of it lives.

Owns: ``KVLayout`` (the shape of one rank's KV pool) and ``Plane`` (one kind of per-token data: K, V,
an MLA latent, NVFP4 packed values or their scales). Standard K/V, MLA and NVFP4 differ only in their
planes, which are data: there is no separate code path per format. NVFP4 scales are planes of this
pool (``scale_layout="inline"``) or a second pool of the same block count (``"separate"``,
``scale_pool()``: a transfer of block b moves block b of both).

Memory order: blocks outermost, then heads, then layers, then planes, then tokens; each block is one
contiguous byte range and so is each head slice of it (why: docs/design.md section 14).

Rules:
  1. Every field is validated in the constructor; a bad one raises ``ConfigError`` naming the field.
  2. ``geometry_digest`` covers everything that decides where a byte of a block lives (not
     ``num_blocks``: pools of different capacity exchange blocks of the same geometry).
  3. Offsets returned here are byte offsets from the start of the pool.
  4. ``scale_layout`` is part of the digest: peers that put NVFP4 scales in different places never
     agree on a geometry.

Invariants:
  1. ``block_nbytes == num_kv_heads * head_nbytes`` and
     ``head_nbytes == num_layers * tokens_per_block * sum(plane nbytes per (token, head))``.
  2. ``head_slice_ranges`` of the ``num_slices`` slices of a block are disjoint and cover the block.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable

from kvown.core.errors import ConfigError, LocalProtocolError, PeerProtocolError

# Element sizes of the dtypes a plane may hold. Stored as names so the layout (and its digest) does
# not depend on torch; the pool maps names to torch dtypes.
DTYPE_NBYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

NVFP4_GROUP_SIZE = 16  # values that share one scale
SCALE_LAYOUTS = ("inline", "separate")  # where NVFP4 scales live (module header)
_SCALE_POOL = "scale-pool"  # scale_layout of the companion pool of a "separate" layout
LAYOUT_ORDER = "block>head>layer>plane>token"  # part of the digest: a change of order changes it


@dataclasses.dataclass(frozen=True)
class Plane:
    """One kind of per-(token, head) data in every layer, e.g. K, V, an MLA latent or NVFP4 scales."""

    name: str
    dtype: str  # a key of DTYPE_NBYTES
    elements_per_token: int  # per (token, head, layer)

    @property
    def nbytes_per_token(self) -> int:
        return self.elements_per_token * DTYPE_NBYTES[self.dtype]


def _require_positive_int(value: object, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{field} must be a positive int", field=field, value=value)


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Geometry of one KV pool. Build with ``standard``, ``mla`` or ``nvfp4``; see the module header."""

    num_layers: int
    num_blocks: int
    tokens_per_block: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # the model's KV dtype name (what the planes encode)
    planes: tuple[Plane, ...]
    scale_layout: str = ""  # NVFP4 only: "inline", "separate", or "scale-pool" (a separate layout's scales)
    scale_planes: tuple[Plane, ...] = ()  # "separate" only: the planes of scale_pool()

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_blocks", "tokens_per_block", "num_kv_heads", "head_dim"):
            _require_positive_int(getattr(self, field), field)
        if self.dtype not in DTYPE_NBYTES:
            raise ConfigError("unknown dtype", field="dtype", value=self.dtype, fix=f"use one of {sorted(DTYPE_NBYTES)}")
        if not isinstance(self.planes, tuple) or not self.planes:
            raise ConfigError("a layout needs a non-empty tuple of planes", field="planes")
        names = [plane.name for plane in self.planes]
        if len(set(names)) != len(names):
            raise ConfigError("plane names must be unique", field="planes", value=names)
        for plane in (*self.planes, *self.scale_planes):
            if plane.dtype not in DTYPE_NBYTES:
                raise ConfigError("unknown plane dtype", field="planes", plane=plane.name, value=plane.dtype)
            _require_positive_int(plane.elements_per_token, "planes")
        if self.scale_layout not in ("", *SCALE_LAYOUTS, _SCALE_POOL):
            raise ConfigError("unknown scale layout", field="scale_layout", value=self.scale_layout,
                              fix=f"use one of {SCALE_LAYOUTS}")
        if (self.scale_layout == "separate") != bool(self.scale_planes):
            raise ConfigError("scale_planes are given exactly when scale_layout is 'separate'", field="scale_planes",
                              scale_layout=self.scale_layout)

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    def standard(
        cls, *, num_layers: int, num_blocks: int, tokens_per_block: int, num_kv_heads: int, head_dim: int,
        dtype: str = "bfloat16",
    ) -> KVLayout:
        """K and V planes of ``head_dim`` values of ``dtype`` per (token, head)."""
        planes = (Plane("k", dtype, head_dim), Plane("v", dtype, head_dim))
        return cls(num_layers, num_blocks, tokens_per_block, num_kv_heads, head_dim, dtype, planes)

    @classmethod
    def mla(
        cls, *, num_layers: int, num_blocks: int, tokens_per_block: int, latent_dim: int, dtype: str = "bfloat16"
    ) -> KVLayout:
        """One latent plane (compressed KV plus rope part, ``latent_dim`` values) shared by all heads.

        ``num_kv_heads`` is 1, so an MLA block has a single head slice: fan-in writers replicate
        rather than split it.
        """
        planes = (Plane("latent", dtype, latent_dim),)
        return cls(num_layers, num_blocks, tokens_per_block, 1, latent_dim, dtype, planes)

    @classmethod
    def nvfp4(
        cls, *, num_layers: int, num_blocks: int, tokens_per_block: int, num_kv_heads: int, head_dim: int,
        scale_layout: str = "inline",
    ) -> KVLayout:
        """K and V as NVFP4: E2M1 values packed two per byte plus one FP8 (E4M3) scale per 16 values.

        ``scale_layout`` says where the scales live: ``"inline"`` or ``"separate"`` (module header).
        """
        return cls._nvfp4(num_layers, num_blocks, tokens_per_block, num_kv_heads, head_dim, ("k", "v"), scale_layout)

    @classmethod
    def nvfp4_mla(
        cls, *, num_layers: int, num_blocks: int, tokens_per_block: int, latent_dim: int = 576,
        scale_layout: str = "inline",
    ) -> KVLayout:
        """The MLA latent (e.g. 512 compressed + 64 rope) as NVFP4, one head: ``latent_values`` and
        ``latent_scales``. The rope part may use its own global scale (``kvown.kernels.ops.quantize(rope_dim=)``);
        global scales travel out of band, so they are not part of the geometry."""
        return cls._nvfp4(num_layers, num_blocks, tokens_per_block, 1, latent_dim, ("latent",), scale_layout)

    @classmethod
    def _nvfp4(
        cls, num_layers: int, num_blocks: int, tokens_per_block: int, num_kv_heads: int, head_dim: int,
        names: tuple[str, ...], scale_layout: str,
    ) -> KVLayout:
        _require_positive_int(head_dim, "head_dim")
        if head_dim % NVFP4_GROUP_SIZE:
            raise ConfigError(
                "NVFP4 needs head_dim divisible by the scale group size", field="head_dim", value=head_dim,
                group_size=NVFP4_GROUP_SIZE,
            )
        if scale_layout not in SCALE_LAYOUTS:
            raise ConfigError("unknown scale layout", field="scale_layout", value=scale_layout,
                              fix=f"use one of {SCALE_LAYOUTS}")
        values = [Plane(f"{name}_values", "uint8", head_dim // 2) for name in names]
        scales = [Plane(f"{name}_scales", "float8_e4m3fn", head_dim // NVFP4_GROUP_SIZE) for name in names]
        if scale_layout == "inline":
            planes = tuple(plane for pair in zip(values, scales, strict=True) for plane in pair)
            return cls(num_layers, num_blocks, tokens_per_block, num_kv_heads, head_dim, "uint8", planes, "inline")
        return cls(num_layers, num_blocks, tokens_per_block, num_kv_heads, head_dim, "uint8", tuple(values),
                   "separate", tuple(scales))

    def scale_pool(self) -> KVLayout:
        """The layout of the pool that holds a ``"separate"`` layout's scales (same blocks and heads).

        Block b of this layout's pool and block b of the scale pool belong together.
        """
        if self.scale_layout != "separate":
            raise ConfigError("only a 'separate' NVFP4 layout has a scale pool", field="scale_layout",
                              value=self.scale_layout)
        return dataclasses.replace(self, dtype="float8_e4m3fn", planes=self.scale_planes, scale_layout=_SCALE_POOL,
                                   scale_planes=())

    # ---- sizes --------------------------------------------------------------------------------

    @property
    def head_nbytes(self) -> int:
        """Bytes of one head's data (all layers, all planes) inside one block."""
        return self.num_layers * self.tokens_per_block * sum(plane.nbytes_per_token for plane in self.planes)

    @property
    def block_nbytes(self) -> int:
        return self.num_kv_heads * self.head_nbytes

    @property
    def pool_nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    @property
    def transfer_block_nbytes(self) -> int:
        """Bytes that moving one block moves: ``block_nbytes`` plus the scale pool's block, if any."""
        return self.block_nbytes + (self.scale_pool().block_nbytes if self.scale_planes else 0)

    def plane_geometry(self, plane_name: str) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """(shape, strides, offset) in bytes of one plane across the pool, for ``as_strided``.

        Shape is (num_blocks, num_kv_heads, num_layers, tokens_per_block, nbytes per token); the last
        dimension is contiguous. ``KVPool.plane_view`` applies it.
        """
        offset = 0
        for plane in self.planes:
            if plane.name == plane_name:
                layer_nbytes = self.head_nbytes // self.num_layers
                shape = (self.num_blocks, self.num_kv_heads, self.num_layers, self.tokens_per_block,
                         plane.nbytes_per_token)
                strides = (self.block_nbytes, self.head_nbytes, layer_nbytes, plane.nbytes_per_token, 1)
                return shape, strides, offset
            offset += self.tokens_per_block * plane.nbytes_per_token
        raise ConfigError("no such plane", field="plane_name", value=plane_name, planes=[p.name for p in self.planes])

    def plane_block_nbytes(self, plane_name: str) -> int:
        """Bytes of one plane in one block (all heads and layers)."""
        for plane in self.planes:
            if plane.name == plane_name:
                return self.num_kv_heads * self.num_layers * self.tokens_per_block * plane.nbytes_per_token
        raise ConfigError("no such plane", field="plane_name", value=plane_name, planes=[p.name for p in self.planes])

    # ---- identity -----------------------------------------------------------------------------

    def geometry_digest(self) -> str:
        """sha256 hex of a canonical description of the block geometry (rule 2).

        Called: at handshake time, by both sides; a mismatch means the peers disagree on where bytes go.
        """
        description = {
            "order": LAYOUT_ORDER,
            "num_layers": self.num_layers,
            "tokens_per_block": self.tokens_per_block,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "planes": [[plane.name, plane.dtype, plane.elements_per_token] for plane in self.planes],
        }
        if self.scale_layout:  # rule 4 (absent for non-NVFP4 layouts, whose digests stay as they were)
            description["scale_layout"] = self.scale_layout
            description["scale_planes"] = [[p.name, p.dtype, p.elements_per_token] for p in self.scale_planes]
        canonical = json.dumps(description, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def slice_layout(self, num_slices: int) -> KVLayout:
        """The layout of a writer that holds ``1/num_slices`` of the heads (same pool size in blocks).

        Its ``block_nbytes`` equals the length of each ``head_slice_ranges`` range, byte for byte.
        """
        heads = self._heads_per_slice(num_slices)
        return dataclasses.replace(self, num_kv_heads=heads)

    # ---- byte ranges --------------------------------------------------------------------------

    def check_block_ids(self, block_ids: Iterable[int], *, field: str = "block_ids") -> None:
        """Raise ``PeerProtocolError`` naming ``field`` if any id is not a block of this layout.

        Called: on the engine thread when decoding a peer's block table. Changes nothing.
        """
        for block in block_ids:
            if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < self.num_blocks:
                raise PeerProtocolError("block id out of range", field=field, block=block, num_blocks=self.num_blocks)

    def block_ranges(self, block_ids: Iterable[int]) -> list[tuple[int, int]]:
        """(offset, nbytes) ranges covering ``block_ids`` in the given order, merging consecutive ids.

        ``[4, 5, 6, 9]`` gives two ranges. Ids must be in range (``check_block_ids`` first for peer input).
        """
        ranges: list[tuple[int, int]] = []
        size = self.block_nbytes
        for block in block_ids:
            offset = block * size
            if ranges and ranges[-1][0] + ranges[-1][1] == offset:
                ranges[-1] = (ranges[-1][0], ranges[-1][1] + size)
            else:
                ranges.append((offset, size))
        return ranges

    def head_slice_ranges(self, block: int, slice_index: int, num_slices: int) -> list[tuple[int, int]]:
        """(offset, nbytes) ranges of heads ``[slice_index * h, (slice_index + 1) * h)`` of ``block``.

        With the head-outermost order this is always one range; it is a list so that callers do not
        change if the order ever must follow an engine's (see the module header).
        """
        heads = self._heads_per_slice(num_slices)
        if not 0 <= slice_index < num_slices:
            raise LocalProtocolError("slice_index out of range", field="slice_index", value=slice_index, num_slices=num_slices)
        if not 0 <= block < self.num_blocks:
            raise LocalProtocolError("block out of range", field="block", value=block, num_blocks=self.num_blocks)
        nbytes = heads * self.head_nbytes
        return [(block * self.block_nbytes + slice_index * nbytes, nbytes)]

    def _heads_per_slice(self, num_slices: int) -> int:
        _require_positive_int(num_slices, "num_slices")
        if self.num_kv_heads % num_slices:
            raise ConfigError(
                "num_slices must divide num_kv_heads", field="num_slices", value=num_slices,
                num_kv_heads=self.num_kv_heads,
            )
        return self.num_kv_heads // num_slices
