"""The bad-API-input matrix in process, with a planted bug it must catch.

The same 22 cases as the real-world matrix (tests/multiproc/test_runtime_world.py, ``bad-input``), run
against the production facades of a simulated world's ranks (no threads: the engines are never
started). Each bad call must raise ``LocalProtocolError`` naming the argument in the caller, queue
nothing for the engine and leave the pool as it was. With one validator of ``kvown.api`` disabled
(the planted bug), cases must fail this check - so the matrix can turn red.
"""

from __future__ import annotations

import pytest

from kvown.core.errors import LocalProtocolError
from kvown.core.ids import make_request_id
from kvown.testing.sim import SimConfig, SimWorld

GOOD = make_request_id(9, 1)


class NoQuery:
    pass


def cases(world: SimWorld) -> dict[str, tuple[int, object]]:
    """name -> (rank, call). Ranks: the first sender and the first receiver of the world."""
    tx, rx = world.senders[0], world.receivers[0]
    s, r = world.ranks[tx].api, world.ranks[rx].api
    rid = lambda n: make_request_id(9, n)  # noqa: E731
    return {
        "src_blocks_empty": (tx, lambda: s.send(rid(30), ())),
        "src_blocks_out_of_range": (tx, lambda: s.send(rid(31), (0, 999))),
        "ready_without_query": (tx, lambda: s.send(rid(32), (0,), ready=NoQuery())),
        "aux_too_big": (tx, lambda: s.send(rid(33), (0,), aux=b"x" * 4096)),
        "aux_str": (tx, lambda: s.send(rid(34), (0,), aux="text")),
        "num_pieces_zero": (tx, lambda: s.send(rid(35), (0,), num_pieces=0)),
        "num_receivers_zero": (tx, lambda: s.send(rid(36), (0,), num_receivers=0)),
        "duplicate_send": (tx, lambda: s.send(GOOD, (5, 6))),
        "writers_self": (rx, lambda: r.submit_receive(rid(10), 1, (rx,))),
        "writers_unknown_rank": (rx, lambda: r.submit_receive(rid(11), 1, (99,))),
        "writers_minus_one": (rx, lambda: r.submit_receive(rid(12), 1, (-1,))),
        "writers_empty": (rx, lambda: r.submit_receive(rid(13), 1, ())),
        "writers_duplicated": (rx, lambda: r.submit_receive(rid(14), 1, (tx, tx))),
        "num_slices_zero": (rx, lambda: r.submit_receive(rid(15), 1, (tx,), num_slices=0)),
        "num_slices_not_dividing": (rx, lambda: r.submit_receive(rid(16), 1, (tx,), num_slices=2)),
        "num_blocks_zero": (rx, lambda: r.submit_receive(rid(17), 0, (tx,))),
        "num_blocks_too_many": (rx, lambda: r.submit_receive(rid(18), 999, (tx,))),
        "request_id_negative": (rx, lambda: r.submit_receive(-5, 1, (tx,))),
        "local_copy_without_query": (rx, lambda: r.local_copy(rid(19), NoQuery())),
        "release_unknown": (rx, lambda: r.release(rid(20))),
        "timeout_nan": (rx, lambda: r.submit_receive(rid(21), 1, (tx,), timeout_s=float("nan"))),
        "duplicate_receive": (rx, lambda: r.submit_receive(GOOD, 2, (tx,))),
    }


def run_matrix() -> dict[str, str]:
    """Each case's verdict: "ok" or what went wrong."""
    world = SimWorld(0, SimConfig(num_requests=1))
    tx, rx = world.senders[0], world.receivers[0]
    world.ranks[tx].api.send(GOOD, (3, 4))  # the live ids the duplicate cases collide with
    world.ranks[rx].api.submit_receive(GOOD, 2, (tx,))
    verdicts = {}
    for name, (rank, call) in cases(world).items():
        driver = world.ranks[rank].driver
        pool_before, queued_before = driver.pool.statistics(), len(driver.inbox)
        try:
            call()
            verdict = "accepted"
        except LocalProtocolError as exc:
            verdict = "ok" if exc.fields.get("field") else "no field named"
        except Exception as exc:
            verdict = f"untyped {type(exc).__name__}: {exc}"
        if len(driver.inbox) != queued_before:
            verdict += " +queued"
        if driver.pool.statistics() != pool_before:
            verdict += " +pool changed"
        verdicts[name] = verdict
    return verdicts


def test_every_bad_argument_is_a_typed_error_in_the_caller_and_reaches_nothing() -> None:
    verdicts = run_matrix()
    assert len(verdicts) == 22
    assert {n: v for n, v in verdicts.items() if v != "ok"} == {}


def test_planted_bug_a_disabled_validator_turns_the_matrix_red(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvown.api as api

    monkeypatch.setattr(api, "_positive_int", lambda value, field, at_most=None: value)
    verdicts = run_matrix()
    red = {n for n, v in verdicts.items() if v != "ok"}
    assert {"num_blocks_zero", "num_blocks_too_many", "num_pieces_zero", "num_receivers_zero"} <= red, (
        verdicts
    )
    assert all("+queued" in verdicts[n] or "untyped" in verdicts[n] for n in red), verdicts
