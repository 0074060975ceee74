"""Fixtures for tests across test hosts (network namespaces on this machine, ``kvown.testing.hosts``).

``make_hosts(n, **options)`` builds N hosts and tears them down after the test, whatever happened
(a failure, a timeout that raises, Ctrl-C; a killed pytest is cleaned up by the harness's reaper and
by the stale-run sweep of the next run). Where namespaces cannot be made, the test is skipped with the
reason (not root, no ``ip``, no netns support).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvown.testing.hosts import HostsUnavailable, TestHosts, unavailable_reason  # noqa: E402


@pytest.fixture
def make_hosts():
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"test hosts unavailable: {reason}")
    made: list[TestHosts] = []

    def make(n: int, **options) -> TestHosts:
        try:
            hosts = TestHosts(n, **options).open()
        except HostsUnavailable as exc:
            pytest.skip(f"test hosts unavailable: {exc.reason}")
        made.append(hosts)
        return hosts

    try:
        yield make
    finally:
        for hosts in made:
            hosts.close()


@pytest.fixture
def hosts3(make_hosts) -> TestHosts:
    """Three test hosts (rank r of ``mpirun_command`` lands on host r % 3)."""
    return make_hosts(3)
