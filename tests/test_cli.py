"""The ``kvown`` command line: version, lazy dispatch, argv passed through, missing modules."""

from __future__ import annotations

import sys
import types

import pytest

import kvown
from kvown import cli


@pytest.mark.timeout(30)
def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        cli.main(["--version"])
    assert raised.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvown {kvown.__version__}"


@pytest.mark.timeout(30)
def test_no_command_and_unknown_command_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "choose a command" in capsys.readouterr().err
    with pytest.raises(SystemExit) as raised:
        cli.main(["frobnicate"])
    assert raised.value.code == 2


@pytest.mark.timeout(30)
@pytest.mark.parametrize("command", sorted(cli.SUBCOMMANDS))
def test_every_command_passes_its_argv_through_unchanged(monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    module_name, function_name = cli.SUBCOMMANDS[command][0].split(":")
    seen: list[list[str]] = []
    fake = types.ModuleType(module_name)
    setattr(fake, function_name, lambda argv: seen.append(argv) or 7)
    monkeypatch.setitem(sys.modules, module_name, fake)
    assert cli.main([command, "--json", "-n", "3", "--help", "rest"]) == 7
    assert seen == [["--json", "-n", "3", "--help", "rest"]]


@pytest.mark.timeout(30)
def test_missing_module_returns_2_with_a_clear_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(cli.SUBCOMMANDS, "demo", ("kvown.no_such_module:main", "test"))
    assert cli.main(["demo"]) == 2
    assert "not available in this build" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_missing_dependency_inside_an_existing_module_is_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    def import_module(name: str) -> types.ModuleType:
        raise ModuleNotFoundError("No module named 'zmq'", name="zmq")

    monkeypatch.setattr(cli.importlib, "import_module", import_module)
    with pytest.raises(ModuleNotFoundError):
        cli.main(["bench"])


def test_bench_without_a_name_runs_the_suite(tmp_path, capsys):
    """``kvown bench`` alone is the issue-12 suite: every workload as a module of the package, so a wheel
    with no checkout runs it; the quick plan (CI's) fits one mpirun world plus W5."""
    from kvown.apps.bench import REGISTRY, main

    assert main(["--dry-run", "--json", str(tmp_path / "out.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" -m ")[1].split()[0] for line in lines] == [
        "kvown.apps.benchmarks.cost", "kvown.apps.benchmarks.world", "kvown.apps.benchmarks.world",
        "kvown.apps.benchmarks.frozen"]
    assert "mpirun" in lines[1] and "-n 2" in lines[1] and "-n 4" in lines[2]
    assert main(["--quick", "--dry-run"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
    assert all(w.module.startswith("kvown.") or w.script for w in REGISTRY.values())


def test_registry_takes_a_new_workload_in_one_line(monkeypatch, capsys):
    from kvown.apps import bench

    monkeypatch.setitem(bench.REGISTRY, "burn", bench.Workload("kvown.apps.burn", None, "burn"))
    assert bench.main(["burn", "--dry-run", "--seed", "3"]) == 0
    assert capsys.readouterr().out.split()[-4:] == ["-m", "kvown.apps.burn", "--seed", "3"]
    assert bench.main(["soak", "--dry-run", "--minutes", "1"]) == 0  # the documented soak is registered
    assert capsys.readouterr().out.split()[-4:] == ["-m", "kvown.apps.soak", "--minutes", "1"]


def test_checkout_only_workloads_say_so_without_a_checkout(monkeypatch, tmp_path, capsys):
    from kvown.apps import bench
    from kvown.apps.benchmarks import registry

    monkeypatch.setattr(registry, "CHECKOUT", tmp_path)  # as from a wheel: no benchmarks/ beside the package
    assert bench.main(["failstop"]) == 2
    assert "source checkout" in capsys.readouterr().err
    assert bench.main(["world", "--dry-run"]) == 0  # a package workload needs nothing beside it
