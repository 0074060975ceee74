"""Test hosts on one machine: N network namespaces that one ``mpirun`` treats as N separate hosts.

Owns: for one run, the namespaces, veth pairs, bridge, addresses, hostfile, launch agent, the
environment that keeps MPI and UCX on the test network, link faults (down, rate, netem) and the
teardown of all of it. How it looks: docs/design.md section 13.

Rules:
  1. Every name carries the kvown prefix and the run id (6 hex digits): ``kvown-<run>-<i>``, links
     ``kvwn<run>...``; each run takes its own /24 in 198.18.0.0/15 (RFC 2544), allocated under a lock.
  2. Addresses exist only on this run's namespaces and its bridge; no route leaves the machine.
  3. UCX between ranks uses ``tcp`` on ``eth0`` (and ``self``), never shared memory or ``cma`` (they
     cross "hosts" through the kernel); ``kvown.testing.ucxproto`` proves what UCX chose.
  4. Teardown always happens: ``close()`` (also from ``__exit__``, so exceptions, timeouts that raise
     and Ctrl-C are covered), a reaper process that tears the run down when its owner dies by any
     means (SIGKILL included), and a sweep of stale runs (owner dead) before every setup.
  5. Processes are ended only inside this run's namespaces, by id (``ip netns pids``).

Invariants:
  H1  A run whose owner process is alive is never swept by another run.
  H2  The state file of a run is written before its first namespace exists and removed after its
      last one is gone, so a sweep always knows what a stale run left.
  H3  After ``close()`` returns, none of the run's namespaces, links, addresses or processes remain
      (links that the kernel removes asynchronously are waited for, bounded).
"""

from __future__ import annotations

import dataclasses
import fcntl
import ipaddress
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvown.adapters.mpi import process_start_ticks
from kvown.adapters.mpirun import mpirun_command as _base_mpirun_command

PREFIX_NS = "kvown-"  # namespace (and host) names: kvown-<run>-<i>
PREFIX_LINK = "kvwn"  # interface names (15 characters at most): kvwn<run>b, kvwn<run><i>
RANGE = ipaddress.ip_network("198.18.0.0/15")
STATE_DIR = Path("/run/kvown-hosts")  # one place for every run on the machine: the sweep reads it (H1)
_NS_RE = re.compile(r"^kvown-([0-9a-f]{6})-\d+$")
_LINK_RE = re.compile(r"^kvwn([0-9a-f]{6})")
_CMD_TIMEOUT_S = 20.0


class HostsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no ``ip``, no netns support); ``reason`` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Host:
    """One test host: its name (= namespace = hostname), address, and the root-side veth end."""

    index: int
    name: str
    address: str
    veth: str  # the root-namespace end, joined to the bridge; the namespace end is "eth0"


def _run(
    cmd: Sequence[str], *, check: bool = True, timeout_s: float = _CMD_TIMEOUT_S
) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout_s)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def unavailable_reason() -> str | None:
    """Why test hosts cannot be built on this machine, or None if they can (tools present, root).

    Called: by fixtures and ``kvown qualify --test-hosts`` before building anything.
    """
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN); run as root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (iproute2 / util-linux)"
    return None


# ---- run state, locking and the stale-run sweep ----------------------------------------------------


def _lock() -> int:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(STATE_DIR / "lock", os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _unlock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _owner_alive(state: dict) -> bool:
    ticks = process_start_ticks(int(state.get("owner_pid", -1)))
    return ticks is not None and ticks == state.get("owner_start_ticks")


def _netns_names() -> list[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _link_names() -> list[str]:
    proc = _run(["ip", "-o", "link", "show"], check=False)
    names = []
    for line in proc.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def _ns_pids(ns: str) -> list[int]:
    proc = _run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def _teardown(run_id: str, namespaces: Iterable[str], links: Iterable[str], run_dir: str | None) -> None:
    """Remove everything of run ``run_id``: processes in its namespaces, namespaces, links, files.

    Idempotent; never raises for things already gone (rule 4).
    """
    namespaces = list(namespaces)
    for _ in range(3):  # a dying daemon may fork once more; a few bounded rounds
        pids = [pid for ns in namespaces for pid in _ns_pids(ns) if pid != os.getpid()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    for ns in namespaces:
        _run(["ip", "netns", "del", ns], check=False)
    for link in links:
        _run(["ip", "link", "del", link], check=False)
    end = time.monotonic() + 10.0  # the kernel removes a namespace's veth ends asynchronously (H3)
    while time.monotonic() < end:
        left = [
            name for name in _link_names() if _LINK_RE.match(name) and _LINK_RE.match(name).group(1) == run_id
        ]
        if not left:
            break
        for link in left:
            _run(["ip", "link", "del", link], check=False)
        time.sleep(0.05)
    if run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
    try:
        (STATE_DIR / f"{run_id}.json").unlink()
    except FileNotFoundError:
        pass


def run_states() -> dict[str, dict]:
    """Every run recorded on this machine: run id -> its state (``{}`` if the record cannot be read).

    Called: by ``sweep_stale`` under the lock, and by tests that need one owner's runs, without it.
    """
    states: dict[str, dict] = {}
    for path in STATE_DIR.glob("*.json") if STATE_DIR.is_dir() else ():
        try:
            states[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):
            states[path.stem] = {}
    return states


def sweep_stale() -> list[str]:
    """Tear down runs whose owner is dead, and kvown resources that no live run claims. Returns run ids.

    Called: under the lock, before every setup; also ``python -m kvown.testing.hosts --sweep``.
    A run whose owner is alive is left alone (H1), even while it is still being built (H2).
    """
    live: set[str] = set()
    stale: dict[str, dict] = {}
    for run_id, state in run_states().items():
        if _owner_alive(state):
            live.add(run_id)
        else:
            stale[run_id] = state
    namespaces = [ns for ns in _netns_names() if _NS_RE.match(ns)]
    links = [link for link in _link_names() if _LINK_RE.match(link)]
    for ns in namespaces:
        run_id = _NS_RE.match(ns).group(1)  # type: ignore[union-attr]
        if run_id not in live:
            stale.setdefault(run_id, {})
    for link in links:
        run_id = _LINK_RE.match(link).group(1)  # type: ignore[union-attr]
        if run_id not in live:
            stale.setdefault(run_id, {})
    for run_id, state in stale.items():
        mine_ns = sorted(
            set(state.get("namespaces", [])) | {ns for ns in namespaces if ns.startswith(f"kvown-{run_id}-")}
        )
        mine_links = sorted(
            set(state.get("links", [])) | {link for link in links if link.startswith(f"kvwn{run_id}")}
        )
        _teardown(run_id, mine_ns, mine_links, state.get("run_dir"))
    return sorted(stale)


def _used_subnets() -> set[ipaddress.IPv4Network]:
    proc = _run(["ip", "-o", "-4", "addr", "show"], check=False)
    used = set()
    for line in proc.stdout.split("\n"):
        m = re.search(r"inet (\d+\.\d+\.\d+\.\d+)/(\d+)", line)
        if m:
            used.add(ipaddress.ip_network(f"{m.group(1)}/24", strict=False))
    return used


# ---- the harness -----------------------------------------------------------------------------------


class TestHosts:
    """N namespace hosts joined by a bridge, with what ``mpirun`` needs to place ranks on them.

    ``with TestHosts(3) as hosts: subprocess.run(hosts.mpirun_command(3) + [python, prog], env=hosts.env())``

    Called: from the main thread of a test or of ``kvown qualify --test-hosts``; one instance per run.
    Ownership: the instance owns every namespace, link, address and file it made, and every process
    that runs inside its namespaces; ``close()`` ends them all.
    After error: a failed setup tears down what it built before raising.
    """

    __test__ = False  # not a pytest test class, despite the name

    def __init__(
        self,
        n: int,
        *,
        slots: int = 8,
        work_dir: str | os.PathLike[str] | None = None,
        reaper: bool = True,
        ucx_tls: str | None = "tcp,self",
    ) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"n must be in 1..200 (got {n})")
        self.n = n
        self.slots = slots
        self.run_id = f"{random.SystemRandom().getrandbits(24):06x}"
        self.bridge = f"{PREFIX_LINK}{self.run_id}b"
        self.hosts: list[Host] = []
        self.subnet: ipaddress.IPv4Network | None = None
        self.bridge_address = ""
        self._work_parent = work_dir
        self.run_dir: Path | None = None
        self.hostfile: Path | None = None
        self.agent: Path | None = None
        self._reaper_enabled = reaper
        self.ucx_tls = ucx_tls  # None: let UCX choose (it may pick shared memory between "hosts")
        self._reaper: subprocess.Popen | None = None
        self._closed = False
        self._opened = False

    # -- life cycle --

    def __enter__(self) -> TestHosts:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> TestHosts:
        """Build the hosts. Raises ``HostsUnavailable`` where namespaces cannot be made (nothing left)."""
        reason = unavailable_reason()
        if reason:
            raise HostsUnavailable(reason)
        fd = _lock()
        try:
            sweep_stale()
            taken = {m.group(1) for m in map(_NS_RE.match, _netns_names()) if m}
            taken |= {p.stem for p in STATE_DIR.glob("*.json")}
            while self.run_id in taken:  # 24 random bits; still, never share a name (rule 1)
                self.run_id = f"{random.SystemRandom().getrandbits(24):06x}"
                self.bridge = f"{PREFIX_LINK}{self.run_id}b"
            self.subnet = self._choose_subnet()
            hosts_base = list(self.subnet.hosts())
            self.bridge_address = str(hosts_base[0])
            self.hosts = [
                Host(
                    i,
                    f"{PREFIX_NS}{self.run_id}-{i}",
                    str(hosts_base[9 + i]),
                    f"{PREFIX_LINK}{self.run_id}{i}",
                )
                for i in range(self.n)
            ]
            self.run_dir = Path(tempfile.mkdtemp(prefix=f"kvown-hosts-{self.run_id}-", dir=self._work_parent))
            self._write_state()  # H2: before the first namespace exists
            self._opened = True
            try:
                self._build()
            except Exception as exc:
                self.close()
                if isinstance(exc, RuntimeError) and "netns" in str(exc):
                    raise HostsUnavailable(f"cannot create network namespaces here: {exc}") from exc
                raise
        finally:
            _unlock(fd)
        self._write_files()
        if self._reaper_enabled:
            self._start_reaper()
        return self

    def close(self) -> None:
        """Tear everything down (idempotent). Called: by ``__exit__``, or by the owner, any time."""
        if self._closed or not self._opened:
            self._closed = True
            return
        self._closed = True
        _teardown(
            self.run_id,
            [h.name for h in self.hosts],
            [self.bridge, *(h.veth for h in self.hosts)],
            str(self.run_dir) if self.run_dir else None,
        )
        if self._reaper is not None:
            try:
                self._reaper.stdin.write(b"done\n")  # type: ignore[union-attr]
                self._reaper.stdin.close()  # type: ignore[union-attr]
            except (BrokenPipeError, OSError):
                pass
            try:
                self._reaper.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
                self._reaper.wait(timeout=5)

    def _choose_subnet(self) -> ipaddress.IPv4Network:
        used = _used_subnets()
        candidates = [net for net in RANGE.subnets(new_prefix=24) if net not in used]
        if not candidates:
            raise RuntimeError("every /24 of 198.18.0.0/15 is in use on this machine")
        return random.SystemRandom().choice(candidates)

    def _write_state(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {
            "run_id": self.run_id,
            "owner_pid": os.getpid(),
            "owner_start_ticks": process_start_ticks(os.getpid()),
            "namespaces": [h.name for h in self.hosts],
            "links": [self.bridge, *(h.veth for h in self.hosts)],
            "run_dir": str(self.run_dir),
            "subnet": str(self.subnet),
        }
        tmp = STATE_DIR / f".{self.run_id}.tmp"
        tmp.write_text(json.dumps(state))
        tmp.rename(STATE_DIR / f"{self.run_id}.json")

    def _build(self) -> None:
        assert self.subnet is not None
        prefix = self.subnet.prefixlen
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.bridge_address}/{prefix}", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for h in self.hosts:
            peer = f"{PREFIX_LINK}{self.run_id}p{h.index}"
            _run(["ip", "netns", "add", h.name])
            _run(["ip", "link", "add", h.veth, "type", "veth", "peer", "name", peer])
            _run(["ip", "link", "set", peer, "netns", h.name])
            _run(["ip", "link", "set", h.veth, "master", self.bridge])
            _run(["ip", "link", "set", h.veth, "up"])
            _run(["ip", "-n", h.name, "link", "set", peer, "name", "eth0"])
            _run(["ip", "-n", h.name, "addr", "add", f"{h.address}/{prefix}", "dev", "eth0"])
            _run(["ip", "-n", h.name, "link", "set", "eth0", "up"])
            _run(["ip", "-n", h.name, "link", "set", "lo", "up"])

    def _write_files(self) -> None:
        assert self.run_dir is not None
        self.hostfile = self.run_dir / "hostfile"
        self.hostfile.write_text("".join(f"{h.name} slots={self.slots}\n" for h in self.hosts))
        self.agent = self.run_dir / "launch-agent"
        # PRRTE calls AGENT HOST CMD... as it would call ssh: the command is one shell line on the far
        # side. The agent enters HOST's network namespace and a fresh UTS namespace named HOST. Like an
        # ssh client, the agent itself stays on the launcher's side (not exec'd into the namespace), so
        # a host that dies takes only its own processes and the launcher sees the agent fail.
        known = " ".join(h.name for h in self.hosts)
        self.agent.write_text(
            "#!/bin/sh\n"
            "# kvown test-host launch agent (PRRTE plm_ssh_agent): AGENT HOST CMD...\n"
            f"# run {self.run_id}; hosts: {known}\n"
            'host="$1"; shift\n'
            f'case " {known} " in *" $host "*) ;;\n'
            '  *) echo "kvown launch agent: unknown host $host" >&2; exit 255;;\nesac\n'
            'ip netns exec "$host" unshare --uts sh -c "hostname $host; $*"\n'
            "status=$?; exit $status\n"
        )
        self.agent.chmod(0o755)

    def _start_reaper(self) -> None:
        """A small process that tears this run down when the owner dies without ``close()`` (rule 4)."""
        code = (
            "import sys, json; from kvown.testing import hosts as h\n"
            "line = sys.stdin.readline()\n"
            "if line.strip() != 'done':\n"
            f"    st = json.loads(open({str(STATE_DIR / (self.run_id + '.json'))!r}).read()) if "
            f"h.Path({str(STATE_DIR / (self.run_id + '.json'))!r}).exists() else None\n"
            "    if st: h._teardown(st['run_id'], st['namespaces'], st['links'], st['run_dir'])\n"
        )
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH", "")]))
        self._reaper = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # survives the owner's Ctrl-C
        )

    # -- launching --

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment for ``mpirun`` (and, through it, every daemon and rank).

        Restricts PRRTE's out-of-band and Open MPI's TCP traffic to the test subnet and UCX to TCP on
        the namespaces' ``eth0`` (rule 3); points PRRTE at the launch agent.
        """
        env = dict(os.environ if base is None else base)
        if self.ucx_tls is None:  # the caller asked for UCX's own choice: drop restrictions inherited here
            env.pop("UCX_TLS", None)
            env.pop("UCX_NET_DEVICES", None)
        env.update(self.network_env())
        env["PRTE_MCA_plm_ssh_agent"] = str(self.agent)
        return env

    def network_env(self) -> dict[str, str]:
        """Only the variables that keep traffic on the test network (also forwarded with ``-x``)."""
        subnet = str(self.subnet)
        env = {
            "PRTE_MCA_oob_tcp_if_include": subnet,
            "OMPI_MCA_btl_tcp_if_include": subnet,
            "OMPI_MCA_oob_tcp_if_include": subnet,
        }
        if self.ucx_tls is not None:
            env.update(UCX_TLS=self.ucx_tls, UCX_NET_DEVICES="eth0")
        return env

    def mpirun_command(
        self, ranks: int, *, map_by: str = "node", hosts: Sequence[int] | None = None
    ) -> list[str]:
        """``mpirun`` argv that places ``ranks`` ranks on the test hosts, one PRRTE daemon per host.

        ``map_by="node"`` deals ranks round-robin (rank r on host r % n); ``"slot"`` fills host 0's
        slots first. ``hosts`` restricts the job to those host indices. Add the program's argv after it,
        and run it with ``env=self.env()``.
        """
        chosen = [self.hosts[i] for i in (hosts if hosts is not None else range(self.n))]
        cmd = _base_mpirun_command(ranks)
        cmd += [
            "--host",
            ",".join(f"{h.name}:{self.slots}" for h in chosen),
            "--map-by",
            map_by,
            "--bind-to",
            "none",
            "--prtemca",
            "plm_ssh_agent",
            str(self.agent),
        ]
        for name in self.network_env():
            cmd += ["-x", name]
        return cmd

    def placement(self, ranks: int, *, map_by: str = "node") -> list[str]:
        """The host name each rank lands on under ``mpirun_command(ranks, map_by=...)``."""
        if map_by == "node":
            return [self.hosts[r % self.n].name for r in range(ranks)]
        return [self.hosts[min(r // self.slots, self.n - 1)].name for r in range(ranks)]

    def host(self, key: int | str) -> Host:
        if isinstance(key, int):
            return self.hosts[key]
        return next(h for h in self.hosts if h.name == key)

    # -- faults --

    def exec(self, key: int | str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside a host's network namespace (e.g. ``tc``, ``ip``)."""
        return _run(["ip", "netns", "exec", self.host(key).name, *cmd], check=check)

    def link_down(self, key: int | str) -> None:
        """The host's only link goes down (``ip link set eth0 down`` inside its namespace)."""
        _run(["ip", "-n", self.host(key).name, "link", "set", "eth0", "down"])

    def link_up(self, key: int | str) -> None:
        _run(["ip", "-n", self.host(key).name, "link", "set", "eth0", "up"])

    def netem(
        self, key: int | str, *, delay_ms: float = 0.0, jitter_ms: float = 0.0, loss_pct: float = 0.0
    ) -> None:
        """Delay and loss on the host's egress (``tc netem``); ``HostsUnavailable`` if the kernel lacks it."""
        args = ["tc", "qdisc", "replace", "dev", "eth0", "root", "netem"]
        if delay_ms:
            args += ["delay", f"{delay_ms}ms"] + ([f"{jitter_ms}ms"] if jitter_ms else [])
        if loss_pct:
            args += ["loss", f"{loss_pct}%"]
        proc = self.exec(key, *args, check=False)
        if proc.returncode != 0:
            raise HostsUnavailable(f"tc netem is not available in this kernel: {proc.stderr.strip()}")

    def throttle(self, key: int | str, *, rate_kbit: int, queue_bytes: int, burst_bytes: int = 16384) -> None:
        """A slow link with a short queue (``tc tbf``): packets beyond the queue are dropped (real loss).

        Works where ``netem`` is missing (``tbf`` is in most kernels). Drops show in ``qdisc_stats``.
        """
        self.exec(
            key,
            "tc",
            "qdisc",
            "replace",
            "dev",
            "eth0",
            "root",
            "tbf",
            "rate",
            f"{rate_kbit}kbit",
            "burst",
            str(burst_bytes),
            "limit",
            str(queue_bytes),
        )

    def clear_qdisc(self, key: int | str) -> None:
        self.exec(key, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)

    def qdisc_stats(self, key: int | str) -> dict[str, int]:
        """Sent bytes/packets and drops of the host's root qdisc (``tc -s``)."""
        out = self.exec(key, "tc", "-s", "qdisc", "show", "dev", "eth0").stdout
        m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)", out)
        if not m:
            return {}
        return {
            "sent_bytes": int(m[1]),
            "sent_packets": int(m[2]),
            "dropped": int(m[3]),
            "overlimits": int(m[4]),
        }

    def tcp_retransmits(self, key: int | str) -> int:
        """TCP segments retransmitted inside the host's namespace (``/proc/net/snmp``)."""
        out = self.exec(key, "cat", "/proc/net/snmp").stdout.splitlines()
        tcp = [line.split() for line in out if line.startswith("Tcp:")]
        return int(tcp[1][tcp[0].index("RetransSegs")])

    def pids(self, key: int | str) -> list[int]:
        """Every process inside the host's network namespace (its PRRTE daemon and ranks)."""
        return _ns_pids(self.host(key).name)

    def kill_host(self, key: int | str) -> list[int]:
        """The host dies: SIGKILL every process inside it (daemon and ranks), by id. Returns the PIDs."""
        pids = self.pids(key)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids


def main(argv: list[str] | None = None) -> int:
    """``python -m kvown.testing.hosts --sweep`` removes stale test hosts; ``--list`` shows ours."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvown.testing.hosts", description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="tear down test hosts whose owner is gone")
    ap.add_argument("--list", action="store_true", help="list kvown namespaces and links present now")
    args = ap.parse_args(argv)
    if args.sweep:
        fd = _lock()
        try:
            print("swept:", " ".join(sweep_stale()) or "nothing")
        finally:
            _unlock(fd)
    if args.list or not args.sweep:
        print("namespaces:", " ".join(n for n in _netns_names() if _NS_RE.match(n)) or "none")
        print("links:", " ".join(n for n in _link_names() if _LINK_RE.match(n)) or "none")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
