"""Network faults between test hosts, each with a bounded deadline. World: worlds/netfault_world.py.

Rank 0 (the writer) runs on host 0, rank 1 (the receiver) on host 1, rank 2 (a bystander) on host 2.
Faults are real: the writer host's link goes down (``ip link set eth0 down`` in its namespace), its
link is made slow and lossy (``tc``), or every process of the host is killed. Nothing is injected into
kvown.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hostkit import World, start_world

from kvown.runtime.failstop import ExitCode
from kvown.runtime.flight import read_flight_file
from kvown.testing.hosts import HostsUnavailable

pytestmark = pytest.mark.multiproc
S = 1_000_000_000
W, RX, BYSTANDER = 0, 1, 2


def flight(world: World, rank: int) -> list[dict]:
    info = world.infos()[rank]
    path = world.out / f"kvown-flight-rank{rank}-pid{info['pid']}.jsonl"
    return read_flight_file(path) if path.exists() else []


def reuse_problems(world: World) -> list[str]:
    """Everything that says request L's blocks were reused or freed before the world died, from what the
    receiver wrote before the deadline (journal, deadline file) and its fail-stop flight recorder."""
    problems = []
    deadline = json.loads((world.out / "deadline.json").read_text())
    held, rid = set(deadline["blocks"]), deadline["request_id"]
    journal = [json.loads(line) for line in (world.out / "rx-journal.jsonl").read_text().splitlines()]
    probes = [e for e in journal if "free_request_blocks" in e]
    if not probes:
        problems.append("the receiver never probed the pool while the link was down")
    for e in probes:
        if e["oversized_request"] != "refused":
            problems.append(f"a request for more than the free blocks was not refused: {e['oversized_request']} "
                            f"({e['pool']})")
        if e["overlap_with_held"]:
            problems.append(f"blocks of request L were handed out again: {e['overlap_with_held']}")
        if not e["free_request_blocks"]:
            problems.append("the probe got no blocks at all")
    for e in journal:
        if e["retired"] or e["landed"]:
            problems.append(f"request L landed or retired at {e['t_ns']}")
        if e["pool"]["free"] + len(held) > e["pool"]["total"]:
            problems.append(f"request L's blocks counted as free at {e['t_ns']}: {e['pool']}")
    records = flight(world, RX)
    if not records or records[0].get("reason") != "deadline" or records[0].get("request_id") != rid:
        problems.append(
            f"no deadline fail-stop for request L in the receiver's flight recorder: {records[:1]}"
        )
    if any(
        r.get("type") == "event" and r.get("kind") == "retire" and r.get("request_id") == rid for r in records
    ):
        problems.append("the receiver's flight recorder shows request L retired")
    return problems


def run_linkdown(make_hosts, tmp_path: Path, mutant: str = "") -> tuple[World, dict]:
    hosts = make_hosts(3)
    # A slow writer link first, so one 2 MiB WRITE stays in flight for seconds: then cut it mid-WRITE.
    hosts.throttle(W, rate_kbit=2000, queue_bytes=200_000)
    world = start_world(
        hosts, 3, ["linkdown", str(tmp_path), *(["--mutant", mutant] if mutant else [])], tmp_path
    )
    facts: dict = {}
    try:
        assert world.wait_started(90), world.stderr[-3000:]
        assert world.wait_file("writing.json", 30) is not None, world.stderr[-3000:]
        hosts.link_down(W)
        (tmp_path / "link-is-down").touch()
        deadline = world.wait_file("deadline.json", 10)
        assert deadline and deadline["deadline_ns"], world.stderr[-3000:]
        facts["deadline_ns"] = deadline["deadline_ns"]
        # While the writer's host is cut off: every rank on every host must go, by the deadline's fail-stop.
        until_deadline_s = max(0.0, (deadline["deadline_ns"] - time.monotonic_ns()) / S)
        facts["all_gone_ns"] = world.wait_gone(None, until_deadline_s + 10)
        facts["writer_daemon_pids_during_outage"] = hosts.pids(W)
        hosts.link_up(W)
        hosts.clear_qdisc(W)
        facts["returncode"] = world.wait_exit(30)  # the launcher ends once it reaches the writer's host again
    finally:
        world.stop()
    return world, facts


@pytest.mark.timeout(180)
def test_writer_link_down_mid_write_holds_blocks_and_fail_stops_every_host(make_hosts, tmp_path):
    world, facts = run_linkdown(make_hosts, tmp_path)
    deadline_ns, gone_ns = facts["deadline_ns"], facts["all_gone_ns"]
    assert gone_ns is not None, (
        f"ranks still alive 10 s after the deadline: {world.alive()}\n{world.stderr[-3000:]}"
    )
    assert deadline_ns <= gone_ns < deadline_ns + 2 * S, (gone_ns - deadline_ns) / 1e6
    assert facts["returncode"] == ExitCode.DEADLINE, world.stderr[-3000:]
    assert reuse_problems(world) == []
    # Both sides fail-stopped on their own evidence: the receiver (claims unproven), and the cut-off
    # writer (its WRITE stayed in doubt), which could not be reached by the launcher's kill.
    assert "reason=deadline" in world.stderr
    writer = flight(world, W)
    assert writer and writer[0]["reason"] == "deadline", writer[:1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_link_down_check_catches_a_receiver_that_frees_on_a_timer(make_hosts, tmp_path):
    """The planted bug: the receiver frees request L's blocks when its transfer timeout passes."""
    world, _ = run_linkdown(make_hosts, tmp_path, mutant="free-on-timeout")
    problems = reuse_problems(world)
    assert any("handed out again" in p for p in problems), problems


def impair(hosts, how: str) -> None:
    if how == "netem":
        try:
            hosts.netem(W, delay_ms=20, jitter_ms=5, loss_pct=2)
        except HostsUnavailable as exc:
            pytest.skip(str(exc))
    else:  # a slow link whose short queue drops what does not fit: real loss, TCP retransmits
        hosts.throttle(W, rate_kbit=20_000, queue_bytes=24_000, burst_bytes=16_000)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["tbf", "netem"])
def test_every_session_ends_with_proof_on_a_slow_lossy_link(make_hosts, tmp_path, how):
    hosts = make_hosts(2)
    impair(hosts, how)
    retrans_before = hosts.tcp_retransmits(W)
    world = start_world(
        hosts,
        2,
        [
            "sessions",
            str(tmp_path),
            "--sessions",
            "30",
            "--blocks",
            "4",
            "--timeout-s",
            "15",
            "--grace-s",
            "15",
        ],
        tmp_path,
    )
    try:
        rc = world.wait_exit(200)
    finally:
        world.stop()
    assert rc == 0, world.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    sessions = report["sessions"]
    assert len(sessions) == 30
    assert all(s["retired"] for s in sessions)  # proof for every one, none on a timer
    assert all(s["outcome"] == "completed" and s["verified"] for s in sessions if not s["cancelled"])
    assert all(s["outcome"] == "cancelled" for s in sessions if s["cancelled"])
    assert report["pool"]["free"] == report["pool"]["total"]
    # the link really was lossy
    lost = hosts.qdisc_stats(W).get("dropped", 0) if how == "tbf" else 0
    assert lost > 0 or hosts.tcp_retransmits(W) > retrans_before


@pytest.mark.timeout(180)
def test_a_dead_host_takes_the_world_down_within_the_crash_grace(make_hosts, tmp_path):
    grace_s = 1.0
    hosts = make_hosts(3)
    world = start_world(
        hosts,
        3,
        ["hostdeath", str(tmp_path), "--timeout-s", "5", "--grace-s", "5"],
        tmp_path,
        env={"KVOWN_RANK_CRASH_GRACE_S": str(grace_s)},
    )
    try:
        assert world.wait_started(90), world.stderr[-3000:]
        progress = None
        for _ in range(3000):  # bounded: at most ~30 s for three sessions
            progress = world.wait_file("progress.json", 0.01)
            if progress and progress["sessions"] >= 3:
                break
        assert progress and progress["sessions"] >= 3, world.stderr[-3000:]
        killed_ns = time.monotonic_ns()
        assert hosts.kill_host(W), "nothing ran on the writer's host"
        gone_ns = world.wait_gone(None, grace_s + 10)
        rc = world.wait_exit(30)
    finally:
        world.stop()
    assert gone_ns is not None, f"still alive: {world.alive()}\n{world.stderr[-3000:]}"
    assert gone_ns - killed_ns < (grace_s + 1) * S, (gone_ns - killed_ns) / 1e6
    # Reported as a failure: kvown's crash guard aborts (137), or the launcher noticed the dead host's
    # daemon first and tore the job down itself; PRRTE 3.0 then says so on stderr but sometimes exits 0
    # (2 runs in about 10 fresh-clone suites).
    assert rc != 0 or "lost communication with a remote daemon" in world.stderr, (rc, world.stderr[-3000:])
