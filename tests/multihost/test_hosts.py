"""The test-host harness itself: isolation, placement under mpirun, link faults, and teardown."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from hostkit import ROOT

from kvown.testing import hosts as hostsmod
from kvown.testing.hosts import TestHosts

RANGE = ipaddress.ip_network("198.18.0.0/15")


def netns_list() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10).stdout
    return {line.split(":", 2)[1].strip().split("@")[0] for line in out.splitlines()}


def addresses(ns: str | None = None) -> list[tuple[str, str]]:
    cmd = ["ip", "-o", "-4", "addr", "show"] if ns is None else ["ip", "-n", ns, "-o", "-4", "addr", "show"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
    return [(line.split()[1], line.split()[3].split("/")[0]) for line in out.splitlines()]


def gone(h: TestHosts) -> bool:
    return not (set(h.names) & netns_list()) and not any(
        name.startswith(f"kvwn{h.run_id}") for name in links()
    )


def test_unavailable_reason_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in hostsmod.unavailable_reason()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(hostsmod.shutil, "which", lambda tool: None if tool == "ip" else "/bin/" + tool)
    assert "'ip'" in hostsmod.unavailable_reason()


def test_addresses_live_only_on_the_namespaces_and_the_bridge(make_hosts):
    h = make_hosts(3)
    ours = [(dev, a) for dev, a in addresses() if ipaddress.ip_address(a) in h.subnet]
    assert ours == [(h.bridge, h.bridge_address)]
    assert h.subnet.subnet_of(RANGE)
    for host in h.hosts:
        assert sorted(addresses(host.name)) == sorted([("lo", "127.0.0.1"), ("eth0", host.address)])
    assert len(set(h.names)) == 3 and all(n.startswith(f"kvown-{h.run_id}-") for n in h.names)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_mpirun_runs_one_daemon_and_one_rank_per_host(make_hosts):
    h = make_hosts(3)
    probe = (
        "import json, os, socket; from mpi4py import MPI; "
        "ppid = os.getppid(); comm = open(f'/proc/{ppid}/comm').read().strip(); "
        "print('RANK', json.dumps([MPI.COMM_WORLD.Get_rank(), socket.gethostname(), ppid, comm, "
        "os.readlink('/proc/self/ns/net')]), flush=True)"
    )
    proc = subprocess.run(
        h.mpirun_command(3) + [sys.executable, "-c", probe],
        env=h.env(),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = sorted(json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("RANK "))
    assert [r[1] for r in ranks] == h.placement(3) == h.names  # rank r on host r
    assert all(r[3] == "prted" for r in ranks)  # each rank is a child of a real PRRTE daemon ...
    assert len({r[2] for r in ranks}) == 3  # ... one per host
    assert len({r[4] for r in ranks}) == 3  # in three network namespaces
    assert os.readlink("/proc/self/ns/net") not in {r[4] for r in ranks}


LISTEN = (
    "import socket, sys; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
    "s.bind(('0.0.0.0', 7777)); s.listen(8); print('up', flush=True); s.settimeout(20)\n"
    "while True:\n    c, _ = s.accept(); c.close()"
)
CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], 7777), timeout=1.5).close()"


def test_link_down_cuts_a_host_off_and_link_up_restores_it(make_hosts):
    h = make_hosts(2)
    server = subprocess.Popen(
        ["ip", "netns", "exec", h.hosts[0].name, sys.executable, "-c", LISTEN],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout.readline().strip() == "up"

        def reach() -> bool:
            return h.exec(1, sys.executable, "-c", CONNECT, h.hosts[0].address, check=False).returncode == 0

        assert reach()
        h.link_down(0)
        assert not reach()
        h.link_up(0)
        end = time.monotonic() + 10
        while not reach() and time.monotonic() < end:  # the link needs a moment to come back
            time.sleep(0.1)
        assert reach()
    finally:
        server.kill()
        server.wait(10)
        server.stdout.close()


def test_teardown_after_an_exception_leaves_nothing(tmp_path):
    if hostsmod.unavailable_reason():
        pytest.skip(hostsmod.unavailable_reason())
    with pytest.raises(RuntimeError, match="test failed"), TestHosts(2, work_dir=tmp_path) as h:
        assert set(h.names) <= netns_list()
        raise RuntimeError("test failed")
    assert gone(h)
    assert not h.run_dir.exists()
    assert not (hostsmod.STATE_DIR / f"{h.run_id}.json").exists()


OWNER = (
    "import sys, time; from kvown.testing.hosts import TestHosts\n"
    "h = TestHosts(2, reaper=sys.argv[1] == 'reaper').open()\n"
    "print(h.run_id, flush=True); time.sleep(60)"
)


def start_owner(mode: str) -> tuple[subprocess.Popen, str]:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, mode],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    run_id = owner.stdout.readline().strip()
    owner.stdout.close()
    return owner, run_id


def wait_gone(names: list[str], run_id: str, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if not (set(names) & netns_list()) and not any(n.startswith(f"kvwn{run_id}") for n in links()):
            return True
        time.sleep(0.1)
    return False


def test_an_owner_killed_with_sigkill_is_cleaned_up_by_its_reaper():
    if hostsmod.unavailable_reason():
        pytest.skip(hostsmod.unavailable_reason())
    owner, run_id = start_owner("reaper")
    names = [f"kvown-{run_id}-{i}" for i in range(2)]
    assert set(names) <= netns_list()
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait(10)
    assert wait_gone(names, run_id, 20)


def test_a_stale_run_is_swept_by_the_next_run_and_a_live_one_is_not(make_hosts):
    owner, stale_id = start_owner("no-reaper")
    stale = [f"kvown-{stale_id}-{i}" for i in range(2)]
    live = make_hosts(1)  # while the stale run's owner is still alive: it must survive this setup
    assert set(stale) <= netns_list()
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait(10)
    assert set(stale) <= netns_list()  # nobody cleans a run without a reaper ...
    second = make_hosts(1)  # ... until the next setup sweeps it
    assert not (set(stale) & netns_list())
    assert wait_gone(stale, stale_id, 10)
    assert set(live.names) | set(second.names) <= netns_list()  # live runs untouched
    assert live.subnet != second.subnet and live.run_id != second.run_id
