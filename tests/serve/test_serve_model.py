"""The reference model and the server's own KV memory: paged attention is right, block ids do not
matter, sampling is reproducible across processes, and the allocator's accounting cannot be broken."""

from __future__ import annotations

import math

import pytest
import torch

from kvown.apps.serve.model import (
    OUTPUT_IDS,
    BlockAllocator,
    ByteTokenizer,
    ModelConfig,
    OutOfBlocks,
    PagedKVCache,
    TinyLM,
    generate_reference,
    sample,
)
from kvown.core.errors import ConfigError, LocalProtocolError

CONFIG = ModelConfig(block_size=4)


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return TinyLM(CONFIG)


def _dense_logits(model: TinyLM, tokens: list[int]) -> torch.Tensor:
    """The same network with no cache at all: one forward over the whole sequence in fresh blocks."""
    cache = PagedKVCache(CONFIG, CONFIG.blocks_for(len(tokens)))
    return model.forward(tokens, 0, list(range(cache.num_blocks)), cache)


def test_incremental_paged_decode_matches_a_dense_forward(model):
    tokens = ByteTokenizer().encode("paged attention must not change the answer")
    cache = PagedKVCache(CONFIG, 64)
    table = [50, 3, 17, 9, 41, 22, 8, 60, 1, 33, 12]  # scattered blocks
    model.forward(tokens[:5], 0, table, cache)
    for pos in range(5, len(tokens)):
        paged = model.forward([tokens[pos]], pos, table, cache)
        dense = _dense_logits(model, tokens[: pos + 1])
        assert torch.allclose(paged, dense, atol=1e-4), pos


def test_kv_copied_into_other_block_ids_computes_identical_bits(model):
    prompt = ByteTokenizer().encode("the same bytes in other blocks")
    a, b = PagedKVCache(CONFIG, 32), PagedKVCache(CONFIG, 32)
    ta, tb = list(range(8)), [31, 5, 20, 11, 2, 27, 14, 9]
    model.forward(prompt, 0, ta, a)
    for la, lb in zip(a.layers, b.layers, strict=True):
        lb[:, tb] = la[:, ta]  # what the KV link does, byte for byte
    tok = sample(
        model.forward(prompt, 0, ta, PagedKVCache(CONFIG, 32)), temperature=0, top_p=1, seed=0, step=0
    )
    assert torch.equal(model.forward([tok], len(prompt), ta, a), model.forward([tok], len(prompt), tb, b))


def test_same_seed_same_weights_and_greedy_is_stable(model):
    again = TinyLM(CONFIG)
    assert torch.equal(model.embed, again.embed) and torch.equal(model.lm_head, again.lm_head)
    other = TinyLM(ModelConfig(block_size=4, seed=1))
    assert not torch.equal(model.embed, other.embed)
    prompt = ByteTokenizer().encode("hello")
    out = generate_reference(model, prompt, 20)
    assert out == generate_reference(again, prompt, 20)
    assert all(t in OUTPUT_IDS for t in out)
    assert ByteTokenizer().decode(out).isascii()


def test_sampling_is_a_pure_function_of_seed_and_step():
    logits = torch.randn(256, generator=torch.Generator().manual_seed(0))
    draws = [sample(logits, temperature=1.0, top_p=0.9, seed=7, step=s) for s in range(50)]
    assert draws == [sample(logits, temperature=1.0, top_p=0.9, seed=7, step=s) for s in range(50)]
    assert len(set(draws)) > 3  # it does sample
    assert draws != [sample(logits, temperature=1.0, top_p=0.9, seed=8, step=s) for s in range(50)]
    top = OUTPUT_IDS[int(torch.argmax(logits[list(OUTPUT_IDS)]))]
    assert sample(logits, temperature=0.0, top_p=1.0, seed=1, step=3) == top
    assert {sample(logits, temperature=1.0, top_p=1e-6, seed=1, step=s) for s in range(20)} == {top}


def test_config_digest_names_architecture_and_seed():
    assert ModelConfig().digest() == ModelConfig().digest()
    assert ModelConfig().digest() != ModelConfig(seed=1).digest()
    with pytest.raises(ConfigError) as caught:
        ModelConfig(num_heads=3, num_kv_heads=2)
    assert caught.value.field == "num_kv_heads"


def test_forward_outside_the_blocks_is_refused(model):
    cache = PagedKVCache(CONFIG, 4)
    with pytest.raises(LocalProtocolError):
        model.forward([1] * 9, 0, [0, 1], cache)  # 9 tokens need 3 blocks of 4


def test_allocator_accounting_and_illegal_moves_change_nothing():
    alloc = BlockAllocator(8)
    a = alloc.allocate(3)
    alloc.lend(a[:2])
    before = alloc.statistics()
    assert before == {"total": 8, "free": 5, "in_use": 1, "lent": 2, "peak_used": 3}
    for bad in (
        lambda: alloc.free(a[:2]),  # lent blocks are the link's, not the server's
        lambda: alloc.give_back(a[2:]),  # never lent
        lambda: alloc.free([a[2], a[2]]),
        lambda: alloc.free([a[2], 7]),  # one good, one free: nothing may change
        lambda: alloc.lend([99]),
    ):
        with pytest.raises(LocalProtocolError):
            bad()
        assert alloc.statistics() == before
    alloc.give_back(a[:2])
    alloc.free(a[2:])
    assert alloc.statistics()["free"] == 8
    with pytest.raises(OutOfBlocks):
        alloc.allocate(9)


def test_chunks_cover_each_block_exactly_once():
    cache = PagedKVCache(CONFIG, 5)
    seen = torch.zeros(sum(t.numel() * t.element_size() for t in cache.layers), dtype=torch.int32)
    sizes = [t.numel() * t.element_size() for t in cache.layers]
    for b in range(5):
        chunks = cache.chunks(b)
        assert sum(n for _, _, n in chunks) == cache.block_nbytes
        for region, offset, n in chunks:
            base = sum(sizes[:region])
            seen[base + offset : base + offset + n] += 1
    assert torch.all(seen == 1)
    # and the chunk for (layer 1, V, block 3) really is that tensor slice
    layer = cache.layers[1]
    layer[1, 3] = 7.0
    region, offset, n = cache.chunks(3)[3]
    flat = layer.view(-1).view(torch.uint8)[offset : offset + n]
    assert region == 1 and torch.all(flat.view(torch.float32) == 7.0)
    assert math.prod(layer[1, 3].shape) * 4 == n
