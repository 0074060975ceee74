"""``kvown bench builds`` reports a figure only for the build it was asked to measure (its rule 1).

A real child cost run (50 sessions, real NIXL) from the tree this test imported kvown from: asked for
that tree's own build it returns figures; asked for the other build it raises ``BuildMismatch``, the
check that keeps a checkout with stray ``.so`` files (or a compiled dir holding only source) from being
reported under the wrong name.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import kvown
from kvown.apps.benchmarks import builds


def _tree() -> tuple[Path, str]:
    return Path(kvown.__file__).resolve().parents[1], kvown.build_info()["build"]


@pytest.mark.timeout(120)
def test_a_child_of_the_asked_build_gives_its_figures() -> None:
    tree, build = _tree()
    figures = builds._child(build, tree, sessions=50, timeout_s=90)
    assert set(figures) == {name for name, _ in builds.FIGURES}
    assert all(v > 0 for v in figures.values())  # CPU and wall per session: never zero, never negative


@pytest.mark.timeout(120)
def test_a_child_that_ran_another_build_is_refused() -> None:
    tree, build = _tree()
    other = "interpreted" if build == "compiled" else "compiled"
    with pytest.raises(builds.BuildMismatch, match=f"asked for the {other} build"):
        builds._child(other, tree, sessions=50, timeout_s=90)


def test_a_directory_without_kvown_is_refused_before_any_run(tmp_path: Path, capsys) -> None:
    assert builds.main(["--compiled-dir", str(tmp_path), "--quick"]) == 2
    assert "make build-compiled" in capsys.readouterr().err
