"""``kvown serve``: the subcommand is wired into the CLI, and its programs parse their options."""

from __future__ import annotations

import pytest

from kvown import cli
from kvown.apps.serve import cli as serve_cli


def test_serve_is_a_kvown_subcommand():
    assert cli.SUBCOMMANDS["serve"][0] == "kvown.apps.serve.cli:main"


def test_usage_and_unknown_program(capsys):
    assert serve_cli.main([]) == 2
    assert "kvown serve local --port 8000" in capsys.readouterr().err
    assert serve_cli.main(["frobnicate"]) == 2
    assert "unknown program" in capsys.readouterr().err


@pytest.mark.parametrize("program", ["prefill", "decode", "single", "router", "local"])
def test_every_program_has_help(program, capsys):
    with pytest.raises(SystemExit) as raised:
        serve_cli.main([program, "--help"])
    assert raised.value.code == 0
    assert f"kvown serve {program}" in capsys.readouterr().out


def test_servers_launched_apart_need_etcd(capsys):
    with pytest.raises(SystemExit) as raised:
        serve_cli.main(["decode", "--name", "decode-0"])
    assert raised.value.code == 2
    assert "--etcd" in capsys.readouterr().err
