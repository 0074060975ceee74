"""``kvown demo`` refuses options it cannot run, by name, with exit status 2, before it starts a world.
Before, ``--cancel-rate 2`` or ``-0.5`` ran silently as "always" / "never", ``--timeout-s 0`` became the
default, and ``--deadline-s -1`` started a world that was killed at once (exit 1)."""

from __future__ import annotations

import pytest

from kvown.apps import demo

BAD = [
    (["--ranks", "3"], "--ranks must be an even number >= 2"),
    (["--requests", "-1"], "--requests must be >= 0"),
    (["--cancel-rate", "2"], "--cancel-rate must be a fraction in [0, 1]"),
    (["--cancel-rate", "-0.5"], "--cancel-rate must be a fraction in [0, 1]"),
    (["--timeout-s", "0"], "--timeout-s must be > 0"),
    (["--deadline-s", "-1"], "--deadline-s must be > 0"),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("argv,says", BAD)
def test_a_bad_option_is_refused_by_name(argv: list[str], says: str, refused) -> None:
    refused(demo._parse, argv, says)


@pytest.mark.timeout(10)
def test_the_edges_pass() -> None:
    args = demo._parse(["--requests", "0", "--cancel-rate", "1", "--timeout-s", "0.5"])
    assert (args.requests, args.cancel_rate, args.timeout_s) == (0, 1.0, 0.5)
    assert demo._parse(["--cancel-rate", "0"]).cancel_rate == 0.0


@pytest.mark.timeout(10)
def test_mutant_parse_without_the_range_checks_is_caught(monkeypatch, refused) -> None:
    """The bug: argparse's types only, so a rate of 2 was a valid float."""
    monkeypatch.setattr(demo, "_check_ranges", lambda ap, args: None)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        refused(demo._parse, ["--cancel-rate", "2"], "--cancel-rate")
