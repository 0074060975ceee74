"""Run the seeded simulated world - the real drivers over the fake NIXL library and fault wrappers -
over many seeds: every run must be clean, and the seeds together must really exercise the rare paths
(so the simulator cannot silently stop exploring)."""

from __future__ import annotations

import collections

import pytest

from kvown.testing.sim import SimConfig, SimWorld

# Each of these must fire at least once across the CI seeds (FoundationDB's CODE_PROBE idea).
EXPECTED_PROBES = (
    "cancel_mid_transfer",  # a client cancel while a WRITE into that request's blocks is unfinished
    "fault_write-error",  # ERROR from a WRITE: in doubt
    "fault_post-raises",  # the post raised although the WRITE left: in doubt
    "fault_stuck-writer",  # never reports: the world must fail-stop, never retire
    "fault_send-raise",  # a send that raised before sending: resent, no hole
    "fault_send-raise-after",  # a send that raised after sending: resent, the duplicate dropped
    "fault_receive-raise",
    "fault_release-raise",
    "control_resent",
    "duplicates_dropped",
    "rejected_frames",  # bit-flipped copies refused by the HMAC
    "rejected_peer_input",  # insiders' forged acks refused by the receiver core
    "outcome_timed_out",
    "fatal",  # FailStop at a drain deadline
    "born_cancelled_checked",  # a session opened again for a fenced id
    "local_copies",
    "deaths",
    "fault_drop-frame",
    "outcome_completed",
    "outcome_cancelled",
    "outcome_failed",
    "verified_landings",
    "retired",
    "admission_refused",
    "pattern_fan_in",
    "pattern_broadcast",
    "pattern_single",
    "frames_before_commands",  # a napping rank woken by a command reads its older frames first
    "pattern_burst",
    "writes_coalesced",  # sessions that went in one transfer with others (driver rule 3a)
)


@pytest.mark.sim
@pytest.mark.timeout(600)
def test_every_seed_is_clean_and_the_seeds_explore(sim_seeds: list[int]) -> None:
    totals: collections.Counter[str] = collections.Counter()
    for seed in sim_seeds:
        totals.update(SimWorld(seed).run())  # raises InvariantViolation with the seed and decision log
    if len(sim_seeds) >= 500:
        missing = [p for p in EXPECTED_PROBES if totals[p] == 0]
        assert not missing, f"the simulator stopped exploring: {missing} never happened in {len(sim_seeds)} seeds"
        assert totals["retired"] > 0.3 * totals["outcome_completed"] / 2


@pytest.mark.sim
@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_twenty_thousand_seeds_are_clean() -> None:
    for seed in range(20_000):
        SimWorld(seed).run()


@pytest.mark.sim
@pytest.mark.timeout(60)
def test_a_seed_replays_exactly() -> None:
    a, b = SimWorld(1234), SimWorld(1234)
    assert a.run() == b.run()
    assert list(a.log) == list(b.log)


@pytest.mark.sim
@pytest.mark.timeout(60)
def test_a_quiet_world_completes_everything() -> None:
    """No faults, no cancels, generous deadlines: every request completes and every block retires."""
    quiet = SimConfig(
        p_slow=0, p_dup=0, p_corrupt=0, p_cancel=0, p_not_posted=0, p_post_raises=0, p_write_error=0,
        p_send_raise=0, p_send_raise_after=0, p_receive_raise=0, p_release_raise=0, p_reopen=0,
        p_slow_consumer=0, p_local_copy=0, timeout_ns=10**6, grace_ns=10**6,
    )
    counts = SimWorld(7, quiet).run()
    assert counts.get("fatal", 0) == 0 and counts.get("outcome_failed", 0) == 0
    assert counts["retired"] == quiet.num_requests
    assert counts["verified_landings"] == quiet.num_requests


@pytest.mark.sim
@pytest.mark.timeout(60)
def test_a_dropped_frame_ends_in_fail_stop_not_in_retirement() -> None:
    """Every frame dropped: nothing is ever proven, so every published destination ends fatal."""
    lossy = SimConfig(p_drop=1.0, p_cancel=0, p_reopen=0, p_slow_consumer=0)
    counts = SimWorld(3, lossy).run()
    assert counts.get("retired", 0) == 0
    assert counts["fatal"] >= 1
