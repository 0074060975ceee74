"""Apps, examples, test helpers and integrations use kvown's public API only (issue: no reach-through).

A module there that touches ``.driver``, ``.engine``, ``.transport`` of a runtime, a driver's lock, a
core's sessions, or a private name of a kvown module is reaching past the API: the API is missing a
call. Four modules are the wiring itself and may: the simulator (it builds the production driver over
fakes) and its oracles (moved out of it: they read the raw state a mutant cannot patch), the stepped
driver pair (``kvown.testing.pair``, the same for tests) and the per-session cost benchmark (it steps
two drivers from one thread to count their CPU).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ["kvown/apps", "kvown/integrations", "kvown/testing", "examples"]
WIRING = {"kvown/testing/sim.py", "kvown/testing/oracles.py", "kvown/testing/pair.py", "kvown/apps/benchmarks/cost.py"}
INTERNAL_ATTRS = {"driver", "engine", "_engine", "_driver", "transport"}
OWN = {"self", "cls"}  # an object's own attributes (a fault wrapper's transport, say) are its business


def reach_ins(source: str) -> list[str]:
    """Every reach past the public API in ``source``: ``x.driver``, ``x.engine.y``, ``driver.lock``,
    ``from kvown.mod import _private``."""
    found = []
    tree = ast.parse(source)
    for parent in ast.walk(tree):  # a core's session table, used as a mapping: x.sessions[...] / .get(...)
        inner = getattr(parent, "value", None)
        if isinstance(parent, (ast.Subscript, ast.Attribute)) and isinstance(inner, ast.Attribute) \
                and inner.attr == "sessions":
            found.append(f"line {inner.lineno}: a core's sessions")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value
            own = isinstance(owner, ast.Name) and owner.id in OWN
            if node.attr in INTERNAL_ATTRS and not own:
                found.append(f"line {node.lineno}: .{node.attr}")
            elif node.attr == "lock" and isinstance(owner, (ast.Name, ast.Attribute)) and "driver" in ast.unparse(owner):
                found.append(f"line {node.lineno}: driver lock")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvown"):
            found += [f"line {node.lineno}: imports {node.module}.{a.name}" for a in node.names
                      if a.name.startswith("_") and a.name != "__version__"]
    return found


def scanned_files() -> list[Path]:
    files = []
    for folder in SCANNED:
        files += sorted((ROOT / folder).rglob("*.py")) if (ROOT / folder).exists() else []
    return [f for f in files if f.relative_to(ROOT).as_posix() not in WIRING]


def test_the_scan_sees_every_kind_of_reach_in() -> None:
    """The checker itself: each pattern the issue names is caught, and the public calls are not."""
    bad = ("rt.driver.transport.peers\nrt.engine.statistics()\nwith self.rt.driver.lock: pass\n"
           "x = link.rt.engine\nfrom kvown.rank import _start\ncore.sessions.get(1)\n")
    assert {int(f.split(":")[0].split()[1]) for f in reach_ins(bad)} == {1, 2, 3, 4, 5, 6}
    good = ("rt.statistics().pool.free\nrt.wait_for_peers((1,), 5)\nrt.receiver.release(rid, ready=t)\n"
            "self.transport.send(1, b'')\nrt.pool.block_view(0)\nassert stats.receiver.sessions == 1\n")
    assert reach_ins(good) == []


@pytest.mark.parametrize("path", scanned_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_module_uses_only_the_public_api(path: Path) -> None:
    assert reach_ins(path.read_text()) == [], f"{path.relative_to(ROOT)} reaches past kvown's public API"
