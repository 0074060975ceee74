"""tests/core: the pure core never touches the real clock or threads; this fixture proves it.

Every test in this folder runs with time.monotonic, time.monotonic_ns, time.perf_counter, time.sleep and
threading.Thread.start replaced by functions that raise, so a core that reads a clock, sleeps or starts
a thread fails loudly here.
"""

from __future__ import annotations

import threading
import time

import pytest


def _forbidden(name: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{name} called from a pure-core/simulation test: the core must take now_ns")

    return refuse


@pytest.fixture(autouse=True)
def _no_real_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("monotonic", "monotonic_ns", "perf_counter", "sleep"):
        monkeypatch.setattr(time, name, _forbidden(f"time.{name}"))
    monkeypatch.setattr(threading.Thread, "start", _forbidden("threading.Thread.start"))
