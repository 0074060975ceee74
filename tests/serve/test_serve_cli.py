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


BAD_OPTIONS = [
    (["single", "--port", "70000"], "port must be 0-65535", "field='port'"),
    (["single", "--num-blocks", "0"], "num_blocks must be a positive integer", "field='num_blocks'"),
    (["single", "--device", "tpu"], "device must be auto, cpu, cuda or cuda:N", "field='device'"),
    (["single", "--threads", "0"], "threads must be a positive integer", "field='threads'"),
    (["single", "--landing-timeout", "0"], "landing_timeout_s must be > 0", "field='landing_timeout_s'"),
    (["single", "--heads", "3", "--kv-heads", "2"], "multiple of num_kv_heads", "field='num_kv_heads'"),
    (["prefill", "--etcd", "http://127.0.0.1:1", "--lease-ttl", "0"], "lease_ttl_s", "field='lease_ttl_s'"),
    (["router", "--etcd", "http://127.0.0.1:1", "--port", "-1"], "port must be 0-65535", "field='port'"),
    (["router", "--etcd", "http://127.0.0.1:1", "--request-timeout", "0"], "request_timeout_s", "value=0.0"),
    (["local", "--port", "65536"], "port must be 0-65535", "field='port'"),
    (["vllm", "--port", "70000"], "port must be 0-65535", "field='port'"),
    (["vllm", "--kv-cache-bytes", "0"], "must be a positive integer", "field='kv_cache_memory_bytes'"),
    (["vllm", "--start-timeout", "0"], "start_timeout_s must be > 0", "field='start_timeout_s'"),
]


def _never_started(monkeypatch, started: list) -> None:
    """Stand-ins for the three programs' runs: they only record that one was reached."""
    from kvown.apps.serve import local, router, server
    from kvown.apps.serve.vllm import stack

    def reached(what):
        started.append(what)
        return 0

    monkeypatch.setattr(server, "serve", reached)
    monkeypatch.setattr(router, "serve_router", reached)
    monkeypatch.setattr(local.LocalStack, "start", reached)
    monkeypatch.setattr(local.LocalStack, "dead", lambda self: ["stand-in"])  # the loop ends at once
    monkeypatch.setattr(stack.VllmStack, "start", reached)
    monkeypatch.setattr(stack.VllmStack, "dead", lambda self: ["stand-in"])


def _check_refused(argv: list[str], says: str, field: str, monkeypatch, capsys) -> None:
    started: list = []
    _never_started(monkeypatch, started)
    assert serve_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and field in err and err.startswith(f"kvown serve {argv[0]}: ")
    assert started == []


@pytest.mark.parametrize("argv,says,field", BAD_OPTIONS)
def test_a_bad_option_is_refused_by_name_before_anything_starts(argv, says, field, monkeypatch, capsys):
    _check_refused(argv, says, field, monkeypatch, capsys)


def test_mutant_config_without_its_checks_is_caught(monkeypatch, capsys):
    """The bug: ServeConfig took any value, so the server got as far as bind() (OverflowError)."""
    from kvown.apps.serve.server import ServeConfig

    monkeypatch.setattr(ServeConfig, "__post_init__", lambda self: None)
    with pytest.raises(AssertionError):
        _check_refused(*BAD_OPTIONS[0], monkeypatch, capsys)
