"""``kvown qualify``: the qualification suite to run before deploying kvown on a set of hosts.

Owns: the launcher, the run of two real MPI worlds, the checks and figures taken from outside them,
and the report (terminal table, ``--json``, ``--junit-xml``). The worlds themselves are
``kvown.apps.qualify_world`` (every ownership scenario, 3 ranks) and ``kvown.apps.qualify_failstop`` (a
deadline missed on purpose, then every rank on every host must be gone).

Where the ranks run: ``--hosts a,b,c`` or ``--hostfile F`` (Open MPI ``mpirun``, one rank per host
where there are enough hosts), ``--launcher "srun --mpi=pmix -N3 -n3"`` (any launcher line that starts
the ranks, e.g. Slurm), or ``--test-hosts N`` (N network-namespace hosts on this machine, built and
removed by ``kvown.testing.hosts``; needs root). Nothing: 3 ranks on this host.

What it reports, besides every scenario's named checks:
  * start-up (NIXL agents, memory registration, metadata allgather and load) per rank, seconds;
  * the transports UCX chose per pair of ranks that carried traffic (from ``UCX_PROTO_INFO``), and a
    check that pairs on different hosts used a network transport and no shared memory;
  * bytes verified by pattern and by checksum;
  * fail-stop across hosts: deadline -> every rank gone (PIDs, where this machine can see them) and
    deadline -> launcher exit (always; across hosts this compares wall clocks).

Exit code 0 only if every check passed. Rules:
  1. Every world is bounded (``--timeout-s``); on timeout, error or Ctrl-C the launcher's process group
     is killed and test hosts are torn down. 2. A check not taken is recorded as failed, never skipped.
  3. Fail-stop dumps go to ``$KVOWN_FLIGHT_DIR``, else to a temp directory kept only if a check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from kvown.adapters.mpi import process_alive
from kvown.adapters.mpirun import kill_group, mpirun_command

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = ("standard", "mla", "nvfp4")
FAILSTOP_EXIT_CODE = 75  # kvown.runtime.failstop.ExitCode.DEADLINE (not imported: keeps this light)


@dataclasses.dataclass
class Launch:
    """How to start ranks: ``argv(ranks)`` is the launcher prefix, ``env`` its environment."""

    prefix: callable  # ranks -> list[str]
    env: dict[str, str]
    forward: list[str]  # env names the launcher must pass to remote ranks (mpirun -x)
    sees_pids: bool  # True when every rank's PID lives in this machine's PID namespace
    hosts_wanted: int  # how many distinct hosts the ranks should span (1 = this host)
    strict_device: str | None = None  # test hosts: every network lane must be tcp/<device>
    where: str = "this host"

    def argv(self, ranks: int, program: list[str], env: dict[str, str]) -> list[str]:
        cmd = list(self.prefix(ranks))
        if cmd and Path(cmd[0]).name in ("mpirun", "mpiexec", "prterun"):
            for name in self.forward:
                if name in env and name not in cmd:
                    cmd += ["-x", name]
        return cmd + program


@dataclasses.dataclass
class WorldRun:
    returncode: int | None
    stdout: str
    stderr: str
    started_ns: int
    exit_ns: int | None
    timed_out: bool
    ranks: dict[int, dict]  # from KVOWN-RANK lines
    tagged: dict[str, list[dict]]  # other KVOWN-* lines by tag
    all_gone_ns: int | None  # monotonic ns when every listed PID was seen gone (sees_pids only)


def run_world(
    launch: Launch,
    ranks: int,
    program: list[str],
    timeout_s: float,
    *,
    watch_pids: bool = False,
    extra_env: dict[str, str] | None = None,
) -> WorldRun:
    """Run one world to its end; read its ``KVOWN-*`` lines while it runs; with ``watch_pids``, poll the
    listed rank PIDs every 2 ms until all are gone. Bounded by ``timeout_s`` (rule 1).

    Called: by the launcher's main thread. After error: the process group is killed before returning.
    """
    env = dict(launch.env, **(extra_env or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    cmd = launch.argv(ranks, program, env)
    started = time.monotonic_ns()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        errors="replace",
    )
    lines = _WorldLines(proc)
    try:
        exit_ns, all_gone_ns, timed_out = _wait_world(proc, lines.found, ranks, timeout_s, watch_pids)
    finally:
        if proc.poll() is None:
            kill_group(proc, wait_s=3)
        lines.close()
    return WorldRun(
        proc.returncode,
        "".join(lines.out),
        "".join(lines.err),
        started,
        exit_ns,
        timed_out,
        lines.found,
        lines.tagged,
        all_gone_ns,
    )


class _WorldLines:
    """A world's stdout and stderr read on two threads; ``KVOWN-RANK`` lines by rank, other ``KVOWN-*``
    lines by tag."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.out: list[str] = []
        self.err: list[str] = []
        self.found: dict[int, dict] = {}
        self.tagged: dict[str, list[dict]] = {}
        self.readers = [threading.Thread(target=self._read_out, daemon=True),
                        threading.Thread(target=self._read_err, daemon=True)]
        for t in self.readers:
            t.start()

    def _read_out(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.out.append(line)
            if line.startswith("KVOWN-"):
                tag, _, body = line.partition(" ")
                try:
                    value = json.loads(body)
                except ValueError:
                    continue
                if tag == "KVOWN-RANK":
                    self.found[int(value["rank"])] = value
                else:
                    self.tagged.setdefault(tag, []).append(value)

    def _read_err(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.err.append(line)

    def close(self) -> None:
        for t in self.readers:
            t.join(timeout=5)
        for stream in (self.proc.stdout, self.proc.stderr):
            stream.close()  # type: ignore[union-attr]


def _wait_world(proc: subprocess.Popen, found: dict[int, dict], ranks: int, timeout_s: float,
                watch_pids: bool) -> tuple[int | None, int | None, bool]:
    """Poll every 2 ms until the world exited (and, with ``watch_pids``, every listed rank PID is gone),
    or ``timeout_s`` passed. Returns (exit_ns, all_gone_ns, timed_out)."""
    end = time.monotonic() + timeout_s
    exit_ns = all_gone_ns = None
    while True:
        now = time.monotonic_ns()
        if exit_ns is None and proc.poll() is not None:
            exit_ns = now
        every_rank_listed = len(found) == ranks or (exit_ns is not None and found)
        if watch_pids and all_gone_ns is None and every_rank_listed:
            if not any(process_alive(int(r["pid"]), r.get("start_ticks")) for r in list(found.values())):
                all_gone_ns = now
        if exit_ns is not None and (not watch_pids or all_gone_ns is not None or not found):
            return exit_ns, all_gone_ns, False
        if time.monotonic() > end:
            return exit_ns, all_gone_ns, True
        time.sleep(0.002)


# ---- the two worlds --------------------------------------------------------------------------------


def run_scenarios(launch: Launch, layout: str, device: str, timeout_s: float,
                  scale_layout: str = "inline") -> tuple[dict, dict]:
    """The scenario world: (checks, figures)."""
    from kvown.testing import ucxproto

    t0 = time.monotonic()
    run = run_world(
        launch,
        3,
        [sys.executable, "-m", "kvown.apps.qualify_world", "--layout", layout, "--device", device,
         "--scale-layout", scale_layout],
        timeout_s,
        extra_env={"UCX_PROTO_INFO": "y"},
    )
    elapsed = time.monotonic() - t0
    result = (run.tagged.get("KVOWN-RESULT") or [None])[-1]
    if run.timed_out or run.returncode != 0 or result is None:
        why = (
            "timed out"
            if run.timed_out
            else f"exit code {run.returncode}"
            if run.returncode
            else "no result line"
        )
        tail = (run.stdout[-2000:] + run.stderr[-4000:]).strip()
        return {"scenario_world": {f"finished ({why})": False}}, {
            "scenario_world_s": round(elapsed, 2),
            "scenario_world_tail": tail,
        }
    checks: dict[str, dict[str, bool]] = result["checks"]
    figures: dict = dict(result["figures"])
    figures["scenario_world_s"] = round(elapsed, 2)
    parsed = ucxproto.parse(run.stdout)
    pairs = ucxproto.pair_transports(
        parsed, figures["ranks"], figures["traffic_pairs"], require_device=launch.strict_device
    )
    figures["ucx_pairs"] = pairs
    figures["ucx_lanes_seen"] = ucxproto.all_lanes(parsed)
    hosts = sorted({r["host"] for r in figures["ranks"]})
    figures["hosts"] = hosts
    net: dict[str, bool] = {}
    if launch.hosts_wanted > 1:
        net["ranks_span_the_hosts"] = len(hosts) >= min(3, launch.hosts_wanted)
        cross = {k: v for k, v in pairs.items() if v.get("cross_host")}
        net["pairs_between_hosts_seen"] = bool(cross)
        for key, pair in cross.items():
            net[f"pair_{key.replace('->', '_to_')}_network_transport"] = bool(pair["ok"])
    net["ucx_proto_info_read"] = bool(parsed)
    net["bytes_verified_by_checksum"] = figures.get("verified_nbytes_checksum", 0) > 0
    checks["network"] = net
    return checks, figures


def run_failstop(
    launch: Launch, ranks: int, device: str, timeout_s: float, bound_s: float, grace_s: float = 0.5
) -> tuple[dict[str, bool], dict]:
    """The fail-stop world: (checks, figures). See ``kvown.apps.qualify_failstop``."""
    # the caller's KVOWN_FLIGHT_DIR when it gives one (figures name the directory the ranks really used)
    given_dir = launch.env.get("KVOWN_FLIGHT_DIR")
    flight_dir = given_dir or tempfile.mkdtemp(prefix="kvown-qualify-flight-")
    run = run_world(
        launch,
        ranks,
        [
            sys.executable,
            "-m",
            "kvown.apps.qualify_failstop",
            "--device",
            device,
            "--timeout-s",
            str(grace_s),
            "--grace-s",
            str(grace_s),
        ],
        timeout_s,
        watch_pids=launch.sees_pids,
        extra_env={"KVOWN_FLIGHT_DIR": flight_dir},
    )
    deadline = (run.tagged.get("KVOWN-DEADLINE") or [{}])[-1]
    figures: dict = {
        "ranks": ranks,
        "hosts": sorted({r["host"] for r in run.ranks.values()}),
        "returncode": run.returncode,
        "flight_dir": flight_dir,
    }
    checks: dict[str, bool] = {
        "every_rank_started": len(run.ranks) == ranks,
        "deadline_reported": bool(deadline.get("deadline_mono_ns")),
        "world_ended_in_time": not run.timed_out and run.exit_ns is not None,
        "exit_code_is_deadline": run.returncode == FAILSTOP_EXIT_CODE,
        "failstop_names_the_request": f"reason=deadline request_id={deadline.get('request_id')}"
        in run.stderr,
    }
    if deadline.get("deadline_mono_ns") and run.exit_ns is not None:
        if launch.sees_pids:  # one machine: the ranks' monotonic clock is ours
            exit_ms = (run.exit_ns - deadline["deadline_mono_ns"]) / 1e6
        else:  # other hosts: wall clocks (as good as their synchronisation)
            exit_ms = (
                run.exit_ns + (time.time_ns() - time.monotonic_ns()) - deadline["deadline_wall_ns"]
            ) / 1e6
        figures["deadline_to_launcher_exit_ms"] = round(exit_ms, 1)
        gone_ms = exit_ms  # the launcher exits only after every daemon reported its ranks gone
        if launch.sees_pids:
            checks["every_rank_pid_gone"] = run.all_gone_ns is not None
            if run.all_gone_ns is not None:
                gone_ms = (run.all_gone_ns - deadline["deadline_mono_ns"]) / 1e6
                figures["deadline_to_all_ranks_gone_ms"] = round(gone_ms, 1)
        checks["not_killed_before_the_deadline"] = gone_ms >= 0
        checks[f"world_gone_within_{bound_s:g}s_of_the_deadline"] = gone_ms < bound_s * 1000
        figures["clock"] = (
            "this machine's monotonic clock" if launch.sees_pids else "wall clocks of the hosts"
        )
    else:
        checks["world_gone_after_the_deadline"] = False
        figures["tail"] = (run.stdout[-1500:] + run.stderr[-3000:]).strip()
    if not given_dir and all(checks.values()):  # nothing to look into: our own temporary directory goes
        shutil.rmtree(flight_dir, ignore_errors=True)
        figures["flight_dir"] = None
    return checks, figures


# ---- reports ---------------------------------------------------------------------------------------


def print_table(checks: dict[str, dict[str, bool]], figures: dict, out=sys.stdout) -> None:
    for name, results in checks.items():
        failed = [k for k, v in results.items() if not v]
        print(
            f"  {'PASS' if not failed else 'FAIL'}  {name:<30} {len(results):>2} checks"
            + (f"  failed: {', '.join(failed)}" if failed else ""),
            file=out,
        )
    sc = figures.get("scenarios", {})
    fs = figures.get("failstop", {})
    print("  figures:", file=out)
    if sc.get("ranks"):
        print(
            "    ranks              " + ", ".join(f"{r['rank']}@{r['host']}" for r in sc["ranks"]), file=out
        )
    if sc.get("connect_s"):
        print(
            f"    start-up (connect)  max {max(sc['connect_s']):.2f} s  per rank {sc['connect_s']}"
            f"  (NIXL agents, registration, metadata allgather + load)",
            file=out,
        )
    for key, pair in sc.get("ucx_pairs", {}).items():
        where = f"{pair.get('from_host')} -> {pair.get('to_host')}"
        lanes = ", ".join(pair.get("lanes", [])) or "none seen"
        note = "" if pair.get("exact", True) else " (candidates)"
        verdict = "" if pair.get("ok") else "  <- " + pair.get("why", "")
        print(
            f"    UCX {key:<6} {where:<40} {lanes}{note}{verdict}",
            file=out,
        )
    if "verified_nbytes_checksum" in sc:
        print(
            f"    bytes verified      {sc['verified_nbytes_checksum']} by checksum, "
            f"{sc.get('verified_nbytes_pattern', 0)} by pattern",
            file=out,
        )
    if fs:
        gone = fs.get("deadline_to_all_ranks_gone_ms")
        print(
            f"    fail-stop           deadline -> every rank gone "
            f"{'%.0f ms' % gone if gone is not None else 'n/a'}, -> launcher exit "
            f"{fs.get('deadline_to_launcher_exit_ms', 'n/a')} ms  ({fs.get('ranks')} ranks on "
            f"{len(fs.get('hosts', []))} host(s))",
            file=out,
        )
    if "durations_s" in figures:
        d = figures["durations_s"]
        print(
            f"    took                {d.get('total', 0):.1f} s (scenarios {d.get('scenarios', 0):.1f} s, "
            f"fail-stop world {d.get('failstop', 0):.1f} s)",
            file=out,
        )


def write_junit(path: str, checks: dict[str, dict[str, bool]], figures: dict, suite: str) -> None:
    """JUnit XML: one testcase per check (classname = scenario), figures as suite properties."""
    total = sum(len(v) for v in checks.values())
    failures = sum(1 for v in checks.values() for ok in v.values() if not ok)
    root = ET.Element("testsuites", name="kvown qualify", tests=str(total), failures=str(failures))
    ts = ET.SubElement(
        root,
        "testsuite",
        name=suite,
        tests=str(total),
        failures=str(failures),
        errors="0",
        skipped="0",
        time=f"{figures.get('durations_s', {}).get('total', 0):.2f}",
    )
    props = ET.SubElement(ts, "properties")
    for key, value in _flat_figures(figures).items():
        ET.SubElement(props, "property", name=key, value=str(value))
    for scenario, results in checks.items():
        for check, ok in results.items():
            case = ET.SubElement(ts, "testcase", classname=f"kvown.qualify.{scenario}", name=check, time="0")
            if not ok:
                ET.SubElement(case, "failure", message=f"{scenario}: {check} is false", type="CheckFailed")
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def _flat_figures(figures: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in figures.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat_figures(value, name + "."))
        elif isinstance(value, (list, tuple)):
            out[name] = json.dumps(value)
        elif not (isinstance(value, str) and len(value) > 200):
            out[name] = value
    return out


# ---- launcher --------------------------------------------------------------------------------------


def _launch_for(args: argparse.Namespace, hosts_obj=None) -> Launch:
    base_env = dict(os.environ, NIXL_LOG_LEVEL=os.environ.get("NIXL_LOG_LEVEL", "WARN"))
    forward = ["PYTHONPATH", "NIXL_LOG_LEVEL", "UCX_PROTO_INFO", "KVOWN_FLIGHT_DIR", "PYTHONUNBUFFERED"]
    forward += [k for k in os.environ if k.startswith("UCX_") and k not in forward]
    if hosts_obj is not None:
        env = hosts_obj.env(base_env)
        return Launch(
            lambda n: hosts_obj.mpirun_command(n),
            env,
            forward,
            True,
            hosts_obj.n,
            "eth0",
            f"{hosts_obj.n} test hosts ({hosts_obj.subnet})",
        )
    if args.launcher:
        prefix = shlex.split(args.launcher)
        return Launch(lambda n: prefix, base_env, forward, False, args.expect_hosts or 2, None, args.launcher)
    if args.hosts:
        names = [h for h in args.hosts.split(",") if h]
        spec = ",".join(f"{h}:{args.slots}" for h in names)
        return Launch(
            lambda n: mpirun_command(n) + ["--host", spec, "--map-by", "node"],
            base_env,
            forward,
            False,
            len(names),
            None,
            f"hosts {args.hosts}",
        )
    if args.hostfile:
        hostfile = str(Path(args.hostfile).resolve())
        n_hosts = len(
            [ln for ln in Path(hostfile).read_text().splitlines() if ln.strip() and not ln.startswith("#")]
        )
        return Launch(
            lambda n: mpirun_command(n) + ["--hostfile", hostfile, "--map-by", "node"],
            base_env,
            forward,
            False,
            n_hosts,
            None,
            f"hostfile {args.hostfile}",
        )
    return Launch(mpirun_command, base_env, forward, True, 1, None, "this host")


def qualify(args: argparse.Namespace, launch: Launch) -> tuple[dict, dict]:
    t0 = time.monotonic()
    checks, sc_figures = run_scenarios(launch, args.layout, args.device, args.timeout_s, args.scale_layout)
    figures: dict = {
        "scenarios": sc_figures,
        "where": launch.where,
        "layout": args.layout,
        "scale_layout": args.scale_layout if args.layout == "nvfp4" else None,
        "device": args.device,
    }
    t1 = time.monotonic()
    if not args.no_failstop:
        ranks = args.failstop_ranks or (3 if args.launcher else max(3, launch.hosts_wanted))
        fs_checks, fs_figures = run_failstop(
            launch, ranks, args.device, min(args.timeout_s, 120.0), args.failstop_bound_s
        )
        checks["fail_stop_across_hosts"] = fs_checks
        figures["failstop"] = fs_figures
    t2 = time.monotonic()
    figures["durations_s"] = {
        "scenarios": round(t1 - t0, 2),
        "failstop": round(t2 - t1, 2),
        "total": round(t2 - t0, 2),
    }
    return checks, figures


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvown qualify",
        description=__doc__.splitlines()[0],
        epilog="See docs/operations.md, 'Qualifying a cluster'.",
    )
    ap.add_argument(
        "--layout", choices=LAYOUTS, default="standard", help="KV layout to qualify (default standard)"
    )
    ap.add_argument("--scale-layout", choices=["inline", "separate"], default="inline",
                    help="nvfp4: scales inside each block (vLLM) or in a separate scale pool (TensorRT-LLM)")
    ap.add_argument("--device", default="cpu", help="cpu (host memory) or cuda (VRAM)")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--hosts", help="comma-separated hosts for mpirun --host (one rank per host)")
    where.add_argument("--hostfile", help="an Open MPI hostfile")
    where.add_argument(
        "--launcher",
        help="a launcher line that starts the ranks itself, e.g. "
        "'srun --mpi=pmix -N3 -n3' (it must start 3 ranks; both worlds use it)",
    )
    where.add_argument(
        "--test-hosts",
        type=int,
        metavar="N",
        help="build N network-namespace hosts on this machine and qualify across them (root)",
    )
    ap.add_argument("--slots", type=int, default=4, help="slots per host with --hosts (default 4)")
    ap.add_argument(
        "--expect-hosts", type=int, default=0, help="with --launcher: hosts the ranks should span"
    )
    ap.add_argument("--json", metavar="PATH", help="write every check (true/false) and the figures as JSON")
    ap.add_argument(
        "--junit-xml", metavar="PATH", help="write the checks as JUnit XML (one testcase per check)"
    )
    ap.add_argument("--timeout-s", type=float, default=240.0, help="bound on each world (default 240)")
    ap.add_argument("--no-failstop", action="store_true", help="skip the fail-stop world")
    ap.add_argument(
        "--failstop-ranks", type=int, default=0, help="ranks of the fail-stop world (default: max(3, hosts))"
    )
    ap.add_argument(
        "--failstop-bound-s",
        type=float,
        default=2.0,
        help="the world must be gone this soon after the deadline (default 2 s; target < 1 s)",
    )
    return ap


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM (a CI timeout) tears down like Ctrl-C (rule 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with what their types cannot say refused by name (usage, exit status 2): nothing is
    launched for a device kvown has no memory for, a bound that is not positive, or a world too small."""
    ap = build_parser()
    args = ap.parse_args(argv)
    _check_ranges(ap, args)
    return args


def _check_ranges(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", args.device):
        ap.error(f"--device: {args.device!r} (cpu, cuda or cuda:N)")
    if args.test_hosts is not None and not 1 <= args.test_hosts <= 200:
        ap.error(f"--test-hosts: {args.test_hosts} (1 to 200)")
    for flag, value, low in (("--slots", args.slots, 1), ("--expect-hosts", args.expect_hosts, 0)):
        if value < low:
            ap.error(f"{flag}: {value} (at least {low})")
    if args.failstop_ranks < 0 or args.failstop_ranks == 1:
        ap.error(f"--failstop-ranks: {args.failstop_ranks} (at least 2; 0 picks max(3, hosts))")
    for flag, seconds in (("--timeout-s", args.timeout_s), ("--failstop-bound-s", args.failstop_bound_s)):
        if not seconds > 0:
            ap.error(f"{flag}: {seconds} (must be > 0)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hosts_obj = None
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        if args.test_hosts:
            from kvown.testing.hosts import HostsUnavailable, TestHosts

            try:
                # VRAM needs UCX's cuda_copy lane (staging inside the process) beside TCP; still no shared memory
                tls = "tcp,self,cuda_copy" if args.device.startswith("cuda") else "tcp,self"
                hosts_obj = TestHosts(args.test_hosts, ucx_tls=tls).open()
            except HostsUnavailable as exc:
                print(f"kvown qualify: cannot build test hosts here: {exc.reason}", file=sys.stderr)
                return 2
        launch = _launch_for(args, hosts_obj)
        print(f"kvown qualify: layout {args.layout}, device {args.device}, {launch.where}", flush=True)
        checks, figures = qualify(args, launch)
    except KeyboardInterrupt:
        print("kvown qualify: interrupted", file=sys.stderr)
        return 130
    finally:
        if hosts_obj is not None:
            hosts_obj.close()
    ok = all(all(v.values()) and v for v in checks.values())
    print_table(checks, figures)
    tail = figures.get("scenarios", {}).get("scenario_world_tail") or figures.get("failstop", {}).get("tail")
    if tail:
        print(tail[-3000:], file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"passed": ok, "checks": checks, "figures": figures}, indent=1))
    if args.junit_xml:
        write_junit(args.junit_xml, checks, figures, f"kvown.qualify.{args.layout}.{args.device}")
    print("kvown qualify: " + ("every check passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
