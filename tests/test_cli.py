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


def test_bench_without_a_name_runs_every_benchmark(tmp_path, capsys):
    from kvown.apps.bench import SCRIPTS, main

    assert main(["--dry-run", "--json", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(SCRIPTS)
    assert all(f"bench-{name}.json" in " ".join(lines) for name in SCRIPTS)
