"""Two processes launched apart, no MPI between them, finding each other through a real etcd on loopback
(kvown.rank.connect_registry): transfers work, and a writer that dies with a WRITE unsettled is NOT
taken as quiescent when its lease expires - the reader holds its blocks and fail-stops at the deadline."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time

import pytest

from worldkit import ROOT, WORLDS
from kvown.apps.serve.etcd import INSTALL_HINT, EtcdProcess, find_etcd

PEER = WORLDS / "registry_peer.py"


@pytest.fixture(scope="module")
def etcd():
    if find_etcd() is None:
        pytest.skip(f"no etcd binary: {INSTALL_HINT}")
    with EtcdProcess() as proc:
        yield proc.endpoint


def start(role: str, endpoint: str, job: str, out, scenario: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NIXL_LOG_LEVEL": "WARN", "KVOWN_JOB_KEY": JOB_KEY,
           "KVOWN_FLIGHT_DIR": str(out.parent)}
    return subprocess.Popen([sys.executable, str(PEER), role, endpoint, job, str(out), scenario], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


JOB_KEY = secrets.token_bytes(32).hex()


def finish(proc: subprocess.Popen, timeout_s: float = 90) -> str:
    try:
        return proc.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("a peer hung:\n" + (proc.communicate()[0] or "")[-3000:])


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_processes_launched_apart_transfer_through_etcd(etcd, tmp_path):
    job = secrets.token_hex(3)
    reader = start("reader", etcd, job, tmp_path / "r1.json", "transfer")  # joins first: the writer comes later
    time.sleep(1.0)
    writer = start("writer", etcd, job, tmp_path / "r0.json", "transfer")
    outputs = [finish(writer), finish(reader)]
    for r, proc in ((0, writer), (1, reader)):
        assert proc.returncode == 0, outputs[r][-3000:]
        assert json.loads((tmp_path / f"r{r}.json").read_text())["ok"] == [True, True, True]


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_a_dead_writers_lease_proves_nothing_the_reader_fail_stops_at_its_deadline(etcd, tmp_path):
    job = secrets.token_hex(3)
    reader = start("reader", etcd, job, tmp_path / "r1.json", "writer-dies")
    writer = start("writer", etcd, job, tmp_path / "r0.json", "writer-dies")
    finish(writer)
    assert writer.returncode == -9  # it killed itself with its WRITE unsettled
    output = finish(reader)
    assert reader.returncode == -9, output[-3000:]  # the fail-stop route of a rank with no MPI world: SIGKILL
    flights = list(tmp_path.glob("kvown-flight-rank1-*.jsonl"))
    assert flights and "deadline" in flights[0].read_text()
    header = json.loads(flights[0].read_text().splitlines()[0])
    assert "writer 0" in header["detail"]  # the claim that was never proven
