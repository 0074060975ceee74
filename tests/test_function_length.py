"""Functions in kvown/ stay at most 70 lines (issue 18 item 7; it was a ratchet while some were longer,
and none is left)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "kvown"  # the checkout's source, in either build's run
LIMIT = 70


def long_functions(root: pathlib.Path, limit: int = LIMIT) -> dict[tuple[str, str], int]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                key = (path.relative_to(root).as_posix(), node.name)
                if lines > limit:
                    out[key] = max(lines, out.get(key, 0))
    return out


@pytest.mark.timeout(60)
def test_no_function_grows_past_the_limit() -> None:
    found = long_functions(ROOT)
    assert not found, f"functions over {LIMIT} lines: {found}"


@pytest.mark.timeout(10)
def test_the_check_sees_a_long_function(tmp_path: pathlib.Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path) == {("m.py", "long"): LIMIT + 1}
