"""``kvown qualify`` refuses options it cannot run, by name, with exit status 2, before it launches a
world. Before, ``--device tpu`` and ``--timeout-s -5`` launched and ended in "FAILED", ``--failstop-ranks
1`` failed inside the fail-stop world, and ``--test-hosts 0`` quietly qualified this machine alone."""

from __future__ import annotations

import pytest

from kvown.apps import qualify

BAD = [
    (["--device", "tpu"], "--device: 'tpu'"),
    (["--device", "cuda:x"], "--device: 'cuda:x'"),
    (["--test-hosts", "0"], "--test-hosts: 0 (1 to 200)"),
    (["--slots", "0"], "--slots: 0 (at least 1)"),
    (["--expect-hosts", "-1"], "--expect-hosts: -1 (at least 0)"),
    (["--failstop-ranks", "1"], "--failstop-ranks: 1"),
    (["--timeout-s", "-5"], "--timeout-s: -5.0 (must be > 0)"),
    (["--failstop-bound-s", "0"], "--failstop-bound-s: 0.0 (must be > 0)"),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("argv,says", BAD)
def test_a_bad_option_is_refused_by_name(argv: list[str], says: str, refused) -> None:
    refused(qualify.parse_args, argv, says)


@pytest.mark.timeout(10)
def test_what_deployments_use_passes() -> None:
    args = qualify.parse_args(["--device", "cuda:1", "--test-hosts", "3", "--failstop-ranks", "0"])
    assert (args.device, args.test_hosts, args.failstop_ranks) == ("cuda:1", 3, 0)
    assert qualify.parse_args(["--hosts", "a,b,c", "--failstop-ranks", "2"]).failstop_ranks == 2


@pytest.mark.timeout(10)
def test_mutant_without_the_range_checks_is_caught(monkeypatch, refused) -> None:
    """The bug: argparse's types only, so any device name and any bound went to a world."""
    monkeypatch.setattr(qualify, "_check_ranges", lambda ap, args: None)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        refused(qualify.parse_args, *BAD[0])
