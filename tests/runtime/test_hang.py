"""Hang detector. In-process tests use ``c_backstop=False`` (pytest owns faulthandler's timer);
the C backstop is tested in a child process whose main thread holds the GIL inside a C call."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kvown.core.actions import FailStop, FatalReason
from kvown.core.errors import ConfigError
from kvown.runtime.flight import FlightRecorder
from kvown.runtime.hang import HangDetector

ROOT = Path(__file__).resolve().parents[2]


class Executor:
    def __init__(self, raises: BaseException | None = None) -> None:
        self.actions: list[FailStop] = []
        self.called = threading.Event()
        self.raises = raises

    def execute(self, action: FailStop) -> None:
        self.actions.append(action)
        self.called.set()
        if self.raises is not None:
            raise self.raises


def detector(ex: Executor, rec: FlightRecorder | None = None, timeout_s: float = 0.1) -> HangDetector:
    return HangDetector(timeout_s=timeout_s, executor=ex, recorder=rec, poll_s=0.01, c_backstop=False).start()


@pytest.mark.timeout(10)
def test_disarmed_until_the_first_heartbeat() -> None:
    ex = Executor()
    hd = detector(ex)
    try:
        assert not ex.called.wait(0.4)
    finally:
        hd.stop()


@pytest.mark.timeout(10)
def test_lapse_reports_once_with_stacks_and_a_hang_fatal() -> None:
    ex, rec = Executor(), FlightRecorder(rank=0)
    hd = detector(ex, rec)
    try:
        hd.heartbeat()
        assert ex.called.wait(2)
        time.sleep(0.2)  # no second report for the same deadline
        assert [a.reason for a in ex.actions] == [FatalReason.HANG] and hd.reports == 1
        hang = [e for e in rec.events() if e[1] == "hang"]
        assert len(hang) == 1
        stacks = hang[0][3]["stacks"]
        assert "MainThread" in stacks and "kvown-hang" in stacks
        assert any("test_lapse_reports_once" in frame for frame in stacks["MainThread"])
    finally:
        hd.stop()


@pytest.mark.timeout(10)
def test_regular_heartbeats_keep_it_quiet() -> None:
    ex = Executor()
    hd = detector(ex, timeout_s=0.15)
    try:
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            hd.heartbeat()
            time.sleep(0.01)
        assert ex.actions == []
    finally:
        hd.stop()


@pytest.mark.timeout(10)
def test_pause_suppresses_detection_and_rearms_on_exit() -> None:
    ex = Executor()
    hd = detector(ex)
    try:
        hd.heartbeat()
        with hd.pause():
            time.sleep(0.4)
            assert ex.actions == []
        assert ex.called.wait(2)  # re-armed by the pause's exit
    finally:
        hd.stop()


@pytest.mark.timeout(10)
def test_watcher_survives_a_failing_report() -> None:
    ex = Executor(raises=RuntimeError("kill route broke"))
    hd = detector(ex)
    try:
        hd.heartbeat()
        assert ex.called.wait(2)
        ex.called.clear()
        hd.heartbeat()  # a new deadline: reported again, by the same watcher
        assert ex.called.wait(2)
        assert hd.reports == 2 and len(hd.report_errors) == 2
    finally:
        hd.stop()


@pytest.mark.timeout(5)
def test_timeout_must_be_positive() -> None:
    with pytest.raises(ConfigError):
        HangDetector(timeout_s=0.0)
    with pytest.raises(ConfigError):
        HangDetector(timeout_s=float("nan"))


@pytest.mark.timeout(5)
def test_backstop_margin_exceeds_rearm_interval() -> None:
    for t in (0.2, 5.0, 300.0):
        hd = HangDetector(timeout_s=t, c_backstop=False)
        assert hd.margin_s > hd.rearm_interval_s


@pytest.mark.timeout(30)
def test_c_backstop_kills_while_a_c_call_holds_the_gil(tmp_path) -> None:
    marker = tmp_path / "python-tier-fired"
    code = textwrap.dedent(
        f"""
        import time
        from kvown.runtime.hang import HangDetector

        class Marker:
            def execute(self, action):
                open({str(marker)!r}, "w").close()

        hd = HangDetector(timeout_s=0.3, margin_s=0.3, poll_s=0.01, executor=Marker()).start()
        hd.heartbeat()
        print("hanging", flush=True)
        sum(range(10**13))  # one C call: the GIL is never released, no Python thread can run
        print("finished")
        """
    )
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=25,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1  # faulthandler's _exit(1)
    assert "hanging" in proc.stdout and "finished" not in proc.stdout
    assert "Timeout" in proc.stderr and "most recent call first" in proc.stderr
    assert not marker.exists()  # the Python tier really was starved: only the C timer acted
    assert elapsed < 10
