"""Handshake refusals inside one MPI world, and two processes launched apart joined by rendezvous."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys

import pytest

from worldkit import ROOT, WORLDS, mpirun, run
from kvown.adapters.rendezvous import RendezvousServer


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("difference, field", [("geometry", "space"), ("version", "protocol_version")])
def test_handshake_refuses_a_different_peer(difference, field):
    proc = run(mpirun(2) + [sys.executable, str(WORLDS / "handshake.py"), difference], 90)
    refused = [line for line in proc.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 2, proc.stdout + proc.stderr[-2000:]  # both sides refuse
    assert all("step=connect" in line and f"field={field!r}" in line for line in refused), refused
    assert "ACCEPTED" not in proc.stdout
    assert proc.returncode != 0


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_separately_launched_processes_transfer_through_rendezvous(tmp_path):
    key = secrets.token_bytes(32)
    env = {"KVOWN_JOB_KEY": key.hex(), "PYTHONPATH": str(ROOT), "NIXL_LOG_LEVEL": "WARN"}
    with RendezvousServer("127.0.0.1", 0, key) as server:
        host, port = server.address
        procs = [
            subprocess.Popen([sys.executable, str(WORLDS / "rendezvous_peer.py"), str(r), host, str(port),
                              str(tmp_path / f"r{r}.json")], env={**__import__("os").environ, **env},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
            for r in (0, 1)
        ]
        outputs = []
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=90)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                pytest.fail("a rendezvous peer hung:\n" + (p.communicate()[0] or ""))
    for r, p in enumerate(procs):
        assert p.returncode == 0, outputs[r][-3000:]
        report = json.loads((tmp_path / f"r{r}.json").read_text())
        assert report["ok"] == [True, True, True], report


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_rendezvous_without_a_key_is_a_startup_error(tmp_path):
    proc = run([sys.executable, "-c", "from kvown.adapters.rendezvous import job_key_from_env; job_key_from_env()"],
               30, env={"KVOWN_JOB_KEY": ""})
    assert proc.returncode != 0 and "KVOWN_JOB_KEY" in proc.stderr
