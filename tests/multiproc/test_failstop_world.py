"""Real mpirun fail-stop tests (Open MPI 5 from the venv). Rank logic: ranks/failstop_rank.py.

Each test launches one short job (~1-3 s); ``launch.run_world`` bounds every wait and SIGKILLs the
launcher group and every known rank PID if a job outlives its timeout. PIDs are checked together
with their start time, so a reused PID never counts as a survivor.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ranks.launch import WorldRun, run_world

from kvown.runtime.failstop import ExitCode
from kvown.runtime.flight import read_flight_file

pytestmark = pytest.mark.multiproc
S = 1_000_000_000  # ns per s


def flight_records(out: Path, rank: int, pid: int) -> list[dict]:
    return read_flight_file(out / f"kvown-flight-rank{rank}-pid{pid}.jsonl")


def assert_all_gone(run: WorldRun, n: int) -> None:
    assert not run.timed_out, run.stderr[-2000:]
    assert sorted(run.infos) == list(range(n)), run.stderr[-2000:]
    assert run.alive_pids() == []
    assert run.all_gone_ns is not None


@pytest.mark.timeout(90)
def test_unsettled_claim_kills_both_ranks_then_a_fresh_world_starts(tmp_path) -> None:
    run = run_world(2, "claim", tmp_path / "claim", extra_args=("--deadline-s", "1.0"), timeout_s=40)
    assert_all_gone(run, 2)
    deadline_ns = run.infos[0]["deadline_ns"]
    assert run.returncode == ExitCode.DEADLINE  # non-zero, and it says why
    assert deadline_ns <= run.all_gone_ns < deadline_ns + 1 * S
    assert "reason=deadline request_id=7" in run.stderr
    # rank 0 (the claim holder) dumped with the reason; rank 1 (in a barrier) dumped on launcher SIGTERM
    rank0 = flight_records(run.out_dir, 0, run.infos[0]["pid"])
    assert rank0[0]["reason"] == "deadline" and rank0[0]["request_id"] == 7
    assert all(info["sigterm_dump_reliable"] is True for info in run.infos.values())
    rank1 = flight_records(run.out_dir, 1, run.infos[1]["pid"])
    assert rank1[0]["reason"] == "terminated"
    assert 7 in [r["request_id"] for r in rank1 if r["type"] == "event"]
    assert any("Barrier" in f or "claim" in f for r in rank1 if r["type"] == "stack" for f in r["frames"])

    fresh = run_world(2, "hello", tmp_path / "fresh", timeout_s=40)
    assert fresh.returncode == 0 and not fresh.timed_out and sorted(fresh.infos) == [0, 1]


@pytest.mark.timeout(60)
def test_logger_blocked_forever_does_not_delay_the_kill(tmp_path) -> None:
    run = run_world(2, "claim", tmp_path, extra_args=("--deadline-s", "1.0", "--block-logger"), timeout_s=40)
    assert_all_gone(run, 2)
    deadline_ns = run.infos[0]["deadline_ns"]
    assert run.returncode == ExitCode.DEADLINE
    assert run.all_gone_ns < deadline_ns + 1 * S
    events = [r["kind"] for r in flight_records(run.out_dir, 0, run.infos[0]["pid"]) if r["type"] == "event"]
    assert "logger_wedged" in events  # the logger really was wedged before the deadline


@pytest.mark.timeout(60)
def test_rank_crash_kills_the_world_after_the_grace(tmp_path) -> None:
    run = run_world(2, "crash", tmp_path, env={"KVOWN_RANK_CRASH_GRACE_S": "0.5"}, timeout_s=40)
    assert_all_gone(run, 2)
    crash_ns = run.infos[0]["crash_ns"]
    assert run.infos[0]["grace_s"] == 0.5
    assert run.returncode == ExitCode.RANK_CRASH
    assert crash_ns + S // 2 <= run.all_gone_ns < crash_ns + S // 2 + 1 * S


@pytest.mark.timeout(60)
def test_cleanup_blocked_forever_is_killed_on_the_original_deadline(tmp_path) -> None:
    grace_ns = 1 * S
    run = run_world(2, "crash-blocking-cleanup", tmp_path, env={"KVOWN_RANK_CRASH_GRACE_S": "1.0"},
                    timeout_s=40)
    assert_all_gone(run, 2)
    crash_ns = run.infos[0]["crash_ns"]
    assert run.returncode == ExitCode.RANK_CRASH
    # crash + grace, with margin, and clearly before crash + 2 x grace
    assert crash_ns + grace_ns <= run.all_gone_ns < crash_ns + grace_ns + 6 * S // 10


@pytest.mark.timeout(60)
def test_delivered_crash_error_lets_both_ranks_finish_cleanly(tmp_path) -> None:
    run = run_world(2, "crash-delivered", tmp_path, env={"KVOWN_RANK_CRASH_GRACE_S": "0.3"}, timeout_s=40)
    assert_all_gone(run, 2)
    assert run.returncode == 0, run.stderr[-2000:]
    assert not list(run.out_dir.glob("kvown-flight-*.jsonl"))  # nobody fail-stopped


@pytest.mark.timeout(60)
def test_open_mpi_blast_radius_of_a_sub_communicator_abort_is_the_whole_job(tmp_path) -> None:
    """4 ranks as two 2-rank executors; executor A's claim goes fatal; executor B is healthy.

    Measured fact under Open MPI 5.0 (not a kvown choice): Abort on A's sub-communicator kills every
    rank of the mpirun job, B included. Run independent executors under separate launchers.
    """
    run = run_world(4, "split", tmp_path, extra_args=("--deadline-s", "1.0"), timeout_s=40)
    assert_all_gone(run, 4)
    deadline_ns = run.infos[0]["deadline_ns"]
    assert run.returncode == ExitCode.DEADLINE
    assert run.all_gone_ns < deadline_ns + 1 * S
    for rank in (2, 3):  # executor B was making progress until A's abort took it down
        assert int((run.out_dir / f"progress{rank}.txt").read_text()) > 0
        assert run.infos[rank]["executor"] == "B"
        # B's dump on the launcher's SIGTERM is best effort (SIGKILL follows ~250 ms later; under load it
        # may not start, or not finish): when it was written, it says why B died.
        dump = run.out_dir / f"kvown-flight-rank{rank}-pid{run.infos[rank]['pid']}.jsonl"
        records = flight_records(run.out_dir, rank, run.infos[rank]["pid"]) if dump.exists() else []
        assert not records or records[0]["reason"] == "terminated"


@pytest.mark.timeout(60)
def test_thread_level_below_multiple_refuses_to_start(tmp_path) -> None:
    run = run_world(2, "hello", tmp_path, env={"MPI4PY_RC_THREAD_LEVEL": "serialized"}, timeout_s=40)
    assert not run.timed_out
    assert run.returncode == 3
    assert run.infos == {}  # refused before anything (even the PID allgather) started
    assert "kvown refused to start" in run.stderr
    assert "field='thread_level'" in run.stderr and "MPI4PY_RC_THREAD_LEVEL=multiple" in run.stderr
