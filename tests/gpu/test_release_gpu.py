"""On a CUDA device: ``release(rid, ready=token)`` keeps the blocks out of the pool while the consumer's
kernel (here a ``torch.cuda._sleep``, the decode kernel that is still reading) runs; its mutant - the
token dropped - retires them at once. The CPU twin is tests/runtime/test_driver.py."""

from __future__ import annotations

import time

import pytest
import torch

from gpukit import NEEDS_CUDA_KERNELS  # the canary fill at retirement runs kvown's CUDA kernels

from kvown import KVLayout, TransferConfig, WriteTracker, make_request_id
from kvown.runtime.driver import Driver
from kvown.testing.local import KillRecorder, local_world

pytestmark = NEEDS_CUDA_KERNELS
nixl = pytest.importorskip("nixl", reason="nixl is not installed (carry the nixl-cu13 wheel)")

LAYOUT = KVLayout.standard(num_layers=2, num_blocks=16, tokens_per_block=16, num_kv_heads=4, head_dim=64,
                           dtype="bfloat16")
SLEEP_CYCLES = 1_000_000_000  # ~0.5 s of GPU time: the decode kernel that still reads the blocks


def _held_while_the_reader_runs() -> bool:
    ranks = local_world({0: {"sender"}, 1: {"receiver"}}, layout=LAYOUT, device="cuda", kill=KillRecorder(),
                        config=TransferConfig(transfer_timeout_s=10.0, grace_s=10.0, canary=True))
    try:
        tx, rx = ranks[0], ranks[1]
        rid = make_request_id(4, 1)
        h = rx.receiver.receive(rid, 2, (0,))
        tx.sender.send(rid, (0, 1), ready=WriteTracker("cuda").record())
        assert h.landed.wait(30)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)  # the consumer's read, queued behind nothing else
        rx.receiver.release(rid, ready=WriteTracker("cuda").record(stream))
        time.sleep(0.1)
        held = not h.retired.is_set() and not stream.query()
        stream.synchronize()
        assert h.retired.wait(10)
        return held
    finally:
        for rt in ranks.values():
            rt.close()


@pytest.mark.timeout(120)
def test_release_waits_for_the_consumers_cuda_event() -> None:
    assert _held_while_the_reader_runs()


@pytest.mark.interpreted_only
@pytest.mark.timeout(120)
def test_the_gpu_release_check_catches_a_driver_that_drops_the_token(monkeypatch) -> None:
    original = Driver._release
    monkeypatch.setattr(Driver, "_release", lambda self, rid, issued_ns, ready: original(self, rid, issued_ns, None))
    assert not _held_while_the_reader_runs()
