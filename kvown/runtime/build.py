"""Which build of the hot path runs: compiled (mypyc extension modules) or interpreted (the .py source).

Owns: ``HOT_PATH``, the modules ``KVOWN_COMPILE=1`` compiles (setup.py reads this tuple, so the list is
written once), and ``build_info()``, which reports what the running process actually imported.

Rules:
  1. The compiled and the interpreted build are the same source. A module counts as compiled when the
     file its import loaded is an extension module (``.so``), never from a flag or an environment variable.
  2. Standard library only, and cheap: ``kvown doctor`` and the benchmarks call it once per run.
"""

from __future__ import annotations

import importlib
import importlib.machinery
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
            "interpreted": interpreted}
