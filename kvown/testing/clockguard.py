"""A pytest helper that proves pure code never reads the real clock, sleeps or starts threads.

``forbid_real_clock(monkeypatch)`` replaces time.monotonic, time.monotonic_ns, time.perf_counter,
time.sleep and threading.Thread.start with versions that raise when called from kvown or from test
code (module names starting with ``kvown``, ``test_``, ``conftest`` or ``corekit``), and pass through
for third-party machinery (Hypothesis times its own phases, pytest-timeout reads the clock).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable

GUARDED_PREFIXES = ("kvown", "test_", "conftest", "corekit")


def _forbidden(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def guarded(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith(GUARDED_PREFIXES):
            raise AssertionError(f"{name} called from kvown or a core/sim test: pass now_ns instead")
        return original(*args, **kwargs)

    return guarded


def forbid_real_clock(monkeypatch: Any) -> None:
    """Called: from an autouse fixture, once per test."""
    for name in ("monotonic", "monotonic_ns", "perf_counter", "sleep"):
        monkeypatch.setattr(time, name, _forbidden(f"time.{name}", getattr(time, name)))
    monkeypatch.setattr(threading.Thread, "start", _forbidden("threading.Thread.start", threading.Thread.start))
