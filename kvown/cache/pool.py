"""KV block pool: one torch byte tensor, cut into blocks, with an ownership state per block.

Owns: the storage of one rank's KV blocks (CPU or CUDA) and the state of every block.

FREE (free list; nobody writes it) --allocate--> OWNED (one request receives into it) --hold--> HELD
(ended without proof that every writer is quiescent: waits for that proof, or for fail-stop); ``retire``
from OWNED or HELD is the only way back to FREE.

Rules:
  1. Blocks go back to FREE only through ``retire`` (the retirement path); there is no other way.
  2. Every mutator validates all its arguments before it changes anything: a raise leaves the pool
     exactly as it was.
  3. Cost is proportional to the blocks touched (plus a search over the distinct free-run lengths):
     no mutator scans the pool. ``check(deep=True)`` is the one full scan, for tests and diagnostics.
  4. Single writer: the pool belongs to one rank's engine thread. It has no lock.
  5. FREE blocks are kept as maximal runs of consecutive ids; ``allocate(n)`` is best fit (else whole
     runs, longest first) and ``retire`` merges with free neighbours (docs/design.md section 14).

Invariants (checked after every mutation; a failure raises ``InvariantViolation``):
  INV-POOL-1  total == free + owned + held.
  INV-POOL-2  (deep) every block's state agrees with the free list and the per-owner index, and no
              block appears twice in either.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
from collections.abc import Hashable, Iterable

import torch

from kvown.cache.hostmem import device_bytes
from kvown.cache.layout import KVLayout
from kvown.cache.space import BlockSpace, Region
from kvown.core.errors import ConfigError, InvariantViolation, KvownError, LocalProtocolError


class BlockState(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: C-level hashing (enum's is Python)

    FREE = "FREE"  # in the free list: retired with proof, or never used
    OWNED = "OWNED"  # allocated to an owner that is receiving into it
    HELD = "HELD"  # the owner's writers are not yet proven quiescent


class PoolExhausted(KvownError):
    """Not enough FREE blocks for an allocation. Nothing was allocated; the caller may retry later.

    Not a protocol error: it is back-pressure, so it is its own class (fields ``requested``, ``free``).
    """


@dataclasses.dataclass(frozen=True)
class PoolStatistics:
    total: int
    free: int
    owned: int
    held: int


class KVPool:
    """The blocks of one ``KVLayout`` in one contiguous torch uint8 tensor on ``device``."""

    def __init__(self, layout: KVLayout, device: str | torch.device = "cpu", *,
                 huge_pages: bool = True) -> None:
        """``huge_pages``: a CPU pool asks for transparent huge pages (``kvown.cache.hostmem`` rule 2)."""
        self.layout = layout
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("CUDA pool asked for, but torch sees no CUDA device", field="device", value=str(device))
        if self.device.type not in {"cpu", "cuda"}:
            raise ConfigError("pool device must be cpu or cuda", field="device", value=str(device))
        # Zero-filled so a block never shows another run's stale bytes.
        memory = device_bytes(layout.pool_nbytes, self.device, huge_pages=huge_pages)
        self.tensor = memory.tensor
        self.huge_pages_advised = memory.advised  # a CPU pool the kernel agreed to back with THP
        # A "separate" NVFP4 layout keeps its scales in a companion pool at the same block index (the
        # TensorRT-LLM way): its bytes only; the block states are this pool's. Transfers move both.
        self.scales = (KVPool(layout.scale_pool(), self.device, huge_pages=huge_pages)
                       if layout.scale_layout == "separate" else None)
        self._block_nbytes = layout.block_nbytes
        self._state = [BlockState.FREE] * layout.num_blocks
        self._owner: list[Hashable | None] = [None] * layout.num_blocks
        # Rule 5: free runs as start -> length and end -> start, and the starts of each run length.
        n = layout.num_blocks
        self._runs: dict[int, int] = {0: n}
        self._run_ends: dict[int, int] = {n: 0}
        self._by_len: dict[int, dict[int, None]] = {n: {0: None}}  # length -> starts (insertion order)
        self._lens: list[int] = [n]  # the distinct free-run lengths, ascending
        self._num_free = n
        self._by_owner: dict[Hashable, dict[int, None]] = {}  # owner -> its OWNED and HELD blocks, in order
        self._num_owned = 0
        self._num_held = 0

    # ---- addresses ----------------------------------------------------------------------------

    @property
    def base_addr(self) -> int:
        """Address of block 0 (what NIXL registers); block b starts ``b * block_nbytes`` later."""
        return int(self.tensor.data_ptr())

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    def heads(self) -> int:
        """Heads a fan-in may split between writers."""
        return self.layout.num_kv_heads

    def space(self) -> BlockSpace:
        """The pool as a block space for the transport: one region (heads outermost), plus the scale
        pool's region for a "separate" NVFP4 layout, so moving block b moves its scales too."""
        mem = "VRAM" if self.device.type == "cuda" else "DRAM"
        regions = [Region(self.base_addr, self._block_nbytes, self._block_nbytes, self.layout.num_kv_heads)]
        if self.scales is not None:
            n = self.scales.layout.block_nbytes
            regions.append(Region(self.scales.base_addr, n, n, self.layout.num_kv_heads))
        # The GPU the memory is on, not the one asked for: "cuda" allocates on the current device, and
        # NIXL's UCX backend refuses VRAM registered under another device id.
        device_id = self.tensor.device.index if mem == "VRAM" else 0
        return BlockSpace(tuple(regions), self.layout.num_blocks, mem, device_id)

    def block_addr(self, block: int) -> int:
        self._check_index(block, "block")
        return self.base_addr + block * self._block_nbytes

    def block_view(self, block: int) -> torch.Tensor:
        """The block's bytes as a uint8 view (no copy).

        Ownership: the view does not change the block's state; only an OWNED block's owner should write it.
        """
        self._check_index(block, "block")
        start = block * self._block_nbytes
        return self.tensor[start : start + self._block_nbytes]

    def plane_view(self, plane_name: str) -> torch.Tensor:
        """One plane across the pool as a strided uint8 view (no copy), shape (num_blocks, num_kv_heads,
        num_layers, tokens_per_block, nbytes per token); index it by block, e.g. ``[block_ids]``.

        For NVFP4 planes this is what ``kvown.kernels.ops.quantize(out=...)`` writes into and
        ``dequantize`` reads, whichever scale layout the pool has. Ownership: as ``block_view``.
        """
        shape, strides, offset = self.layout.plane_geometry(plane_name)
        return self.tensor.as_strided(shape, strides, self.tensor.storage_offset() + offset)

    # ---- state changes ------------------------------------------------------------------------

    def allocate(self, num_blocks: int, owner: Hashable) -> tuple[int, ...]:
        """Take ``num_blocks`` FREE blocks for ``owner``.

        Called: by the engine thread, once per request (or per growth step).
        Ownership: the returned blocks are OWNED by ``owner`` until ``retire``.
        After error: ``PoolExhausted`` or ``LocalProtocolError``; nothing changed.
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise LocalProtocolError("num_blocks must be a non-negative int", field="num_blocks", value=num_blocks)
        if owner is None:
            raise LocalProtocolError("owner must not be None", field="owner")
        if num_blocks > self._num_free:
            raise PoolExhausted("not enough free blocks", requested=num_blocks, free=self._num_free, owner=owner)
        taken = self._take(num_blocks)
        owned = self._by_owner.setdefault(owner, {})
        for block in taken:
            self._state[block] = BlockState.OWNED
            self._owner[block] = owner
            owned[block] = None
        if not owned:
            del self._by_owner[owner]  # allocate(0) leaves no empty entry behind
        self._num_owned += num_blocks
        self.check()
        return taken

    def hold(self, blocks: Iterable[int]) -> None:
        """OWNED -> HELD: these blocks wait for proof that every writer is quiescent.

        Called: by the engine thread when a transfer ends in doubt, is cancelled, or fails.
        Ownership: unchanged owner; nothing may reuse the blocks until ``retire``.
        After error: ``LocalProtocolError`` (out of range, duplicate, not OWNED); nothing changed.
        """
        blocks = self._validated(blocks, allowed={BlockState.OWNED}, owner=None)
        for block in blocks:
            self._state[block] = BlockState.HELD
        self._num_owned -= len(blocks)
        self._num_held += len(blocks)
        self.check()

    def retire(self, blocks: Iterable[int], owner: Hashable) -> None:
        """OWNED or HELD -> FREE: the only way back to the free list (rule 1).

        Called: by the engine thread, on the retirement path only, once every published writer of
        these blocks is proven quiescent (or, for OWNED blocks, was never published).
        Ownership: the blocks belong to the pool again; ``owner`` must not touch them.
        After error: ``LocalProtocolError`` (out of range, duplicate, FREE, or another owner's); nothing changed.
        """
        if owner is None:
            raise LocalProtocolError("owner must not be None", field="owner")
        blocks = self._validated(blocks, allowed={BlockState.OWNED, BlockState.HELD}, owner=owner)
        owned = self._by_owner[owner]
        for block in blocks:
            if self._state[block] is BlockState.HELD:
                self._num_held -= 1
            else:
                self._num_owned -= 1
            self._state[block] = BlockState.FREE
            self._owner[block] = None
            del owned[block]
        self._give_back(blocks)
        if not owned:
            del self._by_owner[owner]
        self.check()

    # ---- queries ------------------------------------------------------------------------------

    def state(self, block: int) -> BlockState:
        self._check_index(block, "block")
        return self._state[block]

    def owned_by(self, owner: Hashable) -> tuple[int, ...]:
        """The OWNED and HELD blocks of ``owner``, in allocation order (empty if none)."""
        return tuple(self._by_owner.get(owner, ()))

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(
            total=self.layout.num_blocks, free=self._num_free, owned=self._num_owned, held=self._num_held
        )

    def free_blocks(self) -> tuple[int, ...]:
        """Every FREE block id, ascending (diagnostics and tests: it walks the free runs)."""
        return tuple(b for start in sorted(self._runs) for b in range(start, start + self._runs[start]))

    def free_runs(self) -> int:
        """How many runs the FREE blocks form (1 for an unused pool; fragmentation otherwise)."""
        return len(self._runs)

    def check(self, *, deep: bool = False) -> None:
        """Raise ``InvariantViolation`` if INV-POOL-1 (or, with ``deep``, INV-POOL-2) fails.

        Called: after every mutation (O(1)); ``deep`` scans the whole pool, for tests and diagnostics.
        """
        if self._num_free + self._num_owned + self._num_held != self.layout.num_blocks:  # no allocation
            raise InvariantViolation("INV-POOL-1: total != free + owned + held", statistics=self.statistics())
        if deep:
            self._check_deep(self.statistics())

    # ---- free runs (rule 5) ------------------------------------------------------------------------

    def _take(self, n: int) -> tuple[int, ...]:
        """``n`` FREE blocks (``n <= free``): the head of the best-fitting run, else whole runs."""
        if n == 0:
            return ()
        i = bisect.bisect_left(self._lens, n)
        if i < len(self._lens):
            length = self._lens[i]
            start = next(iter(self._by_len[length]))
            self._drop_run(start, length)
            if length > n:
                self._add_run(start + n, length - n)
            self._num_free -= n
            return tuple(range(start, start + n))
        out: list[int] = []
        while len(out) < n:  # no run is long enough: the longest runs first, the last one cut
            length = self._lens[-1]
            start = next(iter(self._by_len[length]))
            take = min(length, n - len(out))
            self._drop_run(start, length)
            if length > take:
                self._add_run(start + take, length - take)
            out.extend(range(start, start + take))
        self._num_free -= n
        return tuple(out)

    def _give_back(self, blocks: list[int]) -> None:
        """Return validated blocks to the free runs, merging with free neighbours."""
        for start, end in _runs_of(sorted(blocks)):
            left = self._run_ends.get(start)
            if left is not None:  # a free run ends where this one starts
                self._drop_run(left, start - left)
                start = left
            right = self._runs.get(end)
            if right is not None:  # a free run starts where this one ends
                self._drop_run(end, right)
                end += right
            self._add_run(start, end - start)
        self._num_free += len(blocks)

    def _add_run(self, start: int, length: int) -> None:
        self._runs[start] = length
        self._run_ends[start + length] = start
        starts = self._by_len.get(length)
        if starts is None:
            starts = self._by_len[length] = {}
            bisect.insort(self._lens, length)
        starts[start] = None

    def _drop_run(self, start: int, length: int) -> None:
        del self._runs[start]
        del self._run_ends[start + length]
        starts = self._by_len[length]
        del starts[start]
        if not starts:
            del self._by_len[length]
            del self._lens[bisect.bisect_left(self._lens, length)]

    # ---- helpers ------------------------------------------------------------------------------

    def _check_deep(self, stats: PoolStatistics) -> None:
        counts = {state: 0 for state in BlockState}
        for state in self._state:
            counts[state] += 1
        indexed = [block for blocks in self._by_owner.values() for block in blocks]
        problems = []
        if (counts[BlockState.FREE], counts[BlockState.OWNED], counts[BlockState.HELD]) != (
            stats.free, stats.owned, stats.held
        ):
            problems.append("state counts disagree with the counters")
        free = self.free_blocks()
        if len(free) != self._num_free or any(self._state[b] is not BlockState.FREE for b in free):
            problems.append("free runs hold a duplicate, a miscount or a non-FREE block")
        runs = sorted(self._runs.items())
        if any(s + n >= t for (s, n), (t, _) in zip(runs, runs[1:])) or any(n <= 0 for _, n in runs):
            problems.append("free runs overlap, touch (not merged) or are empty")
        if {e: s for s, n in runs for e in [s + n]} != self._run_ends:
            problems.append("free-run end index disagrees with the runs")
        by_len: dict[int, set[int]] = {}
        for start, length in runs:
            by_len.setdefault(length, set()).add(start)
        if by_len != {k: set(v) for k, v in self._by_len.items()} or sorted(by_len) != self._lens:
            problems.append("free-run length index disagrees with the runs")
        if len(set(indexed)) != len(indexed) or len(indexed) != stats.owned + stats.held:
            problems.append("owner index holds a duplicate or misses a block")
        for owner, blocks in self._by_owner.items():
            if not blocks or any(self._owner[b] != owner or self._state[b] is BlockState.FREE for b in blocks):
                problems.append(f"owner index of {owner!r} disagrees with block states")
        if problems:
            raise InvariantViolation("INV-POOL-2: pool bookkeeping is inconsistent", problems=problems, statistics=stats)

    def _check_index(self, block: object, field: str) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < self.layout.num_blocks:
            raise LocalProtocolError("block id out of range", field=field, block=block, num_blocks=self.layout.num_blocks)

    def _validated(
        self, blocks: Iterable[int], *, allowed: set[BlockState], owner: Hashable | None
    ) -> list[int]:
        """All checks of rule 2, before any change: range, duplicates, state, and owner when given."""
        blocks = list(blocks)
        seen: set[int] = set()
        for block in blocks:
            self._check_index(block, "blocks")
            if block in seen:
                raise LocalProtocolError("block listed twice", field="blocks", block=block)
            seen.add(block)
            state = self._state[block]
            if state not in allowed:
                raise LocalProtocolError(
                    "block is in the wrong state", field="blocks", block=block, state=state.name,
                    allowed=sorted(s.name for s in allowed),
                )
            if owner is not None and self._owner[block] != owner:
                raise LocalProtocolError(
                    "block belongs to another owner", field="owner", block=block, owner=owner,
                    actual_owner=self._owner[block],
                )
        return blocks


def _runs_of(ordered: list[int]) -> list[tuple[int, int]]:
    """``[(start, end)]`` of the maximal runs of consecutive ids in an ascending list."""
    out: list[tuple[int, int]] = []
    for b in ordered:
        if out and out[-1][1] == b:
            out[-1] = (out[-1][0], b + 1)
        else:
            out.append((b, b + 1))
    return out
