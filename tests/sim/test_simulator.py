"""Run the seeded simulated world over many seeds: every run must be clean, and the seeds together
must really exercise the rare paths (so the simulator cannot silently stop exploring)."""

from __future__ import annotations

import collections

import pytest

from kvown.testing.sim import SimConfig, SimWorld

# Each of these must fire at least once across the CI seeds (FoundationDB's CODE_PROBE idea).
EXPECTED_PROBES = (
    "cancel_mid_transfer",  # a client cancel while a write to that request may touch memory
    "cancel_while_publishing",  # cancel between OpenReceive and PublicationSent
    "in_doubt_writes",  # WriteFailed / WriteSubmitFailed
    "late_settlements",  # DONE on an in-doubt op, reported as FAILED_QUIESCED
    "duplicates_dropped",
    "reordered",
    "corrupt_rejected",  # bit-flipped frames refused by the codec (HMAC)
    "forged_rejected",  # impostor acks refused by the receiver
    "outcome_timed_out",
    "fatal",  # FailStop at a drain deadline
    "born_cancelled",  # a session for a fenced id
    "deaths",
    "drops",
    "outcome_completed",
    "outcome_cancelled",
    "outcome_failed",
    "retired",
    "admission_refused",
    "pattern_fan_in",
    "pattern_broadcast",
    "pattern_single",
)


@pytest.mark.sim
@pytest.mark.timeout(60)
def test_every_seed_is_clean_and_the_seeds_explore(sim_seeds: list[int]) -> None:
    totals: collections.Counter[str] = collections.Counter()
    for seed in sim_seeds:
        totals.update(SimWorld(seed).run())  # raises InvariantViolation with the seed and decision log
    if len(sim_seeds) >= 200:
        missing = [p for p in EXPECTED_PROBES if totals[p] == 0]
        assert not missing, f"the simulator stopped exploring: {missing} never happened in {len(sim_seeds)} seeds"
        assert totals["retired"] > 0.3 * totals["outcome_completed"] / 2


@pytest.mark.sim
@pytest.mark.timeout(30)
def test_a_seed_replays_exactly() -> None:
    a, b = SimWorld(1234), SimWorld(1234)
    assert a.run() == b.run()
    assert list(a.log) == list(b.log)


@pytest.mark.sim
@pytest.mark.timeout(30)
def test_a_quiet_world_completes_everything() -> None:
    """No faults, no cancels, generous deadlines: every request completes and every block retires."""
    quiet = SimConfig(
        p_slow=0, p_dup=0, p_corrupt=0, p_cancel=0, p_not_submitted=0, p_submit_raise=0, p_write_failed=0,
        p_pub_fail=0, p_cancel_publishing=0, p_reopen=0, p_late_tick=0, p_slow_consumer=0,
        timeout_ns=10**6, grace_ns=10**6,
    )
    world = SimWorld(7, quiet)
    counts = world.run()
    assert counts.get("fatal", 0) == 0 and counts.get("outcome_failed", 0) == 0
    assert counts["retired"] == quiet.num_requests
    assert counts["delivered"] == quiet.num_requests


@pytest.mark.sim
@pytest.mark.timeout(30)
def test_a_dropped_frame_ends_in_fail_stop_not_in_retirement() -> None:
    """Every frame dropped: nothing is ever proven, so every published destination ends fatal."""
    lossy = SimConfig(p_drop=1.0, p_cancel=0, p_reopen=0, p_slow_consumer=0)
    counts = SimWorld(3, lossy).run()
    assert counts.get("retired", 0) == 0
    assert counts["fatal"] >= 1
