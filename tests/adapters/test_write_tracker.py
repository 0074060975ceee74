"""Ready-token semantics of WriteTracker, on host events (always) and CUDA events (with a GPU)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvown.adapters.cuda import CudaReadyToken, HostReadyToken, ReadyToken, WriteTracker
from kvown.core.errors import ConfigError, LocalProtocolError

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@pytest.mark.timeout(10)
def test_cpu_record_is_done_at_once() -> None:
    token = WriteTracker("cpu").record()
    assert isinstance(token, ReadyToken)
    assert token.query() is True
    assert token.wait(0) is True


@pytest.mark.timeout(10)
def test_pending_token_is_not_done_until_signalled_and_then_stays_done() -> None:
    tracker = WriteTracker()
    token = tracker.pending()
    assert tracker.poll([token]) == [False]
    started = time.monotonic()
    assert token.wait(0.05) is False
    assert time.monotonic() - started < 5  # bounded
    token.signal()
    token.signal()  # idempotent
    assert tracker.poll([token, token]) == [True, True]
    assert token.wait(0) is True


@pytest.mark.timeout(10)
def test_poll_keeps_order_over_mixed_tokens() -> None:
    tracker = WriteTracker()
    tokens = [tracker.pending(), tracker.record(), tracker.pending()]
    tokens[2].signal()  # type: ignore[union-attr]
    assert tracker.poll(tokens) == [False, True, True]
    assert tracker.poll([]) == []


@pytest.mark.timeout(10)
def test_wait_returns_when_another_thread_signals() -> None:
    token = WriteTracker().pending()
    signaller = threading.Timer(0.02, token.signal)
    signaller.start()
    try:
        assert token.wait(5.0) is True
    finally:
        signaller.join(5.0)


@pytest.mark.timeout(10)
def test_a_write_gated_by_the_token_is_never_posted_before_the_producer_signals() -> None:
    # A tiny sender loop: it "posts" (copies the source) only when poll says the producer is done.
    # The producer writes in two halves with a pause, so an early post would see half the bytes.
    tracker = WriteTracker()
    source = torch.zeros(1 << 16, dtype=torch.uint8)
    token = tracker.pending()

    def produce() -> None:
        source[: 1 << 15].fill_(0xAB)
        time.sleep(0.02)
        source[1 << 15 :].fill_(0xAB)
        token.signal()

    producer = threading.Thread(target=produce, name="test-producer")
    posted: list[torch.Tensor] = []
    polls_before_post = 0
    producer.start()
    deadline_s = time.monotonic() + 5.0
    while not posted and time.monotonic() < deadline_s:
        if tracker.poll([token]) == [True]:
            posted.append(source.clone())
        else:
            polls_before_post += 1
            time.sleep(0.001)
    producer.join(5.0)
    assert len(posted) == 1
    assert bool((posted[0] == 0xAB).all())
    assert polls_before_post > 0  # the gate was actually closed for a while


@pytest.mark.timeout(10)
def test_bad_arguments_raise_typed_errors() -> None:
    token = HostReadyToken()
    for bad in (-1, float("inf"), float("nan"), None, True):
        with pytest.raises(LocalProtocolError) as raised:
            token.wait(bad)  # type: ignore[arg-type]
        assert raised.value.fields["field"] == "timeout_s"
    with pytest.raises(ConfigError):
        WriteTracker("meta")
    with pytest.raises(LocalProtocolError) as local:
        WriteTracker().record(stream=object())  # type: ignore[arg-type]
    assert local.value.fields["field"] == "stream"


@pytest.mark.timeout(10)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where CUDA is absent")
def test_cuda_tracker_without_a_device_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as raised:
        WriteTracker("cuda")
    assert raised.value.fields["field"] == "device"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.timeout(60)
def test_cuda_token_is_not_done_while_the_stream_is_busy() -> None:
    tracker = WriteTracker("cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # keep the stream busy for a while (~0.1 s on current GPUs)
        token = tracker.record(stream)
    assert isinstance(token, CudaReadyToken)
    assert tracker.poll([token]) == [False]
    assert token.wait(30.0) is True
    assert tracker.poll([token]) == [True]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.timeout(60)
def test_cuda_token_covers_the_write_recorded_before_it() -> None:
    tracker = WriteTracker("cuda")
    stream = torch.cuda.Stream()
    destination = torch.zeros(1 << 24, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        destination.fill_(0x5A)
        token = tracker.record()  # current stream is `stream` here
    assert token.wait(30.0) is True
    assert bool((destination == 0x5A).all())  # read on the default stream after the token said done
