"""``kvown bench idle`` measures what it says: an engine napping 200 us (fixed, or because a send is open)
burns several times the CPU of a quiet one that backs off, and every mode of every round is in the JSON."""

from __future__ import annotations

import json

import pytest

from kvown.apps.benchmarks import idle


@pytest.mark.timeout(120)
def test_quick_run_reports_every_mode_against_alone(tmp_path, capsys) -> None:
    out = tmp_path / "idle.json"
    assert idle.main(["--quick", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert len(r["rounds"]) == 3 and all(set(rd) == set(idle.MODES) for rd in r["rounds"])
    summary = r["summary"]
    for row in summary.values():
        assert row["torch_ops_slowdown"] > 0 and row["python_slowdown"] > 0
    # 200 us naps wake the engine ~20x as often as naps that climb to 10 ms
    for mode in ("fixed", "open"):
        assert summary[mode]["engine_cpu_share"] > 3 * summary["backoff"]["engine_cpu_share"], summary
    assert "backoff" in capsys.readouterr().out


def test_bad_settle_is_refused_by_name(refused) -> None:
    refused(idle.main, ["--settle-s", "0"], "--settle-s")
