"""The reference server's model and the KV memory it owns: a tiny decoder-only transformer with random
weights from a fixed seed, a byte tokenizer, vLLM-style paged KV tensors and the server's block allocator.

Owns: ``ModelConfig``, ``BlockAllocator``, ``PagedKVCache`` (per-layer ``[2, num_blocks, block_size,
kv_heads, head_dim]``), ``TinyLM`` (RMSNorm, RoPE, grouped-query attention, SwiGLU) and ``sample``.

Rules:
  1. Same config and seed, same weights, on any device: weights are drawn on the CPU from a
     ``torch.Generator`` seeded with ``seed`` and only then moved.
  2. Prefill writes the prompt's K and V straight into the request's paged blocks; a decode step writes
     one position and attends over the blocks. Attention reads KV only through the block table, so a
     request whose blocks were copied byte for byte into other block ids computes the same bits.
  3. One request per forward (no cross-request batching): a row's result then never depends on who
     else is running, which is what makes disaggregated output token-exact to a single server.
  4. Output is ASCII: the model's head covers 256 bytes but sampling only ever picks printable ASCII or
     newline (``OUTPUT_IDS``), so each generated token is exactly one character of the streamed text.
  5. Sampling is a pure function of (logits, temperature, top_p, seed, step): the generator is seeded
     per step, so prefill (step 0) and decode (steps 1..) on different servers draw the same tokens.

Invariants:
  INV-ALLOC-1  ``total == free + in_use + lent`` after every allocator call.
  INV-ALLOC-2  A block is in exactly one state; freeing a free block, lending a block the server does
               not hold, or taking back a block that was not lent raises ``LocalProtocolError`` and
               changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from kvown.apps.serve.protocol import ByteTokenizer
from kvown.core.errors import ConfigError, LocalProtocolError, require_positive_ints

__all__ = [
    "OUTPUT_IDS",
    "BlockAllocator",
    "ByteTokenizer",
    "ModelConfig",
    "OutOfBlocks",
    "PagedKVCache",
    "TinyLM",
    "generate_reference",
    "sample",
]

OUTPUT_IDS: tuple[int, ...] = (10, *range(32, 127))  # newline + printable ASCII (rule 4)


@dataclass(frozen=True)
class ModelConfig:
    """The tiny model's shape and weight seed (``digest`` names the pair); ``block_size`` counts tokens."""

    vocab_size: int = 256
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    ffn_dim: int = 128
    rope_theta: float = 10000.0
    max_model_len: int = 1024
    block_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                "num_heads must be a multiple of num_kv_heads", field="num_kv_heads", value=self.num_kv_heads
            )
        require_positive_ints(self, ("d_model", "num_layers", "num_heads", "head_dim", "ffn_dim", "max_model_len",
                                     "block_size"))
        if self.vocab_size != 256:
            raise ConfigError(
                "the byte tokenizer needs vocab_size 256", field="vocab_size", value=self.vocab_size
            )

    def digest(self) -> str:
        """Short id of (architecture, seed): two servers with the same digest compute the same bits."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


class OutOfBlocks(Exception):
    """The allocator cannot serve the request now (the server answers 503)."""


class BlockAllocator:
    """The server's one block allocator. FREE -> IN_USE (allocate) -> LENT (lend to the KV link) ->
    FREE (the link gives them back at retirement), or IN_USE -> FREE (free).

    Called: from any thread (one lock). Ownership: ``allocate`` hands blocks to the caller; ``lend``
    hands them to the KV link, which alone may return them (``give_back``). After error: no change.
    """

    FREE, IN_USE, LENT = 0, 1, 2

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ConfigError("num_blocks must be positive", field="num_blocks", value=num_blocks)
        self.total = num_blocks
        self._state = bytearray(num_blocks)
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._lock = threading.Lock()
        self.counts = {self.FREE: num_blocks, self.IN_USE: 0, self.LENT: 0}
        self.peak_used = 0

    def allocate(self, n: int) -> list[int]:
        with self._lock:
            if n < 0 or n > len(self._free):
                raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
            blocks = [self._free.pop() for _ in range(n)]
            self._move(blocks, self.FREE, self.IN_USE)
            self.peak_used = max(self.peak_used, self.total - len(self._free))
            return blocks

    def free(self, blocks: Sequence[int]) -> None:
        with self._lock:
            self._move(blocks, self.IN_USE, self.FREE)
            self._free.extend(blocks)

    def lend(self, blocks: Sequence[int]) -> None:
        with self._lock:
            self._move(blocks, self.IN_USE, self.LENT)

    def give_back(self, blocks: Sequence[int]) -> None:
        """The KV link returns blocks it retired (with proof): they become FREE."""
        with self._lock:
            self._move(blocks, self.LENT, self.FREE)
            self._free.extend(blocks)

    def _move(self, blocks: Sequence[int], src: int, dst: int) -> None:
        if len(set(blocks)) != len(blocks):
            raise LocalProtocolError("duplicate block in one call", field="blocks", blocks=list(blocks))
        for b in blocks:  # validate all before changing any (INV-ALLOC-2)
            if not (0 <= b < self.total) or self._state[b] != src:
                raise LocalProtocolError(
                    "block is not in the expected state",
                    field="blocks",
                    block=b,
                    expected=src,
                    state=self._state[b] if 0 <= b < self.total else None,
                )
        for b in blocks:
            self._state[b] = dst
        self.counts[src] -= len(blocks)
        self.counts[dst] += len(blocks)
        if sum(self.counts.values()) != self.total:  # INV-ALLOC-1
            raise LocalProtocolError("allocator accounting broke", counts=dict(self.counts))

    def statistics(self) -> dict[str, int]:
        with self._lock:
            return {
                "total": self.total,
                "free": self.counts[self.FREE],
                "in_use": self.counts[self.IN_USE],
                "lent": self.counts[self.LENT],
                "peak_used": self.peak_used,
            }


class PagedKVCache:
    """The server's KV memory: one ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor per layer.

    These tensors are the *regions* a KV link moves bytes between; block ``b`` of layer ``l`` is two
    chunks (K then V) of ``chunk_nbytes`` each, see ``chunks``.
    """

    def __init__(
        self, config: ModelConfig, num_blocks: int, *, device: str = "cpu", dtype: torch.dtype = torch.float32
    ) -> None:
        self.config, self.num_blocks = config, num_blocks
        shape = (2, num_blocks, config.block_size, config.num_kv_heads, config.head_dim)
        self.layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.chunk_nbytes = (
            config.block_size * config.num_kv_heads * config.head_dim * self.layers[0].element_size()
        )
        self.block_nbytes = 2 * config.num_layers * self.chunk_nbytes

    def describe(self) -> dict[str, int | str]:
        """What both ends of a transfer must agree on (compared at the link's handshake)."""
        c = self.config
        return {
            "layout": "vllm-per-layer",
            "num_layers": c.num_layers,
            "block_size": c.block_size,
            "kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "dtype": str(self.layers[0].dtype),
            "block_nbytes": self.block_nbytes,
        }

    def chunks(self, block: int) -> list[tuple[int, int, int]]:
        """``(region, offset_nbytes, nbytes)`` of every byte range that belongs to ``block``.

        Region ``l`` is layer ``l``'s tensor seen as flat bytes; K of block b sits at ``b * chunk``,
        V at ``(num_blocks + b) * chunk``. This is exactly what a NIXL descriptor list would name.
        """
        c = self.chunk_nbytes
        return [
            (layer, (half * self.num_blocks + block) * c, c)
            for layer in range(len(self.layers))
            for half in (0, 1)
        ]

    def write(
        self, layer: int, block_table: Sequence[int], start_pos: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        bs = self.config.block_size
        positions = torch.arange(start_pos, start_pos + k.shape[0])
        table = torch.tensor(block_table, dtype=torch.long)
        blocks, offsets = table[positions // bs], positions % bs
        self.layers[layer][0, blocks.to(k.device), offsets.to(k.device)] = k
        self.layers[layer][1, blocks.to(k.device), offsets.to(k.device)] = v

    def gather(
        self, layer: int, block_table: Sequence[int], length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        nb = self.config.blocks_for(length)
        idx = torch.tensor(block_table[:nb], dtype=torch.long, device=self.layers[layer].device)
        kv = self.layers[layer].index_select(1, idx)  # [2, nb, bs, kvh, hd]
        kv = kv.reshape(2, nb * self.config.block_size, *kv.shape[3:])[:, :length]
        return kv[0], kv[1]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding on ``x [T, heads, head_dim]`` (rotate-half form)."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (theta ** (torch.arange(half, dtype=torch.float32, device=x.device) / half))
    angles = positions.to(x.device, torch.float32)[:, None] * freqs[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class TinyLM:
    """A decoder-only transformer over a ``PagedKVCache``. Called: from the server's one model thread."""

    def __init__(self, config: ModelConfig, *, device: str = "cpu") -> None:
        self.config, self.device = config, device
        g = torch.Generator().manual_seed(config.seed)
        c = config

        def w(*shape: int, fan_in: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) / math.sqrt(fan_in)).to(device)

        self.embed = w(c.vocab_size, c.d_model, fan_in=1) * 0.5
        self.layers = []
        for _ in range(c.num_layers):
            self.layers.append(
                {
                    "attn_norm": torch.ones(c.d_model, device=device),
                    "wq": w(c.d_model, c.num_heads * c.head_dim, fan_in=c.d_model),
                    "wk": w(c.d_model, c.num_kv_heads * c.head_dim, fan_in=c.d_model),
                    "wv": w(c.d_model, c.num_kv_heads * c.head_dim, fan_in=c.d_model),
                    "wo": w(c.num_heads * c.head_dim, c.d_model, fan_in=c.num_heads * c.head_dim),
                    "ffn_norm": torch.ones(c.d_model, device=device),
                    "w_gate": w(c.d_model, c.ffn_dim, fan_in=c.d_model),
                    "w_up": w(c.d_model, c.ffn_dim, fan_in=c.d_model),
                    "w_down": w(c.ffn_dim, c.d_model, fan_in=c.ffn_dim),
                }
            )
        self.final_norm = torch.ones(c.d_model, device=device)
        self.lm_head = w(c.d_model, c.vocab_size, fan_in=c.d_model) * 4.0  # peaky logits, few near-ties

    @torch.inference_mode()
    def forward(
        self, tokens: Sequence[int], start_pos: int, block_table: Sequence[int], cache: PagedKVCache
    ) -> torch.Tensor:
        """Run ``tokens`` at positions ``start_pos..``; write their KV into the blocks; return the last
        position's logits ``[vocab]`` on the CPU.

        Ownership: the caller owns ``block_table``'s blocks for the call (they must cover
        ``start_pos + len(tokens)`` positions).
        """
        c = self.config
        n, length = len(tokens), start_pos + len(tokens)
        if n == 0 or length > c.max_model_len or c.blocks_for(length) > len(block_table):
            raise LocalProtocolError(
                "forward outside the request's blocks",
                field="tokens",
                n=n,
                start_pos=start_pos,
                blocks=len(block_table),
            )
        positions = torch.arange(start_pos, length)
        x = self.embed[torch.tensor(tokens, dtype=torch.long, device=self.device)]
        group = c.num_heads // c.num_kv_heads
        causal = positions[:, None].to(self.device) >= torch.arange(length, device=self.device)[None, :]
        for i, p in enumerate(self.layers):
            h = _rms_norm(x, p["attn_norm"])
            q = _rope((h @ p["wq"]).view(n, c.num_heads, c.head_dim), positions, c.rope_theta)
            k = _rope((h @ p["wk"]).view(n, c.num_kv_heads, c.head_dim), positions, c.rope_theta)
            v = (h @ p["wv"]).view(n, c.num_kv_heads, c.head_dim)
            cache.write(i, block_table, start_pos, k, v)
            keys, values = cache.gather(i, block_table, length)  # [S, kvh, hd], read back from the blocks
            keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, hd]
            values = values.repeat_interleave(group, dim=1).transpose(0, 1)
            scores = (q.transpose(0, 1) @ keys.transpose(1, 2)) / math.sqrt(c.head_dim)  # [H, T, S]
            scores = scores.masked_fill(~causal, float("-inf"))
            attn = (scores.softmax(-1) @ values).transpose(0, 1).reshape(n, c.num_heads * c.head_dim)
            x = x + attn @ p["wo"]
            h = _rms_norm(x, p["ffn_norm"])
            x = x + (torch.nn.functional.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]
        return (_rms_norm(x[-1], self.final_norm) @ self.lm_head).float().cpu()


_OUTPUT_INDEX = torch.tensor(OUTPUT_IDS, dtype=torch.long)


def sample(logits: torch.Tensor, *, temperature: float, top_p: float, seed: int, step: int) -> int:
    """Pick the next token (rule 5). Greedy (temperature 0) takes the first maximum."""
    allowed = logits[_OUTPUT_INDEX]
    if temperature == 0.0:
        return OUTPUT_IDS[int(torch.argmax(allowed))]
    probs = torch.softmax(allowed / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < top_p  # always keeps the first
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    mixed = int.from_bytes(hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest(), "little")
    g = torch.Generator().manual_seed(mixed & ((1 << 63) - 1))
    return OUTPUT_IDS[int(torch.multinomial(probs, 1, generator=g))]


def generate_reference(
    model: TinyLM,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[int]:
    """Single-process generation on a private cache: what any server must reproduce token for token."""
    c = model.config
    cache = PagedKVCache(c, c.blocks_for(len(prompt) + max_tokens), device=model.device)
    table = list(range(cache.num_blocks))[::-1]  # deliberately not 0..n: attention must use the table
    logits = model.forward(prompt, 0, table, cache)
    out = [sample(logits, temperature=temperature, top_p=top_p, seed=seed, step=0)]
    for step in range(1, max_tokens):
        logits = model.forward([out[-1]], len(prompt) + step - 1, table, cache)
        out.append(sample(logits, temperature=temperature, top_p=top_p, seed=seed, step=step))
    return out
