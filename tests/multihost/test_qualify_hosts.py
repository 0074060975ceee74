"""``kvown qualify --test-hosts 3``: the qualification suite across three namespace hosts, per layout.

One rank per host, UCX over TCP between them. Every check of every scenario must be true, including
the network checks (each pair of ranks on different hosts used tcp/eth0 and nothing else) and the
fail-stop world (deadline -> every rank on every host gone). 15 s per layout on a quiet 2-core VM,
22-25 s under load; all three layouts, and NVFP4 in both scale layouts, run in CI.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest
from hostkit import ROOT

from kvown.adapters.mpi import process_alive
from kvown.testing.hosts import run_states, unavailable_reason

pytestmark = pytest.mark.multiproc
EXPECTED_SCENARIOS = {
    "happy",
    "cancel_before_publication",
    "cancel_mid_transfer",
    "cancel_before_sender_session",
    "fan_in_one_writer_cancelled",
    "broadcast_publication",
    "context_first",
    "checksummed_transfer",
    "hostile_frames",
    "still_works_afterwards",
    "network",
    "fail_stop_across_hosts",
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("layout", "scale_layout"),
    [("nvfp4", "inline"), ("nvfp4", "separate"), ("standard", "inline"), ("mla", "inline")],
    ids=["nvfp4-inline-scales", "nvfp4-separate-scales", "standard", "mla"],
)
def test_qualify_passes_across_three_test_hosts(tmp_path, layout, scale_layout):
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"test hosts unavailable: {reason}")
    out, junit = tmp_path / "q.json", tmp_path / "q.xml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvown",
            "qualify",
            "--test-hosts",
            "3",
            "--layout",
            layout,
            "--scale-layout",
            scale_layout,
            "--json",
            str(out),
            "--junit-xml",
            str(junit),
        ],
        capture_output=True,
        text=True,
        timeout=380,
        cwd=ROOT,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    checks = report["checks"]
    assert report["passed"] is True
    assert set(checks) == EXPECTED_SCENARIOS
    failed = [f"{s}.{c}" for s, v in checks.items() for c, ok in v.items() if not ok]
    assert failed == []
    figures = report["figures"]
    sc = figures["scenarios"]
    assert len({r["host"] for r in sc["ranks"]}) == 3  # one rank per host
    pairs = sc["ucx_pairs"]
    assert pairs and all(
        p["cross_host"] and p["lanes"] == ["tcp/eth0"] and p["exact"] for p in pairs.values()
    )
    assert sc["verified_nbytes_checksum"] > 0
    fs = figures["failstop"]
    assert len(fs["hosts"]) == 3 and fs["returncode"] == 75
    assert fs["deadline_to_all_ranks_gone_ms"] >= 0
    # JUnit: one testcase per check, none failed
    suite = ET.parse(junit).getroot().find("testsuite")
    cases = suite.findall("testcase")
    assert len(cases) == sum(len(v) for v in checks.values())
    assert suite.get("failures") == "0" and not suite.findall("testcase/failure")


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("where", ["--hosts", "--hostfile"])
def test_the_cluster_path_of_qualify_on_test_hosts(make_hosts, tmp_path, where):
    """``--hosts`` / ``--hostfile`` as on a real cluster: the test hosts only provide the launch agent
    and network settings through the environment, as an operator's ssh and UCX settings would. The
    fail-stop time is then measured as on real hosts: deadline (wall clock) -> launcher exit."""
    hosts = make_hosts(3)
    out = tmp_path / "q.json"
    spec = ",".join(hosts.names) if where == "--hosts" else str(hosts.hostfile)
    env = hosts.env()
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "kvown", "qualify", where, spec, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=380,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["passed"] and set(report["checks"]) == EXPECTED_SCENARIOS
    fs = report["figures"]["failstop"]
    assert fs["clock"] == "wall clocks of the hosts" and "deadline_to_all_ranks_gone_ms" not in fs
    assert 0 <= fs["deadline_to_launcher_exit_ms"]


def descendants(root: int) -> dict[int, int]:
    """{pid: start ticks} of every process below ``root`` now (from /proc)."""
    parent, ticks = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(b")") + 2 :].split()
            parent[int(entry)], ticks[int(entry)] = int(fields[1]), int(fields[19])
    found, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        for child, ppid in parent.items():
            if ppid == pid and child not in found:
                found[child] = ticks[child]
                frontier.append(child)
    return found


def namespaces_owned_by(pid: int) -> set[str]:
    """The test hosts of the runs whose owner is ``pid``, from the machine-wide run records."""
    return {ns for state in run_states().values() if state.get("owner_pid") == pid
            for ns in state.get("namespaces", [])}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_qualification_tears_its_hosts_and_world_down(make_hosts, sig):
    make_hosts  # noqa: B018 - only for its skip where namespaces cannot be made
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvown", "qualify", "--test-hosts", "2"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().startswith("kvown qualify:")  # hosts built, the world is starting
        time.sleep(3)
        mine = namespaces_owned_by(proc.pid)  # not other runs' hosts: another suite may share the machine
        assert mine, "the qualification made no test hosts"
        tree = descendants(proc.pid)  # mpirun, launch agents, PRRTE daemons, ranks
        assert len(tree) >= 3
        proc.send_signal(sig)
        assert proc.wait(60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
    left = set(
        subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout.split()
    )
    assert not (mine & left)
    alive = [pid for pid, ticks in tree.items() if process_alive(pid, ticks)]
    assert not alive, f"processes of the qualification left running: {alive}"
