"""The public API: every name in kvown.__all__ resolves, and importing kvown loads nothing heavy."""

import subprocess
import sys

import kvown


def test_every_exported_name_resolves():
    for name in kvown.__all__:
        assert getattr(kvown, name) is not None


def test_import_kvown_is_light():
    code = "import sys, kvown; print(sorted(m for m in ('torch', 'nixl', 'mpi4py') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
