"""``kvown bench idle`` measures what it says: beside a rank with fixed 200 us naps the engine burns more
CPU than beside a quiet rank that backs off, and every mode of every round is in the JSON."""

from __future__ import annotations

import json

import pytest

from kvown.apps.benchmarks import idle


@pytest.mark.timeout(120)
def test_quick_run_reports_both_modes_against_alone(tmp_path, capsys) -> None:
    out = tmp_path / "idle.json"
    assert idle.main(["--quick", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert len(r["rounds"]) == 3 and all(set(rd) == set(idle.MODES) for rd in r["rounds"])
    fixed, backoff = r["summary"]["fixed"], r["summary"]["backoff"]
    for row in (fixed, backoff):
        assert row["torch_ops_slowdown"] > 0 and row["python_slowdown"] > 0
    # 200 us naps wake the engine ~20x as often as naps that climb to 10 ms
    assert fixed["engine_cpu_share"] > 3 * backoff["engine_cpu_share"], (fixed, backoff)
    assert "backoff" in capsys.readouterr().out


def test_bad_settle_is_refused_by_name(refused) -> None:
    refused(idle.main, ["--settle-s", "0"], "--settle-s")
