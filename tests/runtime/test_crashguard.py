"""Rank-crash guard: every case with an injected kill, fake clock and fake wait (no real sleeping),
plus a few with real threads where the point is that another thread does the killing."""

from __future__ import annotations

import math
import threading
import time

import pytest

from kvown.runtime.crashguard import (
    DEFAULT_GRACE_S,
    GRACE_ENV,
    CrashGuard,
    RankCrashWatchdog,
    arm_rank_crash_watchdog,
    grace_from_env,
    kill_after_grace,
    parse_grace_s,
    run_guarded,
)


class FakeTime:
    """A clock plus a ``wait(event, timeout)`` that advances it instead of sleeping."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.waits: list[float] = []
        self.during_wait = None  # optional callback run inside each wait

    def clock(self) -> float:
        return self.now

    def wait(self, event: threading.Event, timeout_s: float) -> bool:
        assert timeout_s > 0, "a negative or zero wait must never be attempted"
        self.waits.append(timeout_s)
        if self.during_wait is not None:
            self.during_wait()
        if event.is_set():
            return True
        self.now += timeout_s
        return False


class Kills:
    def __init__(self, fake: FakeTime | None = None, raises: BaseException | None = None) -> None:
        self.at: list[float] = []
        self.fake = fake
        self.raises = raises
        self.event = threading.Event()

    def __call__(self) -> None:
        self.at.append(self.fake.now if self.fake else time.monotonic())
        self.event.set()
        if self.raises is not None:
            raise self.raises


class FakeWatchdog:
    def __init__(self, deadline_s: float, log: list[str]) -> None:
        self.deadline_s = deadline_s
        self.log = log

    def cancel(self) -> None:
        self.log.append("cancel")


def fake_arm(fake: FakeTime, log: list[str], armed: list[dict] | None = None):
    def arm(kill, *, world_size, grace_s, error_delivered, clock, wait):
        log.append("arm")
        if armed is not None:
            armed.append(dict(world_size=world_size, grace_s=grace_s, error_delivered=error_delivered))
        return FakeWatchdog(fake.now + grace_s, log)

    return arm


def crashing_loop(exc: Exception):
    def loop(guard: CrashGuard) -> None:
        raise exc

    return loop


def clean_loop(guard: CrashGuard) -> None:
    for _ in range(3):
        pass
    guard.mark_completed()


# --------------------------------------------------------------------------- grace parsing


@pytest.mark.timeout(5)
@pytest.mark.parametrize(("raw", "expected"), [(None, 10.0), ("", 10.0), ("2.5", 2.5), ("0", 0.0), (" 3 ", 3.0)])
def test_grace_parsing(raw, expected) -> None:
    assert parse_grace_s(raw) == expected


@pytest.mark.timeout(5)
@pytest.mark.parametrize("raw", ["-1", "-0.5"])
def test_negative_grace_disables(raw) -> None:
    assert parse_grace_s(raw) is None


@pytest.mark.timeout(5)
@pytest.mark.parametrize("raw", ["ten", "1s", "nan", "NaN", "inf", "-inf", "Infinity"])
def test_malformed_or_non_finite_grace_falls_back_to_default_with_warning(raw) -> None:
    with pytest.warns(RuntimeWarning, match=GRACE_ENV):
        value = parse_grace_s(raw)
    assert value == DEFAULT_GRACE_S and math.isfinite(value)


@pytest.mark.timeout(5)
def test_grace_from_env(monkeypatch) -> None:
    monkeypatch.setenv(GRACE_ENV, "0.25")
    assert grace_from_env() == 0.25
    assert CrashGuard(lambda: None, world_size=2).grace_s == 0.25


# --------------------------------------------------------------------------- kill_after_grace


@pytest.mark.timeout(5)
def test_single_rank_is_exempt() -> None:
    fake, kills = FakeTime(), Kills()
    assert not kill_after_grace(kills, world_size=1, grace_s=0.0, clock=fake.clock, wait=fake.wait)
    assert kills.at == [] and arm_rank_crash_watchdog(kills, world_size=1, grace_s=1.0) is None


@pytest.mark.timeout(5)
def test_disabled_grace_never_kills() -> None:
    fake, kills = FakeTime(), Kills()
    assert not kill_after_grace(kills, world_size=2, grace_s=None, clock=fake.clock, wait=fake.wait)
    assert kills.at == [] and arm_rank_crash_watchdog(kills, world_size=2, grace_s=None) is None


@pytest.mark.timeout(5)
def test_one_grace_wait_then_one_kill() -> None:
    fake = FakeTime()
    kills = Kills(fake)
    assert kill_after_grace(kills, world_size=4, grace_s=10.0, clock=fake.clock, wait=fake.wait)
    assert fake.waits == [10.0] and kills.at == [1010.0]


@pytest.mark.timeout(5)
def test_past_deadline_kills_now_without_negative_wait() -> None:
    fake = FakeTime()
    kills = Kills(fake)
    assert kill_after_grace(kills, world_size=2, grace_s=10.0, deadline_s=fake.now - 3, clock=fake.clock,
                            wait=fake.wait)
    assert fake.waits == [] and kills.at == [1000.0]


@pytest.mark.timeout(5)
def test_zero_grace_kills_at_once() -> None:
    fake = FakeTime()
    kills = Kills(fake)
    assert kill_after_grace(kills, world_size=2, grace_s=0.0, clock=fake.clock, wait=fake.wait)
    assert fake.waits == [] and len(kills.at) == 1


@pytest.mark.timeout(5)
def test_cancel_disarms() -> None:
    fake, kills = FakeTime(), Kills()
    cancelled = threading.Event()
    cancelled.set()
    assert not kill_after_grace(kills, world_size=2, grace_s=5.0, cancelled=cancelled, clock=fake.clock,
                                wait=fake.wait)
    assert kills.at == []


@pytest.mark.timeout(5)
def test_delivery_is_checked_after_the_grace_not_before() -> None:
    fake, kills = FakeTime(), Kills()
    delivered = threading.Event()
    fake.during_wait = delivered.set  # the error reaches a client during the grace
    assert not kill_after_grace(kills, world_size=2, grace_s=5.0, error_delivered=delivered, clock=fake.clock,
                                wait=fake.wait)
    assert fake.waits == [5.0] and kills.at == []


@pytest.mark.timeout(5)
def test_undelivered_error_kills() -> None:
    fake, kills = FakeTime(), Kills()
    assert kill_after_grace(kills, world_size=2, grace_s=5.0, error_delivered=threading.Event(),
                            clock=fake.clock, wait=fake.wait)
    assert len(kills.at) == 1


@pytest.mark.timeout(5)
def test_kill_after_grace_never_raises() -> None:
    fake = FakeTime()
    assert not kill_after_grace(Kills(raises=RuntimeError("Abort broke")), world_size=2, grace_s=0.0,
                                clock=fake.clock, wait=fake.wait)


# --------------------------------------------------------------------------- the real timer thread


@pytest.mark.timeout(5)
def test_watchdog_deadline_is_grace_from_arming_and_kills_while_caller_blocks() -> None:
    kills = Kills()
    t0 = time.monotonic()
    wd = arm_rank_crash_watchdog(kills, world_size=2, grace_s=0.1)
    assert isinstance(wd, RankCrashWatchdog) and wd.name == "kvown-rank-crash" and wd.daemon
    assert t0 <= wd.deadline_s - 0.1 <= time.monotonic()
    assert kills.event.wait(2)  # nobody helps: the caller just waits
    assert kills.at[0] >= wd.deadline_s
    wd.join(1)
    assert wd.killed


@pytest.mark.timeout(5)
def test_watchdog_cancel_breaks_the_wait_at_once() -> None:
    kills = Kills()
    wd = arm_rank_crash_watchdog(kills, world_size=2, grace_s=30.0)
    t0 = time.monotonic()
    wd.cancel()
    wd.cancel()  # twice is fine
    wd.join(10)
    assert not wd.is_alive() and time.monotonic() - t0 < 10  # the 30 s grace was not waited out
    assert kills.at == [] and not wd.killed


# --------------------------------------------------------------------------- the guard


@pytest.mark.timeout(5)
def test_crash_order_is_arm_cleanup_cancel_kill_on_original_deadline() -> None:
    fake, log = FakeTime(), []
    kills = Kills(fake)
    guard = CrashGuard(lambda: (log.append("kill"), kills()), world_size=2, grace_s=10.0, clock=fake.clock,
                       wait=fake.wait, arm=fake_arm(fake, log))
    boom = ValueError("loop died")

    def cleanup() -> None:
        log.append("cleanup")
        fake.now += 3.0  # cleanup takes 3 s of the grace

    with pytest.raises(ValueError) as info:
        guard.run(crashing_loop(boom), cleanup)
    assert info.value is boom and guard.error is boom
    assert log == ["arm", "cleanup", "cancel", "kill"]
    assert fake.waits == [7.0]  # only the remainder: handover keeps the original deadline
    assert kills.at == [1010.0] and guard.killed


@pytest.mark.timeout(5)
def test_both_kill_paths_get_this_guards_delivery_gate() -> None:
    fake, log, armed = FakeTime(), [], []
    gate = threading.Event()
    guard = CrashGuard(Kills(fake), world_size=2, grace_s=1.0, error_delivered=gate, clock=fake.clock,
                       wait=fake.wait, arm=fake_arm(fake, log, armed))
    fake.during_wait = gate.set
    with pytest.raises(ValueError):
        guard.run(crashing_loop(ValueError()), lambda: None)
    assert armed[0]["error_delivered"] is gate and guard.error_delivered is gate
    assert not guard.killed  # the inline path honoured the same gate


@pytest.mark.timeout(5)
def test_cleanup_that_raises_cannot_skip_the_kill() -> None:
    fake, log = FakeTime(), []
    guard = CrashGuard(Kills(fake), world_size=2, grace_s=1.0, clock=fake.clock, wait=fake.wait,
                       arm=fake_arm(fake, log))
    boom = ValueError("loop")

    def bad_cleanup() -> None:
        raise OSError("cleanup broke")

    with pytest.raises(ValueError) as info:
        guard.run(crashing_loop(boom), bad_cleanup)
    assert info.value is boom  # the loop's error is not masked
    assert isinstance(guard.cleanup_error, OSError) and guard.killed


@pytest.mark.timeout(5)
@pytest.mark.parametrize("arm_result", ["none", "raises"])
def test_watchdog_that_cannot_arm_still_gets_the_inline_kill_with_a_full_grace(arm_result) -> None:
    fake = FakeTime()

    def arm(*args, **kwargs):
        if arm_result == "raises":
            raise RuntimeError("can't start new thread")
        return None

    guard = CrashGuard(Kills(fake), world_size=2, grace_s=4.0, clock=fake.clock, wait=fake.wait, arm=arm)
    with pytest.raises(ValueError):
        guard.run(crashing_loop(ValueError()), lambda: None)
    assert fake.waits == [4.0] and guard.killed


@pytest.mark.timeout(5)
def test_clean_exit_runs_cleanup_and_never_arms() -> None:
    fake, log = FakeTime(), []
    guard = CrashGuard(Kills(fake), world_size=2, grace_s=1.0, clock=fake.clock, wait=fake.wait,
                       arm=fake_arm(fake, log))
    cleaned = []
    guard.run(clean_loop, lambda: cleaned.append(True))
    assert cleaned == [True] and log == [] and not guard.killed


@pytest.mark.timeout(5)
def test_raise_after_completion_is_teardown_not_a_crash() -> None:
    fake, log = FakeTime(), []
    guard = CrashGuard(Kills(fake), world_size=2, grace_s=1.0, clock=fake.clock, wait=fake.wait,
                       arm=fake_arm(fake, log))

    def loop(g: CrashGuard) -> None:
        g.mark_completed()
        raise RuntimeError("context manager __exit__ failed")

    with pytest.raises(RuntimeError):
        guard.run(loop, lambda: None)
    assert log == [] and not guard.killed and guard.error is None


@pytest.mark.timeout(5)
def test_pre_loop_failure_kills() -> None:
    fake, log = FakeTime(), []
    guard = CrashGuard(Kills(fake), world_size=2, grace_s=1.0, clock=fake.clock, wait=fake.wait,
                       arm=fake_arm(fake, log))

    def loop(g: CrashGuard) -> None:
        raise ImportError("profiler setup failed")  # before the loop body ever ran

    with pytest.raises(ImportError):
        guard.run(loop, lambda: None)
    assert guard.killed and log[0] == "arm"


@pytest.mark.timeout(5)
def test_rank_local_shutdown_flag_does_not_disarm() -> None:
    """Regression from the reference design: a rank-local 'shutting down' state plus a later raise is
    still a crash, because only the completion sentinel counts."""
    fake, log = FakeTime(), []
    guard = CrashGuard(Kills(fake), world_size=2, grace_s=1.0, clock=fake.clock, wait=fake.wait,
                       arm=fake_arm(fake, log))
    state = {"is_shutdown": False}

    def loop(g: CrashGuard) -> None:
        state["is_shutdown"] = True  # e.g. a device fault classified as fatal on this rank only
        raise AttributeError("'NoneType' object has no attribute 'logits'")

    with pytest.raises(AttributeError):
        guard.run(loop, lambda: None)
    assert guard.killed


@pytest.mark.timeout(5)
def test_second_run_after_a_clean_first_run_still_kills() -> None:
    fake, log = FakeTime(), []
    guard = CrashGuard(Kills(fake), world_size=2, grace_s=1.0, clock=fake.clock, wait=fake.wait,
                       arm=fake_arm(fake, log))
    guard.run(clean_loop, lambda: None)  # warmup: sets the sentinel
    with pytest.raises(ValueError):
        guard.run(crashing_loop(ValueError("serve died")), lambda: None)
    assert guard.killed


@pytest.mark.timeout(5)
def test_delivered_error_means_no_kill() -> None:
    fake, log = FakeTime(), []
    guard = CrashGuard(Kills(fake), world_size=2, grace_s=2.0, clock=fake.clock, wait=fake.wait,
                       arm=fake_arm(fake, log))

    def cleanup() -> None:
        guard.error_delivered.set()  # e.g. the API handed guard.error to the waiting client

    with pytest.raises(ValueError):
        guard.run(crashing_loop(ValueError()), cleanup)
    assert not guard.killed and fake.waits == [2.0]


@pytest.mark.timeout(5)
@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(0)])
def test_base_exceptions_never_arm(exc) -> None:
    fake, log = FakeTime(), []
    guard = CrashGuard(Kills(fake), world_size=2, grace_s=0.0, clock=fake.clock, wait=fake.wait,
                       arm=fake_arm(fake, log))

    def loop(g: CrashGuard) -> None:
        raise exc

    with pytest.raises(type(exc)):
        guard.run(loop, lambda: None)
    assert log == [] and not guard.killed


@pytest.mark.timeout(5)
def test_guard_never_raises_its_own_errors() -> None:
    fake, log = FakeTime(), []
    guard = CrashGuard(Kills(fake, raises=RuntimeError("Abort broke")), world_size=2, grace_s=0.0,
                       clock=fake.clock, wait=fake.wait, arm=fake_arm(fake, log))
    boom = ValueError("loop")
    with pytest.raises(ValueError) as info:
        guard.run(crashing_loop(boom), lambda: None)
    assert info.value is boom


@pytest.mark.timeout(5)
def test_single_rank_guard_is_exempt() -> None:
    fake = FakeTime()
    kills = Kills(fake)
    with pytest.raises(ValueError):
        run_guarded(crashing_loop(ValueError()), lambda: None, kill=kills, world_size=1, grace_s=0.0,
                    clock=fake.clock, wait=fake.wait)
    assert kills.at == []


@pytest.mark.timeout(10)
def test_cleanup_blocked_forever_is_killed_on_the_original_deadline() -> None:
    """Real threads: the cleanup never returns (until the test lets it go); the timer kills anyway."""
    kills = Kills()
    release = threading.Event()
    guard = CrashGuard(kills, world_size=2, grace_s=1.0)
    crashed_at: list[float] = []

    def loop(g: CrashGuard) -> None:
        crashed_at.append(time.monotonic())
        raise ValueError("boom")

    runner = threading.Thread(
        target=lambda: pytest.raises(ValueError, guard.run, loop, lambda: release.wait(8)), daemon=True
    )
    runner.start()
    assert kills.event.wait(6)
    late_s = kills.at[0] - crashed_at[0]
    assert 1.0 <= late_s < 2.0  # on the original deadline, not crash + 2 x grace
    release.set()
    runner.join(3)
    assert len(kills.at) == 1 and guard.killed  # the inline handover did not kill a second time
