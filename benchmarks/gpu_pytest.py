"""pytest plugin for the GPU runs (benchmarks/gpu_check.sh loads it with ``-p gpu_pytest``).

The lent machine's CuPy may warn (its CUDA path, a driver note) from ``cupy`` or any of its submodules
(``cupy._environment``, ``cupy_backends.cuda...``); pyproject's ``filterwarnings = error`` would fail a
one-shot run for that. Those warnings are shown instead, matched by a regex over the module, which a
``-W`` option cannot do (its module field is an exact name). DeprecationWarnings are shown too.
Every other warning stays an error, and real failures still fail.
"""

from __future__ import annotations

from typing import Any

FILTERS = (
    r"default::Warning:cupy(_backends)?(\..*)?",
    "default::DeprecationWarning",
)


def pytest_configure(config: Any) -> None:
    for line in FILTERS:  # appended after pyproject's "error": the later filter wins
        config.addinivalue_line("filterwarnings", line)
