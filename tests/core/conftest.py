"""tests/core: the pure core never touches the real clock or threads; this fixture proves it.

Every test in this folder runs with time.monotonic, time.monotonic_ns, time.perf_counter, time.sleep and
threading.Thread.start replaced by functions that raise, so a core that reads a clock, sleeps or starts
a thread fails loudly here.
"""

from __future__ import annotations

import pytest

from kvown.testing.clockguard import forbid_real_clock


@pytest.fixture(autouse=True)
def _no_real_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_real_clock(monkeypatch)
