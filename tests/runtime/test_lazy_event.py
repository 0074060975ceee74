"""LazyEvent: the handles' cheap stand-in for threading.Event (INV-CMD2), under real threads.

Every wait is bounded; a waiter that misses a set() shows up as a False return, not as a hang."""

from __future__ import annotations

import threading

import pytest

from kvown.runtime.commands import LazyEvent


@pytest.mark.timeout(60)
def test_set_before_during_and_after_wait() -> None:
    e = LazyEvent()
    assert not e.is_set() and e.wait(0) is False and e.wait(0.01) is False
    e.set()
    assert e.is_set() and e.wait(0) and e.wait()


@pytest.mark.timeout(120)
def test_a_racing_set_is_never_missed() -> None:
    """INV-CMD2: 2000 rounds of one setter racing two waiters; each waiter sees the set at once."""
    for _ in range(2000):
        e = LazyEvent()
        results: list[bool] = []
        go = threading.Barrier(3)

        def waiter() -> None:
            go.wait(5)
            results.append(e.wait(5))

        threads = [threading.Thread(target=waiter) for _ in range(2)]
        for t in threads:
            t.start()
        go.wait(5)
        e.set()
        for t in threads:
            t.join(10)
        assert results == [True, True]


@pytest.mark.timeout(60)
def test_the_recheck_is_what_makes_it_safe(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted bug: a waiter that does not look at the flag after publishing its event misses a set
    that ran in between (forced here by setting the flag from inside the event's creation)."""
    e = LazyEvent()
    real_event = threading.Event

    def racing_event() -> threading.Event:
        e._flag = True  # set() runs after the first flag check, before the event is visible
        return real_event()

    monkeypatch.setattr(threading, "Event", racing_event)
    assert e.wait(0.05) is True  # the re-check sees it
    broken = LazyEvent()

    def no_recheck(self: LazyEvent, timeout: float | None = None) -> bool:
        if self._flag:
            return True
        self._event = threading.Event()
        return self._event.wait(timeout)

    monkeypatch.setattr(threading, "Event", lambda: (setattr(broken, "_flag", True), real_event())[1])
    assert no_recheck(broken, 0.05) is False  # the mutant misses it: the test can fail
