"""``kvown demo`` end to end in real mpirun worlds: clean runs, a mutant it must catch, a fail-stop."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from worldkit import left_in_tmp, run

DEMO = [sys.executable, "-m", "kvown.apps.demo"]
WORKDIR = "kvown-demo-"  # the prefix of the demo's work directory in the temp dir


def demo(tmp_path, *args: str, timeout_s: float = 180):
    """(proc, report, left): ``left`` names the work directories the run left in the temp dir, which
    are then removed (a clean world must leave none; a failed one keeps its log and says where)."""
    out = tmp_path / "report.json"
    with left_in_tmp(WORKDIR) as left:
        proc = run(DEMO + ["--json", str(out), *args], timeout_s, env={"KVOWN_FLIGHT_DIR": str(tmp_path)})
    report = json.loads(out.read_text()) if out.exists() else None
    for path in left:
        shutil.rmtree(path, ignore_errors=True)
    return proc, report, left


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("args", [
    ("--ranks", "2", "--requests", "300"),
    ("--ranks", "4", "--requests", "200", "--context-first", "--fan-in"),
    ("--ranks", "4", "--requests", "150", "--dtype", "nvfp4", "--scale-layout", "separate", "--fan-in"),
], ids=["generation-first", "context-first-fan-in", "nvfp4-separate-scales-fan-in"])
def test_demo_runs_clean(tmp_path, args):
    proc, report, left = demo(tmp_path, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert left == [], "a clean world left its work directory behind"
    requests = int(args[3])
    assert report["corrupted_blocks"] == 0 and report["blocks_held_at_end"] == 0
    ended = ("requests_completed", "requests_cancelled", "requests_aborted", "requests_failed")
    assert sum(report[k] for k in ended) == requests and report["requests_failed"] == 0, report
    assert report["requests_completed"] > requests // 2 and report["requests_cancelled"] > 0
    assert report["verified_blocks"] > 0 and report["bytes_transferred"] > 0
    for key in ("gbps", "retire_latency_p50_us", "retire_latency_p99_us", "fences"):
        assert key in report
    assert_true_latencies(report)


def assert_true_latencies(report: dict) -> None:
    """Every latency is the time between its two events: never below zero, and p50 <= p99."""
    assert report["negative_latencies"] == 0, report
    for name in ("retire_latency", "release_to_retired"):
        p50, p99 = report[f"{name}_p50_us"], report[f"{name}_p99_us"]
        assert 0 <= p50 <= p99, (name, p50, p99)


# Seeds 1-5, each in one of the three modes (the slow soak runs every seed in every mode).
LATENCY_RUNS = [
    ("1", ("--ranks", "2")), ("2", ("--ranks", "2", "--context-first")), ("3", ("--ranks", "4", "--fan-in")),
    ("4", ("--ranks", "2", "--context-first")), ("5", ("--ranks", "4", "--fan-in")),
]


@pytest.mark.multiproc
@pytest.mark.timeout(180)
@pytest.mark.parametrize("seed,flags", LATENCY_RUNS, ids=[f"seed{s}" for s, _ in LATENCY_RUNS])
def test_demo_latencies_are_true(tmp_path, seed, flags):
    args = ("--requests", "80", "--seed", seed, "--cancel-rate", "0.4", *flags)
    proc, report, _ = demo(tmp_path, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_true_latencies(report)


SLOW_NETWORK = ("--ranks", "2", "--requests", "400", "--cancel-rate", "0.6", "--inject", "slow-control:rank=0:ms=30")


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mutant", ["", "retire-on-cancel"], ids=["kvown", "retire-on-cancel-mutant"])
def test_demo_with_a_slow_network_catches_a_receiver_that_retires_on_cancel(tmp_path, mutant):
    """The OFF/ON reproducer. Control frames reach the writer 30 ms late, so writes are still being
    posted after the receiver cancels. kvown holds the blocks until the writer quiesces and stays
    clean; the bug every peer system shipped (retire on cancel without acks) corrupts reused blocks."""
    proc, report, left = demo(tmp_path, *SLOW_NETWORK, *(("--mutant", mutant) if mutant else ()))
    if mutant:  # caught by the landed-data check, or by the runtime's retirement canary (a fail-stop)
        assert proc.returncode == 1, proc.stdout[-2000:]
        assert len(left) == 1 and left[0] in proc.stderr, (left, proc.stderr[-2000:])  # kept, and named
        caught_by_canary = "a write landed after retirement" in proc.stderr
        assert caught_by_canary or (report is not None and report["corrupted_blocks"] > 0), proc.stderr[-3000:]
    else:
        assert proc.returncode == 0 and report is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert report["corrupted_blocks"] == 0 and report["blocks_held_at_end"] == 0


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_demo_stuck_writer_fail_stops_the_world_at_the_deadline(tmp_path):
    with left_in_tmp(WORKDIR) as left:
        proc = run(DEMO + ["--ranks", "2", "--requests", "100", "--fault", "stuck-writer"], 100,
                   env={"KVOWN_FLIGHT_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert left == [], "the recorders are in KVOWN_FLIGHT_DIR: nothing else to keep"
    assert "world exit code       75" in proc.stdout
    flights = sorted(tmp_path.glob("kvown-flight-rank*.jsonl"))
    assert flights, "no flight recorder was written"
    assert any("deadline" in f.read_text() for f in flights)


SOAK_MODES = {"generation-first": (), "context-first": ("--context-first",), "fan-in": ("--fan-in",)}


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_demo_soak_five_seeds_in_every_mode(tmp_path):
    """Issue 7's soak: kvown demo over 5 seeds x 3 modes, 4 ranks, 2000 requests each: 0 failed worlds,
    0 failed requests (the plan's prefill-side aborts are counted apart), 0 corrupted blocks, 0 blocks
    held at the end. Prints the totals for the record."""
    totals = {"worlds": 0, "requests": 0, "completed": 0, "cancelled": 0, "aborted": 0, "failed": 0,
              "verified_blocks": 0, "corrupted_blocks": 0, "blocks_held_at_end": 0, "wall_s": 0.0}
    for mode, flags in SOAK_MODES.items():
        for seed in range(1, 6):
            run_dir = tmp_path / f"{mode}-{seed}"
            run_dir.mkdir()
            proc, report, _ = demo(run_dir, "--seed", str(seed), *flags, timeout_s=600)
            assert proc.returncode == 0 and report is not None, (mode, seed, proc.stderr[-3000:])
            assert report["corrupted_blocks"] == 0 and report["blocks_held_at_end"] == 0, (mode, seed, report)
            assert report["requests_unfinished"] == 0 and report["requests_failed"] == 0, (mode, seed, report)
            assert_true_latencies(report)
            totals["worlds"] += 1
            totals["requests"] += report["requests"]
            totals["completed"] += report["requests_completed"]
            totals["cancelled"] += report["requests_cancelled"]
            totals["aborted"] += report["requests_aborted"]
            totals["failed"] += report["requests_failed"]
            totals["verified_blocks"] += report["verified_blocks"]
            totals["wall_s"] += report["wall_s"]
    print("demo soak totals:", totals)
