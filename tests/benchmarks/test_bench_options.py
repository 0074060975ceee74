"""``kvown bench`` refuses a bad option by name, with exit status 2, before it measures anything.

Before: the world's ranks parsed the sizes themselves (``--w1-sizes abc`` printed a traceback from every
rank, ``--workloads w9`` ran nothing and exited 0), ``cost --sessions 0`` divided by zero after its set-up,
``descriptors --w4-mib 0`` raised from the layout, ``control --iters 0`` from NIXL, ``cost --parts foo``
measured nothing and exited 0. An MPI world's options are checked by the launcher before mpirun starts."""

from __future__ import annotations

import pytest

from kvown.apps import bench
from kvown.apps.benchmarks import control, cost, frozen, world

BAD = [
    (["--workloads", "w1,w9"], "--workloads: unknown w9"),
    (["--w1-sizes", "abc"], "--w1-sizes: 'abc'"),
    (["--w2-sizes", "64K,0"], "--w2-sizes: '64K,0'"),
    (["--w2-rates", "0,150"], "--w2-rates: '0,150'"),
    (["--w3-rates", "x"], "--w3-rates: 'x'"),
    (["--window", "0"], "--window: 0"),
    (["--spin-s", "0.5"], "--spin-s: must be in [0, 0.1] seconds"),  # TransferConfig's rule, before mpirun
    (["--idle-sleep-s", "0"], "--idle-sleep-s: must be > 0 here"),  # quiet_engines waits for a nap
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("argv,says", BAD)
def test_a_bad_option_is_refused_by_name(argv: list[str], says: str, refused) -> None:
    refused(world.parse_args, argv, says)


COUNTS = [
    (world.parse_args, ["--reps", "0"], "argument --reps: 0 (at least 1)"),
    (world.parse_args, ["--w2-sessions", "x"], "argument --w2-sessions: 'x' is not an integer"),
    (world.parse_args, ["--warmup", "-1"], "argument --warmup: -1 (at least 0)"),
    (cost.main, ["--sessions", "0"], "argument --sessions: 0 (at least 1)"),
    (cost.main, ["--parts", "engine,foo"], "--parts: unknown foo"),
    (cost.main, ["--w4-mib", "0"], "argument --w4-mib: 0 (at least 1)"),
    (control.main, ["--iters", "0"], "argument --iters: 0 (at least 1)"),
    (frozen.main, ["--runs", "0"], "argument --runs: 0 (at least 1)"),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("entry,argv,says", COUNTS)
def test_counts_and_parts_are_refused_by_name(entry, argv: list[str], says: str, refused) -> None:
    refused(entry, argv, says)


@pytest.mark.timeout(10)
def test_mutant_counts_taken_as_plain_ints_is_caught(monkeypatch, refused) -> None:
    """The bug: ``type=int``, so a zero went through to the measurement."""
    monkeypatch.setattr(world, "count", int)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        refused(*COUNTS[0])


@pytest.mark.timeout(10)
def test_the_defaults_and_quick_pass() -> None:
    assert world.parse_args([]).workloads == "w1,w2,w3"
    assert world.parse_args(["--quick", "--w2-sizes", "64K,1M"]).w2_rates == [0, 50]


def _launched(monkeypatch) -> list[list[str]]:
    started: list[list[str]] = []
    monkeypatch.setattr(bench, "run_bounded", lambda cmd, timeout_s, name: started.append(cmd) or 0)
    return started


def _check_no_world_for_a_bad_option(monkeypatch, capsys) -> None:
    started = _launched(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["world", "--workloads", "w9"])
    assert exit_info.value.code == 2 and started == []
    assert "--workloads: unknown w9" in capsys.readouterr().err


@pytest.mark.timeout(10)
def test_the_launcher_starts_no_world_for_a_bad_option(monkeypatch, capsys) -> None:
    _check_no_world_for_a_bad_option(monkeypatch, capsys)
    started = _launched(monkeypatch)
    assert bench.main(["fanin", "--w3-rates", "20"]) == 0 and len(started) == 1  # a good one is launched


@pytest.mark.timeout(10)
def test_mutant_launcher_without_the_check_starts_the_world(monkeypatch, capsys) -> None:
    """The bug: the options went to mpirun unchecked; the ranks found out, each on its own."""
    monkeypatch.setattr(bench, "_check_world_options", lambda workload, extra: None)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        _check_no_world_for_a_bad_option(monkeypatch, capsys)
