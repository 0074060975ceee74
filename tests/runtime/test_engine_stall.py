"""The engine records a turn of its loop that took far longer than its nap (issue 19 item 1): the
flight recorder's evidence that the thread got no CPU - starvation - rather than a frame held
somewhere while the engine ran."""

from __future__ import annotations

import itertools
import threading
from types import SimpleNamespace

import pytest

from kvown.runtime.config import TransferConfig
from kvown.runtime.engine import STALL_NS, Engine


class _Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def record(self, kind: str, request_id: int | None, **detail: object) -> None:
        self.events.append((kind, detail))


def _run_engine(clock_steps_ns: list[int], turns: int) -> list[tuple[str, dict]]:
    """Run the real loop over a driver that never moves, on a clock that advances by the given steps."""
    recorder = _Recorder()
    done = threading.Event()
    count = itertools.count()

    def step(now_ns: int, frames_first: bool = False) -> bool:
        if next(count) >= turns:
            done.set()
        return False

    driver = SimpleNamespace(rank=0, fatal=None, recorder=recorder, step=step,
                             config=TransferConfig(spin_s=0.0, idle_sleep_s=0.0))
    ticks = itertools.accumulate(itertools.chain(clock_steps_ns, itertools.repeat(1_000)))
    engine = Engine(driver, fail_stop=lambda action: None,  # type: ignore[arg-type]
                    clock=lambda: next(ticks))
    engine.start()
    assert done.wait(10)
    engine.stop()
    return recorder.events


@pytest.mark.timeout(30)
def test_a_late_turn_is_recorded_as_a_stall() -> None:
    jump_ns = 3 * STALL_NS
    events = _run_engine([0, 1_000, 1_000, jump_ns], turns=20)
    stalls = [d for kind, d in events if kind == "engine_stall"]
    assert len(stalls) == 1
    assert jump_ns // 1000 <= stalls[0]["gap_us"] <= jump_ns // 1000 + 10


@pytest.mark.timeout(30)
def test_a_steady_loop_records_nothing() -> None:
    assert _run_engine([0], turns=50) == []
