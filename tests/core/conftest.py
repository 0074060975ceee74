"""tests/core: the pure core never touches the real clock or threads; this fixture proves it.

Every test in this folder runs with time.monotonic, time.monotonic_ns, time.perf_counter, time.sleep and
threading.Thread.start replaced by functions that raise, so a core that reads a clock, sleeps or starts
a thread fails loudly here.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest


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
