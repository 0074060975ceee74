"""docs/state-machines.md is generated from the core's tables; it must never be stale."""

from __future__ import annotations

import pathlib

import pytest

from kvown.apps import docs_gen


# The checkout's file, also when the compiled build (installed elsewhere, without docs/) is imported.
CHECKOUT_DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "state-machines.md"


@pytest.mark.timeout(10)
def test_state_machine_docs_are_fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(docs_gen, "OUT", CHECKOUT_DOCS)
    assert docs_gen.main(["--check"]) == 0, "run: python -m kvown.apps.docs_gen"


@pytest.mark.timeout(10)
def test_check_detects_a_stale_file(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "state-machines.md"
    stale.write_text(docs_gen.render().replace("_on_cancel", "_on_cancelled"))
    monkeypatch.setattr(docs_gen, "OUT", stale)
    assert docs_gen.main(["--check"]) == 1
    assert docs_gen.main([]) == 0 and docs_gen.main(["--check"]) == 0
    text = stale.read_text()
    for name in ("_on_repeat_release", "in_doubt", "backend_done", "stateDiagram-v2"):
        assert name in text
