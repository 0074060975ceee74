"""Real 3-rank world over NIXL (UCX on host memory): the issue's transfer scenarios, end to end.

One mpirun world runs every scenario (tests/multiproc/worlds/transfer_scenarios.py); each test below
checks one scenario's recorded checks. A scenario that did not run, or raised, fails its test.
"""

from __future__ import annotations

import json
import sys
import tempfile

import pytest

from kvown.apps import qualify
from worldkit import mpirun, run

EXPECTED = {
    "happy": {"landed", "data_verified", "aux_verified", "retired", "completed", "sender_released", "sender_completed"},
    "cancel_before_publication": {"born_cancelled", "retired", "nothing_published", "sender_born_cancelled",
                                  "sender_released", "nothing_written"},
    "cancel_mid_transfer": {"held_while_write_in_flight", "retired_after_quiesce", "waited_for_the_write",
                            "outcome_cancelled", "sender_cancelled", "sender_released_after_done"},
    "cancel_before_sender_session": {"retired", "cancelled", "late_session_born_cancelled", "released",
                                     "nothing_written"},
    "fan_in_one_writer_cancelled": {"failed", "retired", "writer1_cancelled", "writer0_released", "writer1_released"},
    "broadcast_publication": {"landed", "data_verified", "retired", "completed", "selected_writer_completed",
                              "candidate_fenced"},
    "context_first": {"sender_completed", "landed", "data_verified", "retired"},
    "hostile_frames": {"rejected_and_counted", "replay_dropped", "no_session_created", "not_quarantined",
                       "pool_unchanged"},
    "still_works_afterwards": {"landed", "data_verified", "retired"},
    "checksummed_transfer": {"writer0_landed", "writer0_checksums_match", "writer0_retired", "writer0_released",
                             "writer1_landed", "writer1_checksums_match", "writer1_retired", "writer1_released"},
}


@pytest.fixture(scope="module")
def scenario_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("world") / "scenarios.json"
    proc = run(mpirun(3) + [sys.executable, "-m", "kvown.apps.qualify_world", str(out)], 240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_scenario(scenario_results, name):
    checks = scenario_results.get(name, {})
    failed = sorted(k for k, v in checks.items() if not v)
    assert not failed, f"{name}: failed checks {failed}"
    missing = EXPECTED[name] - checks.keys()
    assert not missing, f"{name}: checks never recorded {sorted(missing)}"


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [("nvfp4", "inline"), ("nvfp4", "separate"), ("mla", "inline")],
                         ids=["nvfp4-inline-scales", "nvfp4-separate-scales", "mla"])
def test_qualify_passes_for_other_layouts(tmp_path, layout):
    out, flights = tmp_path / "checks.json", tmp_path / "flights"
    flights.mkdir()
    proc = run([sys.executable, "-m", "kvown.apps.qualify", "--layout", layout[0], "--scale-layout", layout[1],
                "--json", str(out)], 280, env={"KVOWN_FLIGHT_DIR": str(flights)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    # the fail-stop world's recorders go where the caller asked, and the report names that directory
    assert report["figures"]["failstop"]["flight_dir"] == str(flights)
    assert list(flights.glob("kvown-flight-rank*.jsonl"))
    checks = report["checks"]
    assert set(checks) == set(EXPECTED) | {"network", "fail_stop_across_hosts"}
    assert all(all(v.values()) for v in checks.values())


def _check_failstop_leaves_nothing(tmp_path, monkeypatch) -> None:
    """A passing fail-stop world with no KVOWN_FLIGHT_DIR leaves no flight directory in the temp
    directory, and its figures say so (each passing ``kvown qualify`` used to leave one in /tmp)."""
    monkeypatch.delenv("KVOWN_FLIGHT_DIR")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    launch = qualify._launch_for(qualify.parse_args([]))
    checks, figures = qualify.run_failstop(launch, 3, "cpu", 120.0, 2.0)
    assert all(checks.values()), (checks, figures)
    assert figures["flight_dir"] is None
    left = sorted(p.name for p in tmp_path.glob("kvown-qualify-flight-*"))
    assert left == [], f"left behind: {left}"


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_a_passing_failstop_world_leaves_no_flight_directory(tmp_path, monkeypatch):
    _check_failstop_leaves_nothing(tmp_path, monkeypatch)


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_mutant_that_keeps_the_directory_is_caught(tmp_path, monkeypatch):
    """The bug: the temporary flight directory was never removed."""
    monkeypatch.setattr(qualify.shutil, "rmtree", lambda *a, **k: None)
    with pytest.raises(AssertionError, match=r"left behind: \['kvown-qualify-flight-"):
        _check_failstop_leaves_nothing(tmp_path, monkeypatch)
