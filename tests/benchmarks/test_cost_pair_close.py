"""Closing the cost pair cancels no control frame: frames one rank sent and the other never stepped
for (the levers' burst of publications) sit in the sender's UCX until both agents are progressed.
Closing one endpoint first canceled each of them, and NIXL logged "UCX AM send failed with status -16"
per frame: 1,285 error lines in every ``kvown bench`` suite run. ``Pair.close`` settles them first
(``Pair.settle_frames``). The check reads NIXL's own log over real NIXL, in a child process: NIXL's
logger holds its own stderr, which pytest's fd capture does not see."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

FRAMES = 64
CANCELED = "status -16"
CHILD = """
import sys
from dataclasses import replace
from kvown.apps.benchmarks.cost import KIB, Pair, PairSpec, Rids
if sys.argv[1] == "mutant":  # the bug: close each endpoint while its peer still holds our frames
    Pair.settle_frames = lambda self: 0
pair = Pair(replace(PairSpec(), block_nbytes=4 * KIB, num_blocks={n} + 8, batch=False))
try:
    for rid in Rids(epoch=2).take({n}):
        pair.rx.submit_receive(rid, 1, (0,))
    pair.step(1)  # the receiver publishes: one frame per session; the sender never steps
    print("sent", pair.drivers[1].stats["control_sent"])
finally:
    pair.close()
""".format(n=FRAMES)


def _burst_then_close(mode: str) -> tuple[str, str]:
    env = dict(os.environ, NIXL_LOG_LEVEL="WARN")
    done = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, done.stderr


@pytest.mark.timeout(150)
def test_closing_the_pair_cancels_no_frame() -> None:
    out, err = _burst_then_close("settle")
    assert f"sent {FRAMES}" in out
    assert CANCELED not in err, err[-2000:]


@pytest.mark.timeout(150)
def test_mutant_closing_without_settling_cancels_the_frames() -> None:
    out, err = _burst_then_close("mutant")
    assert f"sent {FRAMES}" in out
    assert err.count(CANCELED) >= FRAMES // 2, err[-2000:]
