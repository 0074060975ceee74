"""The fault matrix's detector, fast (fake vLLM, no model): a completed answer that differs from the
oracle is a mismatch, a request with no end within the bound is hung, one we left is abandoned (and
the upstream saw it go), and the summary counts each. Each check with its mutant."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from fakevllm import AppThread, FakeVllm

from kvown.apps.serve.vllm import faults


def matrix() -> faults.Matrix:
    return faults.Matrix("nixl", "m", {0: [1, 2, 3], 1: [4, 5, 6]}, [[9], [8]], Path("."),
                         bound_s=1.0, idle_s=1.0, quick=True)


def detector_counts(m: faults.Matrix) -> dict:
    m.record("c", 0, ("completed", [1, 2, 3], ""), 0.1)
    m.record("c", 1, ("completed", [4, 5, 7], ""), 0.1)  # served corruption: the last token differs
    m.record("c", 1, ("error", [4], "HTTP 502"), 0.1)  # an error is not a mismatch, whatever it streamed
    m.record("c", 0, ("hung", [], ""), 1.0)
    s = m.summary()
    return {k: s[k] for k in ("requests", "completed", "errors", "hung", "token_mismatches")}


def test_detector_counts_each_outcome():
    assert detector_counts(matrix()) == {"requests": 4, "completed": 2, "errors": 1, "hung": 1,
                                         "token_mismatches": 1}


def test_detector_check_catches_a_detector_that_trusts_completed_answers(monkeypatch):
    real = faults.Matrix.record

    def trusting(self, cell, prompt, result, seconds):  # mutant: a completed answer is never compared
        real(self, cell, prompt, result, seconds)
        self.outcomes[-1].mismatch = False

    monkeypatch.setattr(faults.Matrix, "record", trusting)
    assert detector_counts(matrix())["token_mismatches"] == 0


async def _one(url: str, **kw):
    async with httpx.AsyncClient(timeout=30) as client:
        return await faults.stream_one(client, url, [1, 2, 3], **kw)


def hung_is_bounded(bound_s: float) -> tuple[str, float]:
    d = FakeVllm("d", delay_s=30.0)  # never answers within the bound
    with AppThread(d.app()) as t:
        loop_t0 = asyncio.run(_timed(f"http://127.0.0.1:{t.port}", bound_s))
    return loop_t0


async def _timed(url: str, bound_s: float) -> tuple[str, float]:
    import time

    t0 = time.monotonic()
    status, _, _ = await _one(url, bound_s=bound_s)
    return status, time.monotonic() - t0


def test_a_request_with_no_end_is_hung_within_its_bound():
    status, seconds = hung_is_bounded(1.0)
    assert status == "hung" and seconds < 5


def test_leaving_is_abandoned_and_the_upstream_sees_it():
    d = FakeVllm("d", token_delay_s=0.05)
    with AppThread(d.app()) as t:
        url = f"http://127.0.0.1:{t.port}"
        status, _, _ = asyncio.run(_one(url, leave_after_s=0.3))
        done = asyncio.run(_one(url, bound_s=10))
        import time

        time.sleep(0.3)
    assert status == "abandoned" and d.seen[0].aborted
    assert done[0] == "error" and "stream ended" in done[2]  # the fake streams no token ids: not complete


def test_table_names_the_baseline_fix():
    report = {"connectors": {"nixl": {**matrix().summary(), "seconds": 1}}}
    assert "nixl (baseline fix)" in faults.table(report)
