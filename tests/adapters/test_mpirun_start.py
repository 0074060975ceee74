"""``launcher_failed_to_start`` (kvown/adapters/mpirun.py rule 4): only a launcher that started no rank
and names a known Open MPI start-up failure is worth a second launch."""

from __future__ import annotations

from kvown.adapters.mpirun import LAUNCHER_START_FAILURES, launcher_failed_to_start

PMIX_LOG = ("--------\nThe PMIx server's listener thread failed to start. We cannot\n"
            "continue.\n--------\n")


def test_a_pmix_listener_failure_before_any_rank_is_a_start_failure():
    assert launcher_failed_to_start(PMIX_LOG, ranks_started=False)
    assert all(launcher_failed_to_start(m, ranks_started=False) for m in LAUNCHER_START_FAILURES)


def test_a_world_whose_ranks_ran_is_never_relaunched():
    assert not launcher_failed_to_start(PMIX_LOG, ranks_started=True)


def test_any_other_failure_is_the_runs_own():
    assert not launcher_failed_to_start("kvown FAIL-STOP rank=0 reason=deadline\n", ranks_started=False)
    assert not launcher_failed_to_start("", ranks_started=False)
