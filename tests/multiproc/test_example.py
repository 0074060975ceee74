"""The embedding example in examples/ runs as documented in docs/embedding.md."""

import sys

import pytest

from worldkit import ROOT, mpirun, run


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_disagg_server_example_runs():
    proc = run(mpirun(2) + [sys.executable, str(ROOT / "examples" / "disagg_server.py"), "20"], 100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "decode server: served 16, cancelled 4" in proc.stdout
    assert "held=0" in proc.stdout and "owned=0" in proc.stdout
