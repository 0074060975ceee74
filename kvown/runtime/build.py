"""Which build of the hot path runs: compiled (mypyc extension modules) or interpreted (the .py source).

Owns: ``HOT_PATH``, the modules ``KVOWN_COMPILE=1`` compiles (setup.py reads this tuple, so the list is
written once), and ``build_info()``, which reports what the running process actually imported and the
interpreter that runs it.

Rules:
  1. The compiled and the interpreted build are the same source. A module counts as compiled when the
     file its import loaded is an extension module (``.so``), never from a flag or an environment variable.
  2. Standard library only, and cheap: ``kvown doctor`` and the benchmarks call it once per run.
  3. The interpreter's linkage is read from what the process mapped (``/proc/self/maps``), not from
     ``sysconfig``: Debian's python3.11 is a static, PGO-built executable whose sysconfig says shared.
     The same source spends ~20 % more own CPU per session on a plain shared-libpython build
     (docs/benchmarks.md, issue 19 thirteenth pass), so the benchmarks record it beside their figures.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import platform
import re
import sys
from typing import Any

# The per-session hot path (issue 19 item 2). Grow it only with modules that type-check under mypy
# strict, compile with mypyc and pass the fast suite compiled (docs/design.md section 17). Not
# kvown.core.errors: kvown's other errors (kernels, cache, runtime) subclass them, and an interpreted
# class cannot subclass a native one.
HOT_PATH = (
    "kvown.adapters.codec",
    "kvown.adapters.nixl",
    "kvown.adapters.transport",
    "kvown.cache.pool",
    "kvown.core.actions",
    "kvown.core.deadline",
    "kvown.core.events",
    "kvown.core.fence",
    "kvown.core.ids",
    "kvown.core.machine",
    "kvown.core.messages",
    "kvown.core.record",
    "kvown.core.receiver",
    "kvown.core.routing",
    "kvown.core.sender",
    "kvown.core.streams",
    "kvown.runtime.driver",
    "kvown.runtime.flight",
    "kvown.runtime.handles",
    "kvown.runtime.resend",
)


def is_compiled(module_name: str) -> bool:
    """True when ``module_name`` was imported from an extension module (rule 1)."""
    path = getattr(importlib.import_module(module_name), "__file__", None) or ""
    return path.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def build_info() -> dict[str, Any]:
    """``{"build": "compiled" | "interpreted" | "mixed", "compiled": [...], "interpreted": [...]}``.

    Called: once per process by ``kvown doctor`` and the benchmark suite, any thread.
    "mixed" means some hot-path modules loaded compiled and some not: a broken install.
    """
    compiled = [name for name in HOT_PATH if is_compiled(name)]
    interpreted = [name for name in HOT_PATH if name not in compiled]
    build = "compiled" if not interpreted else "interpreted" if not compiled else "mixed"
    return {"build": build, "compiler": "mypyc" if compiled else None, "compiled": compiled,
            "interpreted": interpreted, "interpreter": interpreter_info()}


def interpreter_info() -> dict[str, str]:
    """``{"python": "3.11.7", "executable": ..., "libpython": "shared" | "static" | "unknown"}`` (rule 3)."""
    try:
        with open("/proc/self/maps") as f:
            maps: str | None = f.read()
    except OSError:  # not Linux
        maps = None
    return {"python": platform.python_version(), "executable": sys.executable,
            "libpython": libpython_linkage(maps)}


_LIBPYTHON = re.compile(r"/libpython3[^/\s]*\.so")


def libpython_linkage(maps: str | None) -> str:
    """``shared`` when a ``libpython3*.so`` is mapped, ``static`` when not, ``unknown`` without ``maps``."""
    if maps is None:
        return "unknown"
    return "shared" if _LIBPYTHON.search(maps) else "static"
