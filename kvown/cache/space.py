"""Block spaces: where every byte of every KV block lives, as plain numbers a transport can use.

Owns: ``Region`` (one memory range that holds one equal chunk of every block) and ``BlockSpace`` (a
rank's blocks as a tuple of regions that share one block index).

A block is the list of its chunks, one per region, and a WRITE of blocks ``[b...]`` moves the same
chunks on both sides (kvown's pool is one region; vLLM's and TensorRT-LLM's: docs/design.md s. 14).

Rules:
  1. Addresses and strides are per rank; the *shape* (chunk sizes, head grouping, order of regions)
     must be equal on both sides of a transfer. ``shape_digest`` covers exactly the shape, so the
     handshake refuses a peer whose regions differ and names the difference (``describe``).
  2. A chunk is ``groups x heads x unit`` bytes, heads inside groups: ``groups == 1`` is
     head-outermost (kvown's own pool), ``groups == tokens_per_block`` is token-major (vLLM). Head
     slice ``i`` of ``n`` is heads ``[i*h/n, (i+1)*h/n)`` of every group.
  3. Descriptor order is region-major: entry ``r * num_blocks + b`` is region ``r``'s chunk of block
     ``b``, so a run of consecutive blocks is a run of consecutive entries in every region.
  4. ``from_wire`` validates every field of a peer's space (``PeerProtocolError`` naming the field).

Invariants:
  INV-SP1  Chunks of one region never overlap: ``stride_nbytes >= chunk_nbytes``.
  INV-SP2  ``groups * heads`` divides ``chunk_nbytes``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvown.core.errors import ConfigError, KvownError, LocalProtocolError, PeerProtocolError

MAX_REGIONS = 4096
_MEMS = ("DRAM", "VRAM")


@dataclass(frozen=True, slots=True)
class Region:
    """One chunk of every block: block ``b``'s chunk is ``chunk_nbytes`` at ``base_addr + b * stride_nbytes``."""

    base_addr: int
    stride_nbytes: int
    chunk_nbytes: int
    heads: int = 1  # heads per group inside a chunk (rule 2)
    groups: int = 1  # groups (e.g. tokens) per chunk; 1 means head-outermost

    def check(self, error: type[KvownError] = ConfigError) -> None:
        for name in ("base_addr", "stride_nbytes", "chunk_nbytes", "heads", "groups"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0 or value >= 1 << 63:
                raise error("region fields must be positive integers", field=name, value=value)
        if self.stride_nbytes < self.chunk_nbytes:  # INV-SP1
            raise error("region stride is shorter than its chunk", field="stride_nbytes",
                        stride_nbytes=self.stride_nbytes, chunk_nbytes=self.chunk_nbytes)
        if self.chunk_nbytes % (self.heads * self.groups):  # INV-SP2
            raise error("chunk is not groups x heads equal units", field="chunk_nbytes",
                        chunk_nbytes=self.chunk_nbytes, heads=self.heads, groups=self.groups)

    def shape(self) -> list[int]:
        return [self.chunk_nbytes, self.heads, self.groups]

    @classmethod
    def from_tensor(cls, tensor: Any, *, block_dim: int = 0, heads: int = 1, groups: int = 1) -> Region:
        """The region of a server-owned tensor whose dimension ``block_dim`` is the block index.

        One block's slice must be contiguous (it is one chunk). E.g. vLLM's per-layer
        ``[2, num_blocks, block_size, kv_heads, head_dim]``: ``Region.from_tensor(t[0], heads=kv_heads,
        groups=block_size)`` for K and the same of ``t[1]`` for V; TensorRT-LLM's KEY pool
        ``[num_blocks, ...]``: ``Region.from_tensor(key_pool, heads=...)``.
        After error: ``ConfigError`` naming what does not fit.
        """
        one = tensor.select(block_dim, 0)
        if not one.is_contiguous():
            raise ConfigError("one block's slice of the tensor must be contiguous", field="block_dim",
                              shape=tuple(tensor.shape), block_dim=block_dim)
        elt = tensor.element_size()
        region = cls(int(tensor.data_ptr()), int(tensor.stride(block_dim)) * elt, one.numel() * elt, heads, groups)
        region.check()
        return region


@dataclass(frozen=True)
class BlockSpace:
    """``num_blocks`` blocks spread over ``regions`` (rule 3 for the descriptor order)."""

    regions: tuple[Region, ...]
    num_blocks: int
    mem: str = "DRAM"  # NIXL segment: DRAM or VRAM
    device_id: int = 0

    def __post_init__(self) -> None:
        self._validate(ConfigError)

    def _validate(self, error: type[KvownError]) -> None:
        if not isinstance(self.regions, tuple) or not 0 < len(self.regions) <= MAX_REGIONS:
            raise error("a block space needs 1..4096 regions", field="regions")
        for region in self.regions:
            if not isinstance(region, Region):
                raise error("regions must be Region values", field="regions")
            region.check(error)
        if type(self.num_blocks) is not int or not 0 < self.num_blocks < 1 << 31:
            raise error("num_blocks out of range", field="num_blocks", value=self.num_blocks)
        for region in self.regions:  # every chunk's address must fit 64 bits (no silent wrap-around)
            if region.base_addr + self.num_blocks * region.stride_nbytes > 1 << 64:
                raise error("region extends past the 64-bit address space", field="regions",
                            base_addr=region.base_addr, stride_nbytes=region.stride_nbytes)
        if self.mem not in _MEMS:
            raise error("mem must be DRAM or VRAM", field="mem", value=self.mem)
        if type(self.device_id) is not int or not 0 <= self.device_id < 1 << 16:
            raise error("device_id out of range", field="device_id", value=self.device_id)

    @classmethod
    def of_tensors(cls, regions: Sequence[Region], tensors: Sequence[Any], *, block_dim: int = 0) -> BlockSpace:
        """A space over server-owned tensors (``regions`` from ``Region.from_tensor``); ``num_blocks``,
        memory kind and device come from the tensors, which must agree."""
        counts = {int(t.shape[block_dim]) for t in tensors}
        devices = {(t.device.type, t.device.index or 0) for t in tensors}
        if len(counts) != 1 or len(devices) != 1:
            raise ConfigError("every region's tensor needs the same number of blocks and the same device",
                              field="tensors", num_blocks=sorted(counts), devices=sorted(devices))
        (kind, index), = devices
        return cls(tuple(regions), counts.pop(), "VRAM" if kind == "cuda" else "DRAM", index)

    @classmethod
    def contiguous(cls, base_addr: int, block_nbytes: int, num_blocks: int, *, heads: int = 1,
                   mem: str = "DRAM", device_id: int = 0) -> BlockSpace:
        """One dense region, head-outermost: kvown's own ``KVPool``."""
        return cls((Region(base_addr, block_nbytes, block_nbytes, heads),), num_blocks, mem, device_id)

    # ---- sizes and identity -------------------------------------------------------------------

    @property
    def block_nbytes(self) -> int:
        return sum(r.chunk_nbytes for r in self.regions)

    def shape_digest(self) -> str:
        """sha256 hex of the shape (rule 1): chunk sizes, heads, groups, region order. No addresses."""
        text = json.dumps([r.shape() for r in self.regions], separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def describe(self) -> str:
        """A short readable shape, for handshake errors: ``2 regions: 4096B/8h/1g, 512B/8h/1g``."""
        shapes = ", ".join(f"{r.chunk_nbytes}B/{r.heads}h/{r.groups}g" for r in self.regions[:4])
        more = "" if len(self.regions) <= 4 else f", ... ({len(self.regions)} in all)"
        return f"{len(self.regions)} regions: {shapes}{more}"

    # ---- descriptors --------------------------------------------------------------------------

    def descriptors(self) -> tuple[np.ndarray, np.ndarray]:
        """(addrs, sizes) of every chunk, region-major (rule 3). Called: once per side at start-up."""
        n = self.num_blocks
        blocks = np.arange(n, dtype=np.uint64)
        addrs = np.concatenate([np.uint64(r.base_addr) + blocks * np.uint64(r.stride_nbytes) for r in self.regions])
        sizes = np.concatenate([np.full(n, r.chunk_nbytes, dtype=np.int64) for r in self.regions])
        return addrs, sizes

    def indices(self, blocks: Sequence[int]) -> np.ndarray:
        """Descriptor indices of ``blocks`` in every region (int32), region-major."""
        arr = np.asarray(blocks, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.num_blocks):
            raise LocalProtocolError("block id out of range", field="blocks", num_blocks=self.num_blocks)
        if len(self.regions) == 1:
            return arr.astype(np.int32)
        offsets = np.arange(len(self.regions), dtype=np.int64) * self.num_blocks
        return (offsets[:, None] + arr[None, :]).reshape(-1).astype(np.int32)

    def slice_ranges(self, blocks: Sequence[int], slice_index: int, num_slices: int) -> list[tuple[int, int]]:
        """(addr, nbytes) of head slice ``slice_index`` of ``num_slices`` of every block, region-major."""
        out: list[tuple[int, int]] = []
        for r in self.regions:
            if r.heads % num_slices:
                raise LocalProtocolError("num_slices must divide the heads of every region", field="num_slices",
                                         heads=r.heads, num_slices=num_slices)
            unit = r.chunk_nbytes // (r.heads * r.groups)
            part = unit * r.heads // num_slices
            group_nbytes = unit * r.heads
            for b in blocks:
                start = r.base_addr + b * r.stride_nbytes + slice_index * part
                out.extend((start + g * group_nbytes, part) for g in range(r.groups))
        return out

    # ---- wire ---------------------------------------------------------------------------------

    def to_wire(self) -> list[Any]:
        return [[[r.base_addr, r.stride_nbytes, r.chunk_nbytes, r.heads, r.groups] for r in self.regions],
                self.num_blocks, self.mem, self.device_id]

    @classmethod
    def from_wire(cls, obj: Any) -> BlockSpace:
        """A peer's space from its start-up record. Raises ``PeerProtocolError(field=...)`` (rule 4)."""
        if not isinstance(obj, (list, tuple)) or len(obj) != 4:
            raise PeerProtocolError("block space must be [regions, num_blocks, mem, device_id]", field="space")
        raw, num_blocks, mem, device_id = obj
        if not isinstance(raw, (list, tuple)) or not 0 < len(raw) <= MAX_REGIONS:
            raise PeerProtocolError("a block space needs 1..4096 regions", field="regions")
        regions = []
        for item in raw:
            if not isinstance(item, (list, tuple)) or len(item) != 5:
                raise PeerProtocolError("a region is [base, stride, chunk, heads, groups]", field="regions")
            regions.append(Region(*item))
        space = object.__new__(cls)  # validate with the peer's error type before anything uses it
        for name, value in (("regions", tuple(regions)), ("num_blocks", num_blocks), ("mem", mem),
                            ("device_id", device_id)):
            object.__setattr__(space, name, value)
        space._validate(PeerProtocolError)
        return space
