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


def _fail_stop_line(tmp_path: Path) -> str:
    """The line kvown's real fail-stop executor writes (the detector's contract), with its recorder."""
    import os

    from kvown.core.actions import FailStop, FatalReason
    from kvown.runtime.failstop import FailStopExecutor
    from kvown.runtime.flight import FlightRecorder

    read_fd, write_fd = os.pipe()
    executor = FailStopExecutor(None, FlightRecorder(rank=1), kill=lambda world, code: None, dump_dir=tmp_path,
                                diag_fd=write_fd)
    executor.execute(FailStop(FatalReason.CONTROL_LOST, None, "control stream to rank 0 is broken"))
    os.close(write_fd)
    line = os.read(read_fd, 4096).decode()
    os.close(read_fd)
    return line


def test_kvown_fail_stop_lines_are_read_from_the_real_executors_format(tmp_path):
    found = faults.kvown_fail_stops("INFO vllm noise\n" + _fail_stop_line(tmp_path) + "Traceback ...\n")
    assert [(f["rank"], f["reason"], f["flight_on_disk"]) for f in found] == [(1, "control_lost", True)]
    assert faults.kvown_fail_stops("INFO a clean log\n") == []


def test_a_fail_stopped_worker_counts_though_its_api_server_lives(tmp_path, monkeypatch):
    """The matrix's prefill-killed cell: the decode's worker fail-stopped (control_lost), its API server
    was still up, and the cell said 'fail_stops: []'. Mutant: read only whether the process lives."""
    from types import SimpleNamespace

    log = tmp_path / "decode-0.log"
    log.write_text("INFO starting\n" + _fail_stop_line(tmp_path))
    up = SimpleNamespace(alive=lambda: True, log_path=log, instance=SimpleNamespace(url="http://127.0.0.1:9"))
    stack = SimpleNamespace(instances={"decode-0": up})

    async def settle() -> dict:
        async with httpx.AsyncClient() as client:
            return await matrix().settle(stack, client)

    cell = asyncio.run(settle())
    assert cell["fail_stops"] == ["decode-0"] and cell["kvown_fail_stops"]["decode-0"][0]["reason"] == "control_lost"
    monkeypatch.setattr(faults, "kvown_fail_stops", lambda text: [])  # mutant: the process is alive, so "no fail-stop"
    assert asyncio.run(settle())["fail_stops"] == []
