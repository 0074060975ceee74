"""UCX between test hosts: TCP on eth0 with the harness's settings; shared memory without them (the check
must notice: namespaces share one kernel, so UCX happily picks ``cma`` between "hosts")."""

from __future__ import annotations

import argparse

import pytest

from kvown.apps import qualify

pytestmark = pytest.mark.multiproc


def scenario_network_checks(hosts) -> tuple[dict, dict]:
    launch = qualify._launch_for(argparse.Namespace(), hosts)
    checks, figures = qualify.run_scenarios(launch, "standard", "cpu", 200)
    return checks, figures


@pytest.mark.timeout(240)
def test_without_ucx_tls_the_transport_check_catches_shared_memory_between_hosts(make_hosts):
    hosts = make_hosts(3, ucx_tls=None)  # the planted bug: UCX left to choose on one shared kernel
    checks, figures = scenario_network_checks(hosts)
    assert all(v for name, c in checks.items() if name != "network" for v in c.values()), (
        checks
    )  # data fine ...
    pair_checks = {k: v for k, v in checks["network"].items() if k.startswith("pair_")}
    assert pair_checks and not all(pair_checks.values()), figures["ucx_pairs"]  # ... transport caught
    assert any(lane.startswith(("cma/", "posix/", "sysv/")) for lane in figures["ucx_lanes_seen"])
