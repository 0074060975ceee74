"""kvown's PEP 517 build backend: setuptools, plus mypyc in the build environment when KVOWN_COMPILE=1.

Only the build requirements change: with KVOWN_COMPILE=1 a wheel build asks for the pinned mypy (which
ships mypyc), so ``KVOWN_COMPILE=1 pip install .`` compiles the hot path in pip's isolated build
environment. Editable builds never ask for it (they stay interpreted: setup.py rule 3).
"""

from __future__ import annotations

import os

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (the backend's other hooks, unchanged)

MYPYC_REQUIRES = ["mypy==2.4.1"]  # the version the hot path is checked and compiled with


def get_requires_for_build_wheel(config_settings: dict[str, object] | None = None) -> list[str]:
    extra = MYPYC_REQUIRES if os.environ.get("KVOWN_COMPILE", "0") == "1" else []
    return [*_setuptools.get_requires_for_build_wheel(config_settings), *extra]
