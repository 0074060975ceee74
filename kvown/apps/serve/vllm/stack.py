"""A vLLM serving stack on this machine: etcd (when the connector needs it), a vLLM prefill and decode
instance with the chosen connector (or one plain instance), and the kvown proxy in front.

Owns: finding the vLLM venv's python, building the tiny model when no ``--model`` is given, the ports,
every process's command line and environment, readiness, logs (one file per process in ``run_dir``)
and stopping everything.

Rules:
  1. Every vLLM instance is its own process group (API server, EngineCore, Worker); ``stop`` (and the
     context manager, and a failed ``start``) SIGTERMs each group, SIGKILLs it after ``grace_s``, then
     stops etcd: nothing outlives the stack. Children also die with the thread that started them.
     vLLM's temporary files (its IPC sockets, the file store of its process-group start) go in a
     temp directory of the stack's own (``TMPDIR``) that ``stop`` removes; /tmp kept them all.
  2. Every wait is bounded (``start_timeout_s`` for the whole start, ``grace_s`` per stop).
  3. Distinct free ports per process (HTTP and NIXL side channel); ``VLLM_NIXL_SIDE_CHANNEL_HOST`` is
     127.0.0.1 (``localhost`` may resolve to ::1); the same model path string on every instance (it is
     in NIXL's compatibility hash).
  4. The stack is ready only when the proxy's ``/health`` is 200: a warm-up completion went through.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvown.apps.serve.etcd import EtcdProcess, die_with_parent
from kvown.apps.serve.local import ServerProcess
from kvown.apps.serve.vllm.connectors import Instance, StackInfo, connector
from kvown.apps.serve.vllm.proxy import ProxySpec
from kvown.apps.serve.protocol import check_port
from kvown.core.errors import AdapterError, ConfigError, require_positive_ints, require_positive_seconds

REPO = Path(__file__).resolve().parents[4]
VLLM_PYTHON_ENV = "KVOWN_VLLM_PYTHON"


def find_vllm_python(explicit: str | None = None) -> str:
    """The python that runs vLLM: ``explicit``, then $KVOWN_VLLM_PYTHON, then this checkout's
    .venv-vllm, then this interpreter when vLLM is importable here. Raises ConfigError."""
    for candidate in (explicit, os.environ.get(VLLM_PYTHON_ENV), str(REPO / ".venv-vllm" / "bin" / "python")):
        if candidate:
            if os.access(candidate, os.X_OK):
                return candidate
            if candidate is explicit:
                raise ConfigError(f"no python at {candidate}", field="vllm_python")
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise ConfigError("no python with vLLM found", field="vllm_python",
                      fix=f"make vllm-setup (builds .venv-vllm), or set {VLLM_PYTHON_ENV}")


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, read from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry))
    return out


_PORTS = random.Random()


def free_port(low: int = 20000, high: int = 32000) -> int:
    """A free loopback port below the kernel's ephemeral range (32768-60999 by default): a port taken
    from bind(0) is an ephemeral one that an outgoing connection may grab before vLLM binds it (a
    NIXL side channel failed that way). Raises AdapterError after 200 tries."""
    for _ in range(200):
        port = _PORTS.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AdapterError("no free port", low=low, high=high)


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, **extra, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


def build_model(vllm_python: str, out: Path, timeout_s: float = 300.0) -> Path:
    """The offline tiny model (model.py), built by the vLLM venv's python (it has tokenizers)."""
    subprocess.run([vllm_python, "-m", "kvown.apps.serve.vllm.model", str(out)], env=child_env({}),
                   check=True, timeout=timeout_s, stdout=subprocess.DEVNULL)
    return out


def check_importable(vllm_python: str, target: str, timeout_s: float = 180.0) -> None:
    """Raise ConfigError unless ``module:attribute`` imports in the vLLM venv (a connector's class)."""
    module, attr = target.split(":")
    code = f"import importlib; getattr(importlib.import_module({module!r}), {attr!r})"
    r = subprocess.run([vllm_python, "-c", code], env=child_env({}), capture_output=True, text=True,
                       timeout=timeout_s)
    if r.returncode != 0:
        raise ConfigError(f"{target} does not import in the vLLM venv: {r.stderr.strip()[-300:]}",
                          field="connector", fix="this build has no such connector; choose another")


@dataclass
class StackOptions:
    connector: str | None = "kvown"  # None: one plain instance (--single)
    model: str | None = None  # a local HF model directory; None: build the tiny model into run_dir
    model_name: str = "tiny"
    dtype: str = "float32"  # bf16 needs AMX tile permission on Intel (plugin.py); fp32 is what tests use
    port: int = 0  # the proxy's
    run_dir: str | None = None
    vllm_python: str | None = None
    kv_cache_memory_bytes: int = 128 << 20
    max_model_len: int = 2048
    block_size: int | None = None  # None: vLLM's CPU default (128)
    omp_bind: tuple[str, str] = ("nobind", "nobind")  # VLLM_CPU_OMP_THREADS_BIND for P and D
    cluster: str = "vllm"
    seed: int = 0
    start_timeout_s: float = 360.0
    grace_s: float = 10.0
    vllm_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # extra environment of every vLLM instance
    connector_extra: dict[str, object] = field(default_factory=dict)  # e.g. kvown's transfer_timeout_s

    def __post_init__(self) -> None:
        """``ConfigError`` naming the first bad field, before a run directory or a process exists."""
        check_port(self.port)
        require_positive_ints(self, ("kv_cache_memory_bytes", "max_model_len"))
        if self.block_size is not None:
            require_positive_ints(self, ("block_size",))
        require_positive_seconds(self, ("start_timeout_s", "grace_s"))


class VllmProcess:
    """One vLLM OpenAI server (its own process group, rule 1); ``log_path`` gets stdout and stderr."""

    def __init__(self, instance: Instance, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.instance, self.log_path, self.argv = instance, log_path, argv
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=die_with_parent)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """Signal the whole group (API server, EngineCore, Worker): the fault matrix's kill / stop."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if not self.alive():
                raise AdapterError(f"vLLM {self.instance.name} exited at start", returncode=self.proc.returncode,
                                   log=self.log_tail())
            try:
                if httpx.get(self.instance.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AdapterError(f"vLLM {self.instance.name} not healthy in time", log=self.log_tail())

    def aborted(self, header_id: str) -> bool:
        """Whether this instance logged the abort of the request whose X-Request-Id is ``header_id``
        (vLLM logs it with --enable-log-requests; its ids embed the header)."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return any(header_id in line for line in text.splitlines() if "Aborted request" in line)

    def log_tail(self, nbytes: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-nbytes:] if self.log_path.exists() else ""

    def stop(self, grace_s: float) -> None:
        for sig in (signal.SIGCONT, signal.SIGTERM):  # SIGCONT: a SIGSTOPped group must see the TERM
            self.signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        self.signal(signal.SIGKILL)  # the engine and worker too, even when the API server is gone
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:  # until the last of the group is gone (rule 1)
            try:
                self.proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                continue
            if not group_members(self.proc.pid):
                return
            time.sleep(0.05)


class VllmStack:
    def __init__(self, options: StackOptions) -> None:
        self.options = options
        self.spec = connector(options.connector) if options.connector else None
        self.run_dir = Path(options.run_dir or tempfile.mkdtemp(prefix="kvown-vllm-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tmp_dir = Path(tempfile.mkdtemp(prefix="kvown-vllm-tmp-"))  # short: a socket path fits 107 bytes
        self.vllm_python = find_vllm_python(options.vllm_python)
        self.etcd: EtcdProcess | None = None
        self.instances: dict[str, VllmProcess] = {}
        self.proxy: ServerProcess | None = None
        self.model = ""
        self.url = ""
        # one HMAC key per stack, for a connector that authenticates its control frames (kvown)
        self.job_env = {"KVOWN_JOB_KEY": secrets.token_hex(32), "KVOWN_FLIGHT_DIR": str(self.run_dir)} \
            if self.spec is not None and self.spec.job_key else {}

    def _instance(self, name: str, role: str) -> Instance:
        return Instance(name, role, free_port(), free_port())

    def vllm_argv(self, inst: Instance, kv_config: dict[str, object] | None) -> list[str]:
        o = self.options
        argv = [self.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--served-model-name", o.model_name, "--host", "127.0.0.1", "--port", str(inst.http_port),
                "--enforce-eager", "--dtype", o.dtype, "--max-model-len", str(o.max_model_len),
                "--kv-cache-memory-bytes", str(o.kv_cache_memory_bytes), "--seed", str(o.seed),
                "--enable-log-requests"]  # "Aborted request(s) ID." in the log: how tests see an abort
        if o.block_size is not None:
            argv += ["--block-size", str(o.block_size)]
        if kv_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_config)]
        return [*argv, *o.vllm_args]

    def vllm_env(self, inst: Instance, bind: str) -> dict[str, str]:
        extra = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_CI_ENV": "1",
                 "VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                 "VLLM_NIXL_SIDE_CHANNEL_PORT": str(inst.side_channel_port), "NIXL_LOG_LEVEL": "WARN",
                 "TMPDIR": str(self.tmp_dir),
                 **(self.spec.instance_env() if self.spec else {}), **self.job_env, **self.options.env}
        return child_env(extra)

    def _spawn(self, inst: Instance, kv_config: dict[str, object] | None, bind: str) -> VllmProcess:
        p = VllmProcess(inst, self.vllm_argv(inst, kv_config), self.vllm_env(inst, bind),
                        self.run_dir / f"{inst.name}.log")
        self.instances[inst.name] = p
        return p

    def start(self) -> VllmStack:
        o = self.options
        deadline = time.monotonic() + o.start_timeout_s
        try:
            if self.spec is not None and self.spec.requires:
                check_importable(self.vllm_python, self.spec.requires)
            self.model = o.model or str(build_model(self.vllm_python, self.run_dir / "model"))
            if self.spec is None:
                single = self._spawn(self._instance("single-0", "single"), None, o.omp_bind[1])
                single.wait_healthy(deadline)
                proxy = ProxySpec(o.model_name, single.instance, port=o.port)
            else:
                if self.spec.needs_etcd:
                    self.etcd = EtcdProcess(log_path=self.run_dir / "etcd.log").start()
                info = StackInfo(o.cluster, self.etcd.endpoint if self.etcd else None,
                                 self._instance("prefill-0", "prefill"), self._instance("decode-0", "decode"),
                                 o.connector_extra)
                procs = [self._spawn(inst, self.spec.kv_config(inst, info), bind)
                         for inst, bind in ((info.prefill, o.omp_bind[0]), (info.decode, o.omp_bind[1]))]
                for p in procs:
                    p.wait_healthy(deadline)
                proxy = ProxySpec(o.model_name, info.decode, info.prefill, self.spec.name, port=o.port)
            self._start_proxy(proxy, deadline)
            self._write_manifest()
            return self
        except BaseException:
            self.stop()
            raise

    def _start_proxy(self, spec: ProxySpec, deadline: float) -> None:
        argv = [sys.executable, "-m", "kvown.apps.serve.vllm.proxy", "--spec", spec.to_json()]
        self.proxy = ServerProcess("proxy", [], self.run_dir / "proxy.log", argv=argv)
        self.url = self.proxy.wait_ready(max(deadline - time.monotonic(), 1.0))
        last = ""
        while time.monotonic() < deadline:  # rule 4
            if not self.proxy.alive():
                break
            try:
                r = httpx.get(self.url + "/health", timeout=5)
                if r.status_code == 200:
                    return
                last = r.text
            except httpx.HTTPError as error:
                last = repr(error)
            time.sleep(0.5)
        raise AdapterError("the proxy never became ready", last=last[-1000:],
                           logs={k: p.log_tail(1500) for k, p in self.instances.items()})

    def _write_manifest(self) -> None:
        (self.run_dir / "stack.json").write_text(json.dumps({
            "connector": self.options.connector or "single", "url": self.url, "model": self.model,
            "instances": {k: {"url": p.instance.url, "pid": p.pid, "log": str(p.log_path),
                              "argv": p.argv} for k, p in self.instances.items()},
            "etcd": self.etcd.endpoint if self.etcd else None}, indent=2))

    def dead(self) -> list[str]:
        out = [k for k, p in self.instances.items() if not p.alive()]
        return out + (["proxy"] if self.proxy is not None and not self.proxy.alive() else [])

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        for p in self.instances.values():
            p.stop(self.options.grace_s)
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def __enter__(self) -> VllmStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
