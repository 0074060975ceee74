"""tests/sim: seeded simulated worlds. No real clock, no threads (an autouse fixture makes them raise).

Options:
  --kvown-seed N    replay exactly one seed (prints its decision log on failure)
  --kvown-seeds N   how many seeds to run (default 1000: the CI budget)
"""

from __future__ import annotations

import pytest

from kvown.testing.clockguard import forbid_real_clock

DEFAULT_SEEDS = 1000


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


@pytest.fixture(autouse=True)
def _no_real_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_real_clock(monkeypatch)
