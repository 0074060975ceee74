"""Imports only point down: core < cache < adapters < runtime < api < rank < testing < apps/integrations.

Walks the AST of every module under kvown/ (function-level imports included) and fails on an upward import,
on an import of ``kvown.testing`` from outside the modules allowed to use it, and on an import cycle between
files. Each rule has its mutant: a planted violation in a temporary module tree the checker must see.
"""

from __future__ import annotations

import ast
import pathlib

import pytest


ROOT = pathlib.Path(__file__).resolve().parents[1] / "kvown"  # the checkout's source, in either build's run
FLOORS = ("kvown.core", "kvown.cache", "kvown.adapters", "kvown.runtime", "kvown.api", "kvown.rank",
          "kvown.testing", "kvown.apps")
TOP = len(FLOORS) - 1  # apps, integrations and the CLI: users of the library
# Who may import the shipped fakes and checkers: the testing package itself, and the apps that run worlds
# with planted faults or over fakes (the demo, the soak, qualification and the benchmarks).
# The reference server's kvown link too, for its one hidden test knob (``--link-pace-ms``: slow WRITEs),
# imported only when that knob is set.
TESTING_USERS = ("kvown.testing", "kvown.apps.demo", "kvown.apps.soak", "kvown.apps.qualify",
                 "kvown.apps.benchmarks", "kvown.apps.serve.kvownlink")


def floor(module: str) -> int | None:
    """The floor of a kvown module (None: not kvown's). The package itself re-exports the rank's API."""
    if module == "kvown":
        return FLOORS.index("kvown.rank")
    for i, prefix in enumerate(FLOORS):
        if module == prefix or module.startswith(prefix + "."):
            return i
    if module.startswith("kvown."):
        return TOP  # kvown.integrations, kvown.cli, kvown.__main__
    return None


def modules(root: pathlib.Path, package: str = "kvown") -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join([package, *parts])] = path
    return out


def _type_only(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks (never executed: no cycle at import time)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def imports(module: str, path: pathlib.Path, *, type_only: bool = True) -> set[str]:
    """Every module ``module`` imports, at any depth of its code (``from a import b`` names ``a.b`` too);
    ``type_only=False`` leaves out the imports under ``if TYPE_CHECKING:``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    skip = set() if type_only else _type_only(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def edges(root: pathlib.Path, *, type_only: bool = True) -> dict[str, set[str]]:
    """File -> the kvown files it imports (names that are attributes, not modules, dropped)."""
    mods = modules(root)
    return {m: {i for i in imports(m, p, type_only=type_only) if i in mods and i != m} for m, p in mods.items()}


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {i}" for m, deps in graph.items() for i in deps
                  if floor(i) is not None and floor(m) is not None and floor(i) > floor(m))  # type: ignore[operator]


def importers_of_testing(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {i}" for m, deps in graph.items() for i in deps
                  if floor(i) == FLOORS.index("kvown.testing")
                  and not any(m == u or m.startswith(u) for u in TESTING_USERS))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the number of files (a few hundred)
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def cycle_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Edges between files, without the package ``__init__`` re-exports (a package imports its own parts)."""
    return {m: {i for i in deps if not m.startswith(i + ".")} for m, deps in graph.items()}


@pytest.mark.timeout(60)
def test_every_import_points_down() -> None:
    graph = edges(ROOT)
    assert len(graph) > 100 and "kvown.apps.serve.server" in graph
    assert not upward(graph), "upward imports (floor order core < cache < adapters < runtime < api < rank < " \
                              f"testing < apps): {upward(graph)}"


@pytest.mark.timeout(60)
def test_only_the_testing_users_import_kvown_testing() -> None:
    assert not importers_of_testing(edges(ROOT)), f"kvown.testing imported from outside {TESTING_USERS}"


@pytest.mark.timeout(60)
def test_no_import_cycle_between_files() -> None:
    assert not cycles(cycle_graph(edges(ROOT, type_only=False)))


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / "kvown"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.timeout(10)
def test_the_checker_sees_a_planted_upward_import(tmp_path: pathlib.Path) -> None:
    root = _tree(tmp_path, {
        "__init__.py": "", "core/__init__.py": "", "runtime/__init__.py": "", "apps/__init__.py": "",
        "testing/__init__.py": "", "testing/fakes.py": "", "apps/launch.py": "",
        "core/ok.py": "import os\n",
        "runtime/engine.py": "from kvown.core import ok\n\ndef f():\n    from ..apps import launch\n",  # planted
        "testing/hosts.py": "def g():\n    import kvown.apps.launch\n",  # planted: testing reaching into apps
        "apps/demo.py": "from kvown.testing import fakes\n",
        "apps/serve.py": "from kvown.testing.fakes import Fake\n",  # planted: not a testing user
    })
    graph = edges(root)
    assert upward(graph) == ["kvown.runtime.engine -> kvown.apps", "kvown.runtime.engine -> kvown.apps.launch",
                             "kvown.testing.hosts -> kvown.apps.launch"]
    assert importers_of_testing(graph) == ["kvown.apps.serve -> kvown.testing.fakes"]
    assert not cycles(cycle_graph(graph))


@pytest.mark.timeout(10)
def test_the_checker_sees_a_planted_cycle(tmp_path: pathlib.Path) -> None:
    root = _tree(tmp_path, {
        "__init__.py": "", "apps/__init__.py": "from kvown.apps import bench\n",
        "apps/bench.py": "from kvown.apps.suite import SUITES\n",
        "apps/suite.py": "def run():\n    from kvown.apps import bench\n",  # planted: a function-level way back
        "apps/legs.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvown.apps.table import T\n",
        "apps/table.py": "from kvown.apps import legs\n",  # a type-only way back is no cycle at import time
    })
    assert cycles(cycle_graph(edges(root, type_only=False))) == [["kvown.apps.bench", "kvown.apps.suite"]]
