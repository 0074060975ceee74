"""An idle engine naps longer only when its rank is quiet (engine rule 3): each wake-up takes the GIL
from the code beside kvown (``kvown bench idle``), but a rank with anything open must keep answering
its peers within ``idle_sleep_s``. ``Driver.quiet`` must agree with the tables ``audit`` counts, so
that no open session, WRITE, resend or held frame is ever left to a long nap."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from types import SimpleNamespace

import pytest

from kvown.runtime.config import TransferConfig
from kvown.runtime.driver import Driver
from kvown.runtime.engine import Engine
from kvown.testing.sim import SimConfig, SimWorld

WINDOW_S = 0.4
NAP = dict(spin_s=0.0, idle_sleep_s=200e-6, idle_sleep_max_s=0.01)


def _idle_engine(quiet: bool, **config: float) -> tuple[Engine, SimpleNamespace]:
    """The real loop over a driver that never moves; ``driver.steps`` counts its turns."""
    driver = SimpleNamespace(rank=0, fatal=None, steps=0, inbox=collections.deque(), seen_ns=[],
                             recorder=SimpleNamespace(record=lambda *a, **k: None),
                             config=TransferConfig(**{**NAP, **config}), quiet=lambda: quiet)

    def step(now_ns: int, frames_first: bool = False) -> bool:
        driver.steps += 1
        while driver.inbox:
            driver.seen_ns.append(time.monotonic_ns() - driver.inbox.popleft())
        return False

    driver.step = step
    driver.submit = driver.inbox.append
    return Engine(driver, fail_stop=lambda action: None), driver  # type: ignore[arg-type]


def _turns(quiet: bool) -> int:
    engine, driver = _idle_engine(quiet)
    engine.start()
    try:
        time.sleep(0.05)  # past the back-off's climb (200 us ... 10 ms: 13 ms in all)
        before = driver.steps
        time.sleep(WINDOW_S)
        return driver.steps - before
    finally:
        engine.stop()


@pytest.mark.timeout(30)
def test_a_quiet_rank_naps_up_to_the_ceiling_and_an_open_one_keeps_short_naps() -> None:
    quiet, live = _turns(quiet=True), _turns(quiet=False)
    assert quiet <= 2 * WINDOW_S / NAP["idle_sleep_max_s"], f"{quiet} turns in {WINDOW_S} s: no back-off"
    assert live > 4 * quiet, f"an open rank turned {live} times against a quiet one's {quiet}: it backed off"


@pytest.mark.timeout(30)
def test_a_command_wakes_a_quiet_engine_from_its_long_nap() -> None:
    engine, driver = _idle_engine(True, idle_sleep_max_s=0.1)
    engine.start()
    try:
        for _ in range(5):
            time.sleep(0.3)  # the nap has climbed to 100 ms
            engine.submit(time.monotonic_ns())
        deadline = time.monotonic() + 5
        while len(driver.seen_ns) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.stop()
    waits_ms = sorted(ns / 1e6 for ns in driver.seen_ns)
    assert len(waits_ms) == 5 and waits_ms[2] < 30, f"command -> step: {waits_ms} ms (naps of 100 ms)"


def test_the_ceiling_is_validated_by_name() -> None:
    from kvown import ConfigError

    for bad in (-1e-3, 0.5, float("nan"), "0.01", True):
        with pytest.raises(ConfigError) as info:
            TransferConfig(idle_sleep_max_s=bad)
        assert info.value.field == "idle_sleep_max_s"


# ---- after a nap, frames before the command that ended it -------------------------------------------------


def _cancelled_publication_then_send() -> tuple[str, int]:
    """A writer napping 100 ms gets a publication and its cancel, then its ``send``: the send's outcome and
    the bytes the writer wrote. Real NIXL, two ranks in one process."""
    import kvown
    from kvown import KVLayout, make_request_id

    layout = KVLayout.standard(num_layers=1, num_blocks=8, tokens_per_block=16, num_kv_heads=1, head_dim=64)
    config = TransferConfig(spin_s=0.002, idle_sleep_s=0.1, idle_sleep_max_s=0.1)
    rts = kvown.connect_local({0: {"receiver"}, 1: {"sender"}}, config=config, layout=layout)
    rx, tx = rts[0], rts[1]
    try:
        rid = make_request_id(1, 1)
        tx.sender.cancel(make_request_id(1, 99))  # a command: the writer steps, then starts a 100 ms nap
        time.sleep(0.005)
        handle = rx.receiver.receive(rid, 2, writers=(1,))
        rx.receiver.cancel(rid)
        time.sleep(0.02)  # both frames wait in the writer's NIXL agent; its nap has ~70 ms to go
        sent = tx.sender.send(rid, (0, 1))
        assert handle.retired.wait(10) and sent.released.wait(10)
        return sent.outcome.result(1).value, tx.statistics().counters.get("bytes_written", 0)
    finally:
        for rt in rts.values():
            rt.close()


@pytest.mark.timeout(60)
def test_a_send_after_a_nap_meets_the_cancel_that_came_first_and_writes_nothing() -> None:
    outcome, written = _cancelled_publication_then_send()
    assert (outcome, written) == ("cancelled", 0)


@pytest.mark.interpreted_only
@pytest.mark.timeout(60)
def test_mutant_commands_first_after_a_nap_writes_into_a_cancelled_request(monkeypatch) -> None:
    step = Driver.step
    monkeypatch.setattr(Driver, "step", lambda self, now_ns, frames_first=False: step(self, now_ns))
    outcome, written = _cancelled_publication_then_send()
    assert written > 0, "the send opened before the cancel it came after was read, and still wrote nothing"


# ---- Driver.quiet against the audit, over the simulated world -------------------------------------------


def _disagreements(seeds: range) -> tuple[int, int, list[str]]:
    """(quiet checks, busy checks, disagreements) after every step of each seed's world."""
    quiet = busy = 0
    bad: list[str] = []
    for seed in seeds:
        world = SimWorld(seed, SimConfig.for_seed(seed))
        for _ in range(20_000):
            if not world.step():
                break
            for r, rank in world.ranks.items():
                driver = rank.driver
                if driver.fatal is not None or rank.fatal is not None or r in world.dead:
                    continue
                tables = driver.audit(check_canaries=False).tables
                empty = not any(tables.values())
                quiet += empty
                busy += not empty
                if driver.quiet() != empty:
                    bad.append(f"seed {seed} rank {r}: quiet() {driver.quiet()}, tables {dict(tables)}")
    return quiet, busy, bad


def _not_quiet_at_the_end(seeds: range, **profile: float) -> tuple[int, list[str]]:
    """(clean worlds, ranks not quiet). Once a world without deaths or fail-stops has ended (its servers'
    last cancels included), every rank is quiet: one that served requests and stayed busy would never
    back off again. (A dead or fail-stopped peer can leave a publication saved on a writer: that world is
    gone in production.) ``profile``: fields of each seed's ``SimConfig`` to override."""
    clean, bad = 0, []
    for seed in seeds:
        world = SimWorld(seed, dataclasses.replace(SimConfig.for_seed(seed), **profile))
        world.run()
        ranks = world.ranks.values()
        if world.dead or any(rank.fatal is not None or rank.driver.fatal is not None for rank in ranks):
            continue
        clean += 1
        bad += [f"seed {seed} rank {rank.rank}: not quiet at the end, {dict(rank.driver.audit().tables)}"
                for rank in ranks if not rank.driver.quiet()]
    return clean, bad


# releases that raise on a third of DONE handles: the worlds where the retry matters (the mutant's seeds)
RELEASES_RAISE = {"p_release_raise": 0.3}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seeds, profile", [(range(200), {}), (range(60), RELEASES_RAISE)],
                         ids=["for_seed", "releases_raise"])
def test_every_rank_of_a_clean_world_ends_quiet(seeds, profile) -> None:
    clean, bad = _not_quiet_at_the_end(seeds, **profile)
    assert not bad, bad[:5]
    assert clean > len(seeds) / 2, clean


@pytest.mark.interpreted_only
@pytest.mark.timeout(300)
def test_mutant_release_never_retried_leaves_a_rank_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    # the simulator wakes a rank only for a failed send: a DONE handle whose release raised stays
    monkeypatch.setattr(Driver, "retry_due", lambda self: bool(self.resend))
    _, bad = _not_quiet_at_the_end(range(60), **RELEASES_RAISE)
    assert any("unreleased_handles': 1" in line for line in bad), bad[:5]


@pytest.mark.timeout(300)
def test_quiet_agrees_with_the_audit_tables() -> None:
    quiet, busy, bad = _disagreements(range(6))
    assert not bad, bad[:5]
    assert quiet > 10 and busy > 100, (quiet, busy)  # both answers were really asked for


@pytest.mark.interpreted_only
@pytest.mark.timeout(300)
def test_mutant_quiet_blind_to_open_sessions_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def blind(self: Driver) -> bool:  # forgets the cores' sessions (a publication saved, a receive open)
        return not (self.inbox or self._writes or self.resend)

    monkeypatch.setattr(Driver, "quiet", blind)
    _, _, bad = _disagreements(range(6))
    assert bad, "a quiet() blind to open sessions went unnoticed"
