"""Lost and late notifications (issue 11), exhaustively by position in the seeded simulator.

A small world (6 writers, 2 receivers, 6 requests of every pattern, a third of them cancelled) is run
once to count the control frames each rank sends. Then, for every rank and every position N, the
same seed is run again with exactly one fault on that frame:

  drop-frame:nth=N   the frame is silently lost. kvown does not retransmit (docs/design.md 9): the
                     outcome must be a fail-stop at the deadline of the sessions behind the hole, or
                     nothing at all when no proof depended on the frame - never a hang, never a
                     retirement before every writer is proven quiet (the simulator's oracles (a) and
                     (b) run after every step; the end check wants every session of a live rank gone
                     and every block free with its canary).
  late-frame:nth=N   the frame arrives 1 ms (10^6 simulated ns, far past every deadline) late: the
                     same outcomes, and the late frame changes nothing once it lands.
  send-raise:nth=N   the send raised before the frame left (the transport knows): the driver resends
                     it and the world ends exactly as without the fault.

The oracles are what fail here; each outcome is also classified, and the figures are printed
(``-s``) for docs/reliability.md. A planted bug (a receiver that frees on its deadline instead of
fail-stopping) shows that the positions that end in a fail-stop are really guarding blocks.
"""

from __future__ import annotations

import collections

import pytest

from kvown.core.errors import InvariantViolation
from kvown.testing.sim import SimConfig, SimWorld

SMALL = SimConfig(
    num_senders=6,
    num_receivers=2,
    num_requests=6,
    num_blocks=24,
    timeout_ns=600,
    grace_ns=400,
    p_slow=0.0,
    p_dup=0.0,
    p_drop=0.0,
    p_corrupt=0.0,
    p_send_raise=0.0,
    p_send_raise_after=0.0,
    p_receive_raise=0.0,
    p_release_raise=0.0,
    p_cancel=0.35,
    p_not_posted=0.0,
    p_post_raises=0.0,
    p_write_error=0.0,
    p_stall=0.0,
    p_reopen=0.0,
    p_impostor=0.0,
    p_slow_consumer=0.0,
    p_local_copy=0.0,
)
SEEDS = (1,)  # CI: every position of one seed, per fault (a few seconds each)
SLOW_SEEDS = tuple(range(2, 22))  # the slow run: every position of 20 more seeds
MUTANT_SEEDS = (1, 2, 3)
NEVER = 10**9


def sends_per_rank(seed: int, fault: str) -> dict[int, int]:
    """How many positions ``fault`` sees on each rank in the fault-free run (an entry that never fires
    still counts the calls it sees): control frames, and for drop-frame and late-frame also the
    notifications carried by WRITEs."""
    world = SimWorld(seed, SMALL)
    for rank in world.ranks.values():
        rank.faulty.set_plan(f"{fault}:nth={NEVER}")
    counts = world.run()
    assert counts.get("fatal", 0) == 0 and counts["retired"] > 0, counts
    return {r: rank.faulty.plan[fault].seen for r, rank in world.ranks.items()}


def run_with(seed: int, rank: int, plan: str) -> tuple[SimWorld, dict[str, int]]:
    world = SimWorld(seed, SMALL)
    world.ranks[rank].faulty.set_plan(plan)
    return world, world.run()  # raises InvariantViolation (with seed and decision log) on any oracle


def classify(world: SimWorld, counts: dict[str, int]) -> str:
    reasons = {rank.fatal.reason.value for rank in world.ranks.values() if rank.fatal is not None}
    assert reasons <= {"deadline"}, f"a lost frame may only cost a deadline fail-stop: {reasons}"
    return "fail-stop at deadline" if reasons else "no effect"


@pytest.mark.sim
@pytest.mark.timeout(3600)
@pytest.mark.parametrize(
    "seeds",
    [pytest.param(SEEDS, id="ci-seeds"), pytest.param(SLOW_SEEDS, id="slow-seeds", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("fault", ["drop-frame", "late-frame"])
def test_one_lost_or_late_frame_at_every_position_ends_in_a_deadline_fail_stop_or_nothing(
    fault: str, seeds: tuple[int, ...]
) -> None:
    outcomes: collections.Counter[str] = collections.Counter()
    by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    positions = 0
    for seed in seeds:
        for rank, sent in sends_per_rank(seed, fault).items():
            for nth in range(1, sent + 1):
                world, counts = run_with(
                    seed, rank, f"{fault}:nth={nth}" + (":ms=1" if fault == "late-frame" else "")
                )
                hit = [
                    k
                    for k, v in world.ranks[rank].faulty.counts.items()
                    if k.startswith(("dropped_", "late_")) and v
                ]
                assert len(hit) == 1, (seed, rank, nth, world.ranks[rank].faulty.counts)
                outcome = classify(world, counts)
                outcomes[outcome] += 1
                by_kind[hit[0].split("_", 1)[1]][outcome] += 1
                positions += 1
    print(f"\n{fault}: {positions} positions over seeds {seeds}: {dict(outcomes)}")
    for kind, c in sorted(by_kind.items()):
        print(f"  {kind:<17} {dict(c)}")
    assert outcomes["fail-stop at deadline"] > 0  # the deadline path is really exercised
    assert (
        by_kind["REQUEST_DATA"]["fail-stop at deadline"] > 0
        and by_kind["KV_RESULT"]["fail-stop at deadline"] > 0
    )


@pytest.mark.sim
@pytest.mark.timeout(600)
def test_a_send_that_raises_at_any_position_is_resent_and_changes_nothing() -> None:
    positions = 0
    for seed in SEEDS:
        baseline = SimWorld(seed, SMALL).run()
        for rank, sent in sends_per_rank(seed, "send-raise").items():
            for nth in range(1, sent + 1):
                world, counts = run_with(seed, rank, f"send-raise:nth={nth}")
                assert world.ranks[rank].faulty.counts["send-raise"] == 1
                assert counts.get("fatal", 0) == 0 and counts["control_resent"] >= 1, (
                    seed,
                    rank,
                    nth,
                    counts,
                )
                assert counts["retired"] == baseline["retired"], (seed, rank, nth)
                positions += 1
    print(f"\nsend-raise: {positions} positions, every one resent, no fail-stop")


@pytest.mark.sim
@pytest.mark.timeout(120)
def test_frames_delayed_past_the_deadline_on_a_receiver_fail_stop_it_and_nothing_is_reused() -> None:
    """slow-control on a receiver: every frame it gets arrives 1 ms late. Its sessions cannot be proven
    in time; it must fail-stop at a deadline and retire nothing (oracle (a) would catch a retirement
    while a writer may still write; the count says none happened)."""
    for seed in MUTANT_SEEDS:
        world = SimWorld(seed, SMALL)
        rx = world.receivers[0]
        world.ranks[rx].faulty.set_plan("slow-control:ms=1")
        world.run()
        rank = world.ranks[rx]
        assert rank.fatal is not None and rank.fatal.reason.value == "deadline", (seed, rank.fatal)
        retired_there = [e for e in rank.recorder.events() if e[1] == "retire"]
        published = [e for e in rank.recorder.events() if e[1] == "open_receive"]
        assert published and not retired_there, (seed, len(published), len(retired_there))
        assert rank.pool.statistics().free < rank.pool.statistics().total  # held, never handed out


@pytest.mark.sim
@pytest.mark.timeout(600)
@pytest.mark.interpreted_only
def test_planted_bug_a_receiver_that_frees_on_its_timeout_is_caught_by_a_late_frame(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Planted bug: the timer every peer system ships - a session that timed out stops waiting for its
    writers. A late REQUEST_DATA then reaches a writer after its blocks went back to the pool; the
    oracles must reject it (tag a) at some late-frame position, where kvown itself passed above."""
    from kvown.core.actions import Outcome
    from kvown.core.receiver import ReceiveSession

    original = ReceiveSession.writer_claims
    monkeypatch.setattr(
        ReceiveSession, "writer_claims", lambda s: False if s.outcome is Outcome.TIMED_OUT else original(s)
    )
    caught = positions = 0
    for seed in MUTANT_SEEDS:
        for rank, sent in sends_per_rank(seed, "late-frame").items():
            if rank not in SimWorld(seed, SMALL).receivers:
                continue
            for nth in range(1, sent + 1):
                positions += 1
                try:
                    run_with(seed, rank, f"late-frame:nth={nth}:ms=1")
                except InvariantViolation as exc:
                    assert exc.fields.get("tag") == "a" or "(a)" in str(exc), str(exc)[:400]
                    caught += 1
    print(f"\ntimer mutant: caught at {caught} of {positions} late-frame positions on receivers")
    assert caught >= 1
