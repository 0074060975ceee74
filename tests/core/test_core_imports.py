"""kvown/core imports only the standard library and itself (walks the AST of every module)."""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

import kvown.core

CORE = pathlib.Path(kvown.core.__file__).parent


def _imports(path: pathlib.Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            out.append("kvown.core")  # a relative import stays inside the core
    return out


@pytest.mark.timeout(10)
def test_core_imports_only_stdlib_and_itself() -> None:
    files = sorted(CORE.glob("*.py"))
    assert len(files) >= 11
    bad = []
    for path in files:
        for name in _imports(path):
            top = name.split(".")[0]
            if name.startswith("kvown.core") or top in sys.stdlib_module_names or top == "__future__":
                continue
            bad.append(f"{path.name}: {name}")
    assert not bad, f"kvown/core must import only the standard library: {bad}"


@pytest.mark.timeout(10)
def test_the_checker_would_see_a_third_party_import(tmp_path: pathlib.Path) -> None:
    p = tmp_path / "x.py"
    p.write_text("import msgpack\nfrom torch import nn\nfrom . import y\n")
    assert _imports(p) == ["msgpack", "torch", "kvown.core"]


@pytest.mark.timeout(10)
def test_the_clock_guard_is_active_here() -> None:
    import threading
    import time

    for call in (time.monotonic, time.monotonic_ns, time.perf_counter, lambda: time.sleep(0)):
        with pytest.raises(AssertionError, match="pass now_ns"):
            call()
    with pytest.raises(AssertionError):
        threading.Thread(target=lambda: None).start()


def test_the_clock_guard_is_armed_in_core_tests():
    import threading
    import time

    import pytest

    for call in (time.monotonic, time.monotonic_ns, time.perf_counter, lambda: time.sleep(0),
                 lambda: threading.Thread(target=lambda: None).start()):
        with pytest.raises(AssertionError, match="pass now_ns"):
            call()
