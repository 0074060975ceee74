"""On a CUDA device: KV WRITEs from VRAM into VRAM over real NIXL (UCX cuda transports), gated by CUDA
events. Two ranks share one process and one GPU, as the CPU tests do with host memory.

Run by benchmarks/gpu_check.sh as two steps: ``-k vram_write`` (bytes land, checksums agree) and
``-k event_gating`` (no WRITE leaves before the event that ends the KV write, with a mutant that must
land stale bytes). Skipped with a reason where torch sees no CUDA device or nixl is missing.
"""

from __future__ import annotations

import pytest
import torch

from kvown import KVLayout, Outcome, TransferConfig, WriteTracker, make_request_id
from kvown.kernels import ops
from kvown.testing.local import KillRecorder, local_world

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]
nixl = pytest.importorskip("nixl", reason="nixl is not installed (carry the nixl-cu13 wheel)")

LAYOUT = KVLayout.nvfp4(num_layers=2, num_blocks=32, tokens_per_block=16, num_kv_heads=4, head_dim=64)
SLEEP_CYCLES = 2_000_000_000  # ~1 s of GPU time at ~2 GHz: the "KV write" that is still running


@pytest.fixture
def world():
    kill = KillRecorder()
    ranks = local_world({0: {"sender"}, 1: {"receiver"}}, layout=LAYOUT, device="cuda", kill=kill,
                        config=TransferConfig(transfer_timeout_s=10.0, grace_s=5.0), fault="")
    yield ranks[0], ranks[1], kill
    for rt in ranks.values():
        rt.close()


def _fill(tx, rid: int, blocks: tuple[int, ...]) -> None:
    for j, b in enumerate(blocks):
        ops.fill_pattern(tx.engine.pool.block_view(b), rid, 0, j)


def _landed_intact(rx, rid: int, blocks: tuple[int, ...]) -> bool:
    return all(ops.verify_pattern(rx.engine.pool.block_view(b), rid, 0, j) for j, b in enumerate(blocks))


@pytest.mark.timeout(120)
def test_vram_write_lands_every_block_intact(world) -> None:
    tx, rx, kill = world
    assert tx.engine.pool.tensor.is_cuda and rx.engine.pool.tensor.is_cuda
    tracker = WriteTracker("cuda")
    for seq, nblocks in enumerate((1, 4, 16), start=1):
        rid = make_request_id(3, seq)
        src = tuple(range(nblocks))
        h = rx.receiver.receive(rid, nblocks, (0,))
        _fill(tx, rid, src)
        hs = tx.sender.send(rid, src, ready=tracker.record())
        assert h.landed.wait(30), f"{nblocks} blocks never landed"
        torch.cuda.synchronize()
        assert _landed_intact(rx, rid, h.blocks)
        rx.receiver.release(rid)
        assert h.retired.wait(30) and hs.released.wait(30)
        assert hs.outcome.result(1) is Outcome.COMPLETED
    assert not kill.calls
    rx.engine.pool.check(deep=True)


def _gated_send(tx, rx, rid: int):
    """Enqueue a long kernel, then the KV write behind it, on a side stream; send with its event."""
    stream = torch.cuda.Stream()
    h = rx.receiver.receive(rid, 2, (0,))
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        _fill(tx, rid, (5, 6))
    token = WriteTracker("cuda").record(stream)
    tx.sender.send(rid, (5, 6), ready=token)
    return h, token, stream


@pytest.mark.timeout(120)
def test_event_gating_posts_no_write_before_the_event(world) -> None:
    tx, rx, kill = world
    rid = make_request_id(3, 10)
    h, token, stream = _gated_send(tx, rx, rid)
    assert not token.query(), "the sleep kernel ended before the check: raise SLEEP_CYCLES"
    assert tx.engine.call(lambda d: len(d._writes)) == 0  # REQUEST_DATA may be here; no WRITE is
    assert not h.landed.is_set()
    stream.synchronize()
    assert h.landed.wait(30)
    torch.cuda.synchronize()
    assert _landed_intact(rx, rid, h.blocks)
    rx.receiver.release(rid)
    assert h.retired.wait(30) and not kill.calls


@pytest.mark.timeout(120)
@pytest.mark.interpreted_only
def test_event_gating_mutant_lands_stale_bytes(world, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the INV-S1 guard removed, the WRITE reads the source before the KV write ran: caught."""
    from kvown.core import sender

    monkeypatch.setattr(sender.SenderCore, "_source_ready", lambda self, s, op: True)
    tx, rx, _ = world
    rid = make_request_id(3, 11)
    h, token, stream = _gated_send(tx, rx, rid)
    assert h.landed.wait(30)
    landed_early = not token.query()
    stream.synchronize()
    torch.cuda.synchronize()
    assert landed_early and not _landed_intact(rx, rid, h.blocks)
    rx.receiver.release(rid)
    assert h.retired.wait(30)
