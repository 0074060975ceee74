"""Bring-your-own KV memory over real NIXL in one process: the server owns the tensors and the allocator,
kvown keeps only ownership state and descriptors, and gives lent blocks back exactly once, at
retirement. Three layouts: vLLM-style per-layer paged tensors, TensorRT-LLM-style separate data and
scale pools, and kvown's own contiguous pool (with NVFP4 scales in a separate pool)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvown import BlockSpace, KVLayout, Outcome, Region, TransferConfig, make_request_id
from kvown.core.errors import LocalProtocolError, PeerProtocolError
from kvown.testing.local import KillRecorder, local_world

NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, LAYERS = 12, 4, 2, 8, 2


class ServerMemory:
    """What a server owns: its tensors, and an allocator that kvown hands blocks back to."""

    def __init__(self, kind: str, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.returned: list[tuple[int, tuple[int, ...]]] = []
        self.lock = threading.Lock()
        if kind == "vllm":  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
            self.tensors = [torch.rand(2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, generator=g) for _ in range(LAYERS)]
            regions = [Region.from_tensor(t[half], heads=HEADS, groups=BLOCK_SIZE)
                       for t in self.tensors for half in (0, 1)]
            self.space = BlockSpace.of_tensors(regions, [t[0] for t in self.tensors])
        else:  # TensorRT-LLM: KEY, VALUE, KEY_BLOCK_SCALE, VALUE_BLOCK_SCALE, one block index
            shapes = [(NUM_BLOCKS, HEADS, LAYERS * BLOCK_SIZE, HEAD_DIM // 2)] * 2 + [
                (NUM_BLOCKS, HEADS, LAYERS * BLOCK_SIZE, HEAD_DIM // 16 + 1)] * 2
            self.tensors = [torch.randint(0, 255, s, dtype=torch.uint8, generator=g) for s in shapes]
            self.space = BlockSpace.of_tensors([Region.from_tensor(t, heads=HEADS) for t in self.tensors],
                                               self.tensors)

    def on_returned(self, owner, blocks) -> None:  # engine thread: quick and thread-safe
        with self.lock:
            self.returned.append((owner, blocks))

    def block_bytes(self, block: int) -> list[torch.Tensor]:
        if len(self.tensors[0].shape) == 5:
            return [t[half, block].clone() for t in self.tensors for half in (0, 1)]
        return [t[block].clone() for t in self.tensors]


def world(kind_tx: str, kind_rx: str, fault: str | None = None, **config):
    tx, rx = ServerMemory(kind_tx, 1), ServerMemory(kind_rx, 2)
    ranks = local_world({0: {"sender"}, 1: {"receiver"}}, kill=KillRecorder(), fault=fault,
                        config=TransferConfig(transfer_timeout_s=2.0, **config),
                        memory={0: (tx.space, tx.on_returned), 1: (rx.space, rx.on_returned)})
    return ranks, tx, rx


def close(ranks) -> None:
    for rt in ranks.values():
        rt.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["vllm", "trtllm"])
def test_server_memory_transfers_byte_exact_and_comes_back_once(kind):
    ranks, tx, rx = world(kind, kind)
    try:
        rid = make_request_id(2, 1)
        src, dst = (5, 6, 7), (9, 0, 3)  # the servers' own allocators chose these
        h = ranks[1].receiver.receive(rid, None, (0,), blocks=dst)
        hs = ranks[0].sender.send(rid, src)
        assert h.landed.wait(10) and h.outcome.result(5) is Outcome.COMPLETED
        for s, d in zip(src, dst):
            for a, b in zip(tx.block_bytes(s), rx.block_bytes(d)):
                assert torch.equal(a, b)
        assert rx.returned == []  # landed, not released: still kvown's
        ranks[1].receiver.release(rid)
        assert h.retired.wait(10) and hs.released.wait(10)
        assert rx.returned == [(rid, dst)]  # exactly once, exactly the lent blocks
        assert ranks[1].engine.statistics().pool.to_dict() == {"total": NUM_BLOCKS, "free": NUM_BLOCKS, "owned": 0,
                                                        "held": 0}
    finally:
        close(ranks)


@pytest.mark.timeout(60)
def test_vllm_fan_in_writes_token_major_head_slices():
    """Two writers, one head each: a head of a token-major chunk is strided; every byte still lands."""
    tx0, tx1, rx = ServerMemory("vllm", 1), ServerMemory("vllm", 3), ServerMemory("vllm", 2)
    ranks = local_world({0: {"sender"}, 1: {"sender"}, 2: {"receiver"}}, kill=KillRecorder(),
                        config=TransferConfig(transfer_timeout_s=2.0),
                        memory={0: (tx0.space, tx0.on_returned), 1: (tx1.space, tx1.on_returned),
                                2: (rx.space, rx.on_returned)})
    try:
        rid = make_request_id(2, 2)
        h = ranks[2].receiver.receive(rid, None, (0, 1), num_slices=2, blocks=(4,))
        ranks[0].sender.send(rid, (1,))
        ranks[1].sender.send(rid, (2,))
        assert h.landed.wait(10)
        for i, t in enumerate(rx.tensors):
            for half in (0, 1):
                assert torch.equal(t[half, 4, :, 0], tx0.tensors[i][half, 1, :, 0])  # head 0 from writer 0
                assert torch.equal(t[half, 4, :, 1], tx1.tensors[i][half, 2, :, 1])  # head 1 from writer 1
        ranks[2].receiver.release(rid)
        assert h.retired.wait(10) and rx.returned == [(rid, (4,))]
    finally:
        close(ranks)


@pytest.mark.timeout(60)
def test_kvown_pool_with_separate_nvfp4_scales_moves_both_pools():
    layout = KVLayout.nvfp4(num_layers=1, num_blocks=8, tokens_per_block=16, num_kv_heads=2, head_dim=32,
                            scale_layout="separate")
    ranks = local_world({0: {"sender"}, 1: {"receiver"}}, layout=layout, kill=KillRecorder())
    try:
        tx_pool, rx_pool = ranks[0].engine.pool, ranks[1].engine.pool
        tx_pool.block_view(3).copy_(torch.arange(layout.block_nbytes) % 251)
        tx_pool.scales.block_view(3).copy_(torch.arange(tx_pool.scales.layout.block_nbytes) % 13 + 1)
        rid = make_request_id(2, 3)
        h = ranks[1].receiver.receive(rid, 1, (0,))
        ranks[0].sender.send(rid, (3,))
        assert h.landed.wait(10)
        b = h.blocks[0]
        assert torch.equal(rx_pool.block_view(b), tx_pool.block_view(3))
        assert torch.equal(rx_pool.scales.block_view(b), tx_pool.scales.block_view(3))
        ranks[1].receiver.release(rid)
        assert h.retired.wait(10)
    finally:
        close(ranks)


@pytest.mark.timeout(60)
def test_a_cancelled_destination_goes_back_only_after_the_writer_quiesced():
    ranks, tx, rx = world("vllm", "vllm", fault="slow-writer:nth=1:ms=400")
    try:
        rid = make_request_id(2, 4)
        h = ranks[1].receiver.receive(rid, None, (0,), blocks=(1, 2))
        ranks[0].sender.send(rid, (3, 4))
        deadline = time.monotonic() + 5
        while ranks[0].engine.statistics().writes_in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.002)
        ranks[1].receiver.cancel(rid)
        time.sleep(0.1)
        assert rx.returned == [] and ranks[1].engine.statistics().pool.held == 2  # the WRITE is in flight
        with pytest.raises(LocalProtocolError, match="two owners"):  # the server cannot lend them again yet
            ranks[1].receiver.receive(make_request_id(2, 5), None, (0,), blocks=(2,))
        assert h.retired.wait(10) and rx.returned == [(rid, (1, 2))]
    finally:
        close(ranks)


@pytest.mark.timeout(60)
def test_a_layout_mismatch_is_refused_at_the_handshake_naming_the_difference():
    with pytest.raises(PeerProtocolError) as info:
        world("vllm", "trtllm")
    assert info.value.field == "space" and "regions" in str(info.value)


@pytest.mark.timeout(60)
def test_server_memory_refuses_num_blocks_and_kvown_pool_refuses_blocks():
    ranks, tx, rx = world("vllm", "vllm")
    try:
        with pytest.raises(LocalProtocolError) as info:
            ranks[1].receiver.receive(make_request_id(2, 6), 2, (0,))
        assert info.value.field == "blocks"
    finally:
        close(ranks)
