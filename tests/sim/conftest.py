"""tests/sim: seeded simulated worlds. No real clock, no threads (an autouse fixture makes them raise).

Options:
  --kvown-seed N    replay exactly one seed (prints its decision log on failure)
  --kvown-seeds N   how many seeds to run (default 200; CI runs at least 200 in well under 60 s)
"""

from __future__ import annotations

import sys
import threading
import time

import pytest

DEFAULT_SEEDS = 200


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvown simulation")
    group.addoption("--kvown-seed", type=int, default=None, help="replay one simulator seed")
    group.addoption("--kvown-seeds", type=int, default=DEFAULT_SEEDS, help="how many simulator seeds to run")


@pytest.fixture
def sim_seeds(request: pytest.FixtureRequest) -> list[int]:
    """The seeds to run: the one given by --kvown-seed, else range(--kvown-seeds)."""
    one = request.config.getoption("--kvown-seed", default=None)
    if one is not None:
        return [one]
    return list(range(request.config.getoption("--kvown-seeds", default=DEFAULT_SEEDS)))


def _forbidden(name: str, original):
    """Raise when kvown or a test calls it; pass through for third-party machinery (Hypothesis times
    its own phases with perf_counter, pytest-timeout may read the clock)."""

    def guarded(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith(("kvown", "test_", "conftest", "corekit")):
            raise AssertionError(f"{name} called from kvown or a core/sim test: pass now_ns instead")
        return original(*args, **kwargs)

    return guarded


@pytest.fixture(autouse=True)
def _no_real_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("monotonic", "monotonic_ns", "perf_counter", "sleep"):
        monkeypatch.setattr(time, name, _forbidden(f"time.{name}", getattr(time, name)))
    monkeypatch.setattr(threading.Thread, "start", _forbidden("threading.Thread.start", threading.Thread.start))
