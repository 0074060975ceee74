"""A private etcd on loopback: started by ``kvown serve local`` and by the tests, always stopped.

Owns: finding the ``etcd`` binary (Debian's ``etcd-server`` package puts it at /usr/bin/etcd),
starting one single-member etcd on 127.0.0.1 with a temporary data directory, and stopping it.

Rules:
  1. Loopback only: client and peer URLs are 127.0.0.1 on free ports.
  2. ``stop`` is idempotent, bounded (SIGTERM, then SIGKILL after ``grace_s``) and removes the data
     directory; use the class as a context manager so an exception cannot leak the process.
  3. ``start`` waits (bounded) until etcd answers; a port race is retried with new ports.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from kvown.adapters.registry import wait_for_etcd
from kvown.core.errors import AdapterError, ConfigError

INSTALL_HINT = "install Debian's etcd-server package (apt-get install -y etcd-server)"


def find_etcd() -> str | None:
    """Path of the etcd binary, or None. ``KVOWN_ETCD`` overrides the search."""
    override = os.environ.get("KVOWN_ETCD")
    if override:
        return override if os.access(override, os.X_OK) else None
    for candidate in (shutil.which("etcd"), "/usr/bin/etcd", "/usr/local/bin/etcd"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def die_with_parent() -> None:
    """``preexec_fn`` for children: SIGTERM them when the thread that started them dies (Linux), so a
    killed test runner or ``serve local`` never leaves etcd or a server behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdProcess:
    """One etcd member. ``endpoint`` is ``http://127.0.0.1:PORT`` once started."""

    def __init__(self, *, log_path: Path | None = None) -> None:
        binary = find_etcd()
        if binary is None:
            raise ConfigError("no etcd binary found", field="etcd", fix=INSTALL_HINT)
        self.binary = binary
        self.endpoint = ""
        self._log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None
        self._data_dir: str | None = None
        self._argv: list[str] = []

    def start(self, *, timeout_s: float = 20.0) -> EtcdProcess:
        last: Exception | None = None
        for _ in range(3):
            try:
                self._start_once(timeout_s)
                return self
            except AdapterError as error:  # most likely a port taken between probe and bind
                last = error
                self.stop()
        raise AdapterError("etcd did not start", cause=last, binary=self.binary)

    def _start_once(self, timeout_s: float) -> None:
        client_port, peer_port = _free_port(), _free_port()
        self._data_dir = tempfile.mkdtemp(prefix="kvown-etcd-")
        client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
        self._argv = [
            self.binary, "--name", "kvown", "--data-dir", os.path.join(self._data_dir, "data"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"kvown={peer}", "--log-level", "warn",
        ]
        self._launch()
        self.endpoint = client
        try:
            wait_for_etcd(client, timeout_s=timeout_s)
        except AdapterError:
            if self._proc is not None and self._proc.poll() is not None:
                raise AdapterError("etcd exited at start", returncode=self._proc.returncode) from None
            raise

    def _launch(self) -> None:
        assert self._data_dir is not None
        log = open(self._log_path or os.path.join(self._data_dir, "etcd.log"), "ab")  # noqa: SIM115
        with log:
            self._proc = subprocess.Popen(
                self._argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's Ctrl-C reaches the servers first; etcd stops last
                preexec_fn=die_with_parent,
            )

    def restart(self, *, down_s: float = 0.0, timeout_s: float = 20.0) -> None:
        """SIGKILL etcd and start it again on the same ports and data directory after ``down_s`` (a
        fault test's etcd restart; leases survive in the data, as after a real restart)."""
        if self._proc is None:
            raise AdapterError("etcd is not running", binary=self.binary)
        self._proc.kill()
        self._proc.wait(timeout=10)
        time.sleep(down_s)
        self._launch()
        wait_for_etcd(self.endpoint, timeout_s=timeout_s)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def stop(self, *, grace_s: float = 5.0) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=grace_s)
        self._proc = None
        if self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None

    def __enter__(self) -> EtcdProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
