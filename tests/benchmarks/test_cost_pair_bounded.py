"""The cost pair over the fake NIXL library keeps no state per finished session: its fabric prunes
finished WRITEs and records none for oracles. A fake that kept every WRITE grew the heap the cyclic
collector walks (its full collections of ~235,000 objects took ~100 ms each), so the instruction counts
of docs/benchmarks.md charged the fake's garbage to kvown."""

from __future__ import annotations

import pytest

from kvown.apps.benchmarks.cost import Pair, PairSpec, Rids
from kvown.testing.fake_nixl import FakeFabric

SESSIONS, WINDOW = 600, 4
BOUND = 2 * WINDOW + 64  # what the fabric may keep: WRITEs in flight, finished ones not yet pruned


def _tracked_after_run() -> tuple[int, list]:
    pair = Pair(PairSpec(fake=True))
    try:
        pair.run(Rids().take(SESSIONS), 1, WINDOW)
        return pair.fabric.tracked_writes, pair.fabric.take_posted()
    finally:
        pair.close()


@pytest.mark.timeout(120)
def test_a_long_run_keeps_only_the_writes_in_flight() -> None:
    tracked, posted = _tracked_after_run()
    assert tracked <= BOUND, tracked
    assert posted == []  # record_posted=False: nobody reads it here


@pytest.mark.timeout(120)
def test_mutant_a_fabric_that_never_prunes_is_caught(monkeypatch) -> None:
    monkeypatch.setattr(FakeFabric, "_prune_xfers", lambda self: None)
    tracked, _ = _tracked_after_run()
    assert tracked > BOUND  # every WRITE of the run is still there (several sessions may share one)
