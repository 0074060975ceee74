"""A whole serving stack on this machine, as child processes: what ``kvown serve local`` and the tests run.

Owns: starting, watching and stopping the children (etcd, a prefill server, a decode server, the
router; or one ``single`` server), and their logs.

Rules:
  1. Every child is a real process speaking real HTTP and TCP on 127.0.0.1; the stack is ready only
     when each server printed ``READY`` and the router's etcd view lists the prefill and decode servers.
  2. Every wait is bounded; ``stop`` is idempotent: SIGTERM, then SIGKILL after a grace period, then
     etcd, so nothing outlives the stack (use it as a context manager).
  3. Children run the ``kvown`` of this checkout (its parent directory goes first on PYTHONPATH).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from kvown.apps.serve.etcd import EtcdProcess, die_with_parent
from kvown.core.errors import AdapterError

_REPO = str(Path(__file__).resolve().parents[3])


class ServerProcess:
    """One ``kvown serve ROLE`` child. ``url`` is known once ``wait_ready`` returned."""

    def __init__(self, role: str, args: Sequence[str], log_path: Path, extra_env: dict[str, str] | None = None,
                 *, argv: Sequence[str] | None = None) -> None:
        """``argv`` replaces ``python -m kvown serve ROLE ARGS`` (another kvown program that prints READY)."""
        self.role, self.log_path = role, log_path
        env = {**os.environ, **(extra_env or {})}
        env["PYTHONPATH"] = _REPO + os.pathsep + env.get("PYTHONPATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        self._log = open(log_path, "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            list(argv) if argv is not None else [sys.executable, "-m", "kvown", "serve", role, *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._pump, name=f"serve-{role}-stdout", daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            text = line.decode(errors="replace").strip()
            if text.startswith("READY ") and self.url is None:
                self.url = text.split(" ", 1)[1]
                self._ready.set()
        self._ready.set()  # EOF: the child is gone; wait_ready reports it

    def wait_ready(self, timeout_s: float) -> str:
        if not self._ready.wait(timeout_s) or self.url is None:
            tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
            raise AdapterError(
                f"serve {self.role} did not become ready", returncode=self.proc.poll(), log=tail
            )
        return self.url

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL now (tests: a server dies mid-stream)."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, grace_s: float = 8.0) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=grace_s)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


class LocalStack:
    """``single=False``: etcd + prefill + decode + router (``url`` is the router's).
    ``single=True``: one server doing both, no etcd (``url`` is that server's).

    ``server_args`` go to the prefill, decode and single servers (model options, blocks, threads).
    """

    def __init__(
        self,
        *,
        single: bool = False,
        port: int = 0,
        server_args: Sequence[str] = (),
        log_dir: str | Path | None = None,
        cluster: str = "local",
        lease_ttl_s: int = 2,
    ) -> None:
        self.single, self.port, self.server_args = single, port, list(server_args)
        self.cluster, self.lease_ttl_s = cluster, lease_ttl_s
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="kvown-serve-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.etcd: EtcdProcess | None = None
        self.procs: dict[str, ServerProcess] = {}
        self.url = ""
        self.job_key = os.environ.get("KVOWN_JOB_KEY") or secrets.token_bytes(32).hex()

    def _spawn(self, key: str, role: str, args: Sequence[str]) -> ServerProcess:
        # one job key per stack: every server's kvown frames are sealed with it (KVOWN_JOB_KEY)
        env = {"KVOWN_JOB_KEY": self.job_key, "KVOWN_FLIGHT_DIR": os.environ.get("KVOWN_FLIGHT_DIR") or str(self.log_dir)}
        proc = ServerProcess(role, args, self.log_dir / f"{key}.log", env)
        self.procs[key] = proc
        return proc

    def start(self, *, timeout_s: float = 90.0) -> LocalStack:
        deadline = time.monotonic() + timeout_s
        try:
            if self.single:
                p = self._spawn(
                    "single", "single", ["--port", str(self.port), "--name", "single-0", *self.server_args]
                )
                self.url = p.wait_ready(timeout_s)
                return self
            self.etcd = EtcdProcess(log_path=self.log_dir / "etcd.log").start()
            common = [
                "--etcd",
                self.etcd.endpoint,
                "--cluster",
                self.cluster,
                "--lease-ttl",
                str(self.lease_ttl_s),
            ]
            prefill = self._spawn("prefill", "prefill",
                                  [*common, "--name", "prefill-0", "--rank", "0", *self.server_args])
            decode = self._spawn("decode", "decode", [*common, "--name", "decode-0", "--rank", "1", *self.server_args])
            router = self._spawn(
                "router", "router", [*common, "--name", "router-0", "--port", str(self.port)]
            )
            for p in (prefill, decode, router):
                p.wait_ready(max(deadline - time.monotonic(), 1.0))
            self.url = router.url or ""
            self._wait_router_sees({"prefill-0", "decode-0"}, deadline)
            return self
        except BaseException:
            self.stop()
            raise

    def _wait_router_sees(self, names: set[str], deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                seen = set(httpx.get(f"{self.url}/health", timeout=2).json()["servers"])
                if names <= seen:
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.05)
        raise AdapterError("the router never saw every server in etcd", wanted=sorted(names))

    def dead(self) -> list[str]:
        return [k for k, p in self.procs.items() if not p.alive()]

    def stop(self) -> None:
        for key in ("router", "decode", "prefill", "single"):
            if key in self.procs:
                self.procs[key].stop()
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
