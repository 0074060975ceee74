"""The oracles as classes of their own (kvown.testing.oracles): a violation names its oracle and tag, a
``Tally`` counts instead of raising, and the same checkers watch a ``DriverPair`` - where a planted bug
(an in-doubt WRITE taken as settled by an ack) is caught by ``RetirementProof`` and the clean code is not."""

from __future__ import annotations

import pytest

from kvown.cache.layout import KVLayout
from kvown.core.errors import InvariantViolation
from kvown.core.ids import make_request_id
from kvown.core.receiver import _Writer
from kvown.core.sender import SenderCore
from kvown.runtime.config import TransferConfig
from kvown.testing import oracles
from kvown.testing.fake_nixl import FakeOutcome, WriteFault
from kvown.testing.pair import RX, TX, DriverPair
from kvown.testing.sim import SimWorld

LAYOUT = KVLayout.standard(num_layers=1, num_blocks=16, tokens_per_block=2, num_kv_heads=2, head_dim=4, dtype="uint8")
CONFIG = TransferConfig(transfer_timeout_s=10e-6, grace_s=10e-6, control_retry_s=1e-6, aux_slots=4,
                        aux_slot_nbytes=8, metrics_port=0, canary=True)


@pytest.mark.interpreted_only
def test_a_violation_names_its_oracle_class_and_tag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SenderCore, "_source_ready", lambda self, s, op: True)  # post_before_source_ready
    with pytest.raises(InvariantViolation) as caught:
        SimWorld(0).run()
    assert caught.value.tag == "f" and caught.value.oracle == "WritesAfterReady", str(caught.value)[:300]


def test_a_tally_records_violations_instead_of_raising() -> None:
    tally = oracles.Tally()
    oracle = oracles.NoStreamHoles(tally, budget_ns=10)

    class Faulty:
        raised = {b"frame": 0}

    oracle.check(3, Faulty(), now=5)
    assert tally.count() == 0
    oracle.check(3, Faulty(), now=12)
    oracle.check(3, Faulty(), now=13)
    assert tally.count("g") == 2 and tally.count("a") == 0
    assert tally.violations[0].oracle == "NoStreamHoles" and "rank 3" in tally.violations[0].what


def _watched_in_doubt_transfer() -> tuple[oracles.Tally, bool]:
    """A pair whose WRITE reports ERROR for many polls, then DONE; the oracles watch every step."""
    pair = DriverPair(CONFIG, layout=LAYOUT)
    pair.fabric.inject_write(WriteFault(src="r0", outcome=FakeOutcome.ERR_THEN_DONE, err_polls=30))
    tally = oracles.Tally()
    proof = oracles.RetirementProof(tally, pair.fabric, b"k" * 32, LAYOUT.block_nbytes)
    evidence, pools = oracles.EvidenceOnce(tally), oracles.PoolAccounting(tally)
    rid = make_request_id(1, 1)
    ticket = pair.rx.submit_receive(rid, 2, (TX,))
    pair.run(ticket.future.done, steps=5)
    handle = ticket.future.result(0)
    pair.tx.send(rid, (0, 1))
    for _ in range(300):  # bounded: the clean run retires after the late DONE, well inside this
        pair.run(steps=1)
        views = pair.views()
        for view in views.values():
            evidence.check(view.rank, view.recorder, lambda line: None)
            pools.check(view.rank, view.pool)
        if handle.retired.is_set():
            proof.check(views[RX], rid, handle, (TX,), views)
            break
    return tally, handle.retired.is_set()


def test_the_oracles_watch_a_driver_pair_and_pass_the_clean_code() -> None:
    tally, retired = _watched_in_doubt_transfer()
    assert retired and tally.violations == []


@pytest.mark.interpreted_only
def test_the_retirement_oracle_catches_a_pair_that_settles_an_in_doubt_write_on_its_ack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Mutant: ``in_doubt_settles_on_ack`` of tests/sim/test_mutants.py, on a pair."""
    monkeypatch.setattr(_Writer, "settled", property(lambda w: w.stream_ended or w.acked))
    tally, retired = _watched_in_doubt_transfer()
    assert retired and tally.count("a") >= 1, tally.violations
    assert {v.oracle for v in tally.violations} == {"RetirementProof"}
    assert "may still touch its blocks" in tally.violations[0].what
