"""Coverage-guided fuzzing of the untrusted-bytes entry points (kvown.testing.fuzz, atheris).

CI runs each target for ``CI_RUNS`` inputs (seconds); the ``slow`` test runs ``SLOW_RUNS`` per target
and appends its figures (JSON lines) to ``$KVOWN_FUZZ_REPORT`` when set (docs/reliability.md,
"Fuzzing", quotes them), keeping the inputs it found under ``$KVOWN_FUZZ_KEEP_CORPUS/<target>``.
The mutant tests prove the harness can fail: each plants a bug the oracles must catch within the CI
budget.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvown.core.messages import ControlKind, from_wire
from kvown.testing import fuzz_targets as ft
from kvown.testing.fuzz import CORPUS_ROOT, replay, run_target

pytest.importorskip("atheris", reason="atheris is pinned in requirements.lock; install it to fuzz")

CI_RUNS = 3000
SLOW_RUNS = 100_000
TARGETS = sorted(ft.TARGETS)


def _assert_clean(report: dict) -> None:
    detail = report.get("finding") or report.get("log_tail", "")
    assert report["rc"] == 0 and report["crashes"] == 0, f"{report['target']}: {detail}"


@pytest.mark.parametrize("target", TARGETS)
def test_ci_budget_finds_no_crash(target, tmp_path):
    report = run_target(target, CI_RUNS, seed=1, artifacts=tmp_path, timeout_s=180)
    _assert_clean(report)
    assert report["inputs"] == CI_RUNS
    assert report["coverage_edges"] > 0  # the kvown code was instrumented and reached


@pytest.mark.interpreted_only
@pytest.mark.parametrize("mutant", sorted(ft.MUTANTS))
def test_planted_bug_is_caught_within_ci_budget(mutant, tmp_path):
    target = ft.MUTANTS[mutant][0]
    report = run_target(target, CI_RUNS, seed=1, mutant=mutant, artifacts=tmp_path, timeout_s=180)
    assert report["crashes"] == 1, report.get("log_tail", report)
    assert report["inputs"] < CI_RUNS
    assert "Uncaught Python exception" in report["finding"]
    crash = Path(report["crash_inputs"][0]).read_bytes()
    assert replay_outcome(target, crash) != "crash"  # the same input passes on the real code


def test_every_target_has_a_planted_bug():
    """A target whose oracles no planted bug has tripped has oracles nobody has seen fail."""
    assert set(ft.TARGETS) <= {target for target, _ in ft.MUTANTS.values()}


def replay_outcome(target: str, data: bytes) -> str:
    try:
        return ft.TARGETS[target].one_input(data)
    except Exception:  # noqa: BLE001
        return "crash"


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_slow_budget_finds_no_crash(target, tmp_path):
    keep = os.environ.get("KVOWN_FUZZ_KEEP_CORPUS")  # where to keep the inputs it found (for --lines)
    report = run_target(target, SLOW_RUNS, seed=int(os.environ.get("KVOWN_FUZZ_SEED", "1")), artifacts=tmp_path,
                        keep_corpus=Path(keep) / target if keep else None, timeout_s=1800)
    out = os.environ.get("KVOWN_FUZZ_REPORT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps({k: v for k, v in report.items() if k != "log_tail"}) + "\n")
    _assert_clean(report)
    assert report["inputs"] >= SLOW_RUNS


# ---- the corpus --------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_corpus_replays_and_starts_deep(target):
    """Every seed runs in-process; each target's seeds reach success and rejection both."""
    outcomes = [o for _, o in replay(target, sorted((CORPUS_ROOT / target).iterdir()))]
    assert any(not o.startswith(("rejected", "closed")) for o in outcomes), outcomes
    assert any(o.startswith(("rejected", "closed", "reply:2")) or "rejected" in o for o in outcomes), outcomes


def test_corpus_files_match_the_seed_generator():
    """A protocol change that alters a seed shows here: rerun ``python -m kvown.testing.fuzz --write-seeds``."""
    for target, files in ft.seeds().items():
        on_disk = {p.name: p.read_bytes() for p in (CORPUS_ROOT / target).glob("seed-*")}
        assert on_disk == {f"seed-{k}": v for k, v in files.items()}, target


def test_frame_corpus_has_a_valid_frame_of_every_kind():
    import msgpack

    for target, unwrap in (("frame", lambda b: [b]), ("core", ft.split_frames)):
        kinds = set()
        for path in (CORPUS_ROOT / target).iterdir():
            for body in unwrap(path.read_bytes()):
                try:
                    kinds.add(from_wire(msgpack.unpackb(body)).message.KIND)
                except Exception:  # noqa: BLE001 - the deliberately bad seeds
                    pass
        assert kinds == set(ControlKind), (target, set(ControlKind) - kinds)


# ---- the oracles themselves -------------------------------------------------------------------------


def test_field_oracle_knows_every_message_field():
    from kvown.core.messages import MESSAGE_TYPES
    from kvown.core.record import record_fields

    missing = {name for cls in MESSAGE_TYPES.values() for name in record_fields(cls)} - set(ft.FIELD_SPEC)
    assert not missing, f"add these to fuzz_targets.FIELD_SPEC: {sorted(missing)}"


def test_snapshot_sees_a_change_deep_inside_a_core():
    tx, rx = ft.core_fixture()
    before = ft.snapshot(rx)
    assert ft.snapshot(ft.core_fixture()[1]) == before  # INV-FZ1: the fixture is reproducible
    next(iter(rx.sessions.values())).writers[0].acked = True
    assert ft.snapshot(rx) != before
    fence_before = ft.snapshot(tx)
    tx.fence.install(ft.RID_ACTIVE, tx.fence.origin(ft.RID_FENCED))
    assert ft.snapshot(tx) != fence_before


def test_split_frames_round_trips():
    bodies = [b"a", b"", b"xyz" * 100]
    assert ft.split_frames(ft.join_frames(bodies)) == bodies
    assert ft.split_frames(b"\x00\x05ab") == [b"ab"]  # a record running past the end takes the rest
