"""W5 frozen writer: SIGSTOP a writer mid-transfer under load; time from the deadline to the world gone,
and proof that no block of the frozen writer's sessions was retired before the abort.

Two parts in one module:
  launcher (``main``)  starts ``mpirun -n 3 python -m kvown.apps.benchmarks.frozen --rank-program`` with
                       ``KVOWN_FLIGHT_DIR`` set, watches every rank PID (2 ms polls, bounded), and
                       afterwards reads rank 0's flight-recorder dump.
  ranks                rank 0 receives from writers 1 and 2 in turn (``--window`` sessions in flight);
                       after ``--load-s`` it SIGSTOPs writer 2 (its WRITEs and reports may be in flight)
                       and publishes one more session to it. It writes the stuck sessions' ids and
                       the nearest fail-stop deadline (``statistics()``: ``oldest_fail_stop_deadline_ns``,
                       the monotonic clock every process on this host shares), and keeps the load going
                       with writer 1 until the world dies.
Measured: ``w5_failstop_s`` = every rank PID gone - that deadline. Proof: rank 0's dump names the
reason (``deadline``) and holds no ``retire`` event for a stuck session; the frozen writer's claims
were still open when the world died. Baseline for the reader: the deadline itself is
``transfer_timeout_s + grace_s`` after exposure (1 s here), against the 30-480 s timers of peers.

Rules: every wait is bounded; our own processes only are signalled (the launcher's process group and
the PIDs the ranks reported), and a stopped rank is continued before it is killed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from kvown.apps.benchmarks.common import count, environment, write_json  # noqa: E402
from kvown.apps.benchmarks.slow import SlowSessions  # noqa: E402

RX, STEADY, FROZEN = 0, 1, 2


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :].split()[0] != b"Z"


def launch(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    from kvown.adapters.mpirun import mpirun_command

    out.mkdir(parents=True, exist_ok=True)
    flight = out / "flight"
    flight.mkdir(exist_ok=True)
    cmd = [*mpirun_command(3), sys.executable, "-m", "kvown.apps.benchmarks.frozen", "--rank-program",
           "--out", str(out), "--load-s", str(args.load_s), "--window", str(args.window),
           "--timeout-s", str(args.timeout_s)]
    env = {**os.environ, "KVOWN_FLIGHT_DIR": str(flight), "PYTHONUNBUFFERED": "1"}
    pids: dict[int, int] = {}
    gone_ns = exit_ns = None
    timed_out = False
    with open(out / "mpirun.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        end = time.monotonic() + args.world_timeout_s
        try:
            while time.monotonic() < end:
                for r in range(3):
                    p = out / f"pid{r}"
                    if r not in pids and p.exists():
                        try:
                            pids[r] = int(p.read_text())
                        except ValueError:
                            pass
                if exit_ns is None and proc.poll() is not None:
                    exit_ns = time.monotonic_ns()
                if len(pids) == 3 and gone_ns is None and not any(_alive(p) for p in pids.values()):
                    gone_ns = time.monotonic_ns()
                if exit_ns is not None and (gone_ns is not None or len(pids) < 3):
                    break
                time.sleep(0.002)
            else:
                timed_out = True
        finally:
            for pid in pids.values():  # our ranks only: continue a stopped one, then kill what is left
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        break
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
    marker = out / "frozen.json"
    info = json.loads(marker.read_text()) if marker.exists() else {}
    result: dict[str, Any] = {"returncode": proc.returncode, "timed_out": timed_out, "ranks_seen": len(pids),
                              "timeout_s": args.timeout_s, "grace_s": args.timeout_s, "load_s": args.load_s,
                              "stuck_sessions": len(info.get("stuck", [])),
                              "sessions_before_freeze": info.get("completed", 0),
                              "slow_sessions": info.get("slow_sessions", {}).get("count")}
    deadline = info.get("deadline_ns")
    if deadline and gone_ns:
        result["deadline_to_world_gone_s"] = round((gone_ns - deadline) / 1e9, 4)
    if deadline and exit_ns:
        result["deadline_to_mpirun_exit_s"] = round((exit_ns - deadline) / 1e9, 4)
    result.update(_proof(flight, set(info.get("stuck", []))))
    return result


def _proof(flight: Path, stuck: set[int]) -> dict[str, Any]:
    """Read rank 0's dump: its reason, and no ``retire`` of a stuck session."""
    from kvown.runtime.flight import read_flight_file

    dumps = sorted(flight.glob("kvown-flight-rank0-pid*.jsonl"))
    if not dumps:
        return {"dump_found": False, "retired_before_abort": None}
    records = read_flight_file(dumps[-1])
    header = records[0] if records and records[0].get("type") == "header" else {}
    retired = [r["request_id"] for r in records if r.get("type") == "event" and r.get("kind") == "retire"]
    early = sorted(set(retired) & stuck)
    return {"dump_found": True, "reason": header.get("reason"), "fatal_request_id": header.get("request_id"),
            "detail": header.get("detail"),
            "retire_events_in_dump": len(retired), "retired_before_abort": bool(early), "retired_stuck": early,
            "fatal_is_a_stuck_session": header.get("request_id") in stuck}


# ---------------------------------------------------------------------------------------------- ranks


def rank_program(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    from kvown import KVLayout, TransferConfig, connect_mpi, make_request_id

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    out = Path(args.out)
    (out / f"pid{rank}").write_text(str(os.getpid()))
    layout = KVLayout.standard(num_layers=4, num_blocks=64, tokens_per_block=16, num_kv_heads=2, head_dim=128,
                               dtype="bfloat16")
    config = TransferConfig(transfer_timeout_s=args.timeout_s, grace_s=args.timeout_s)
    rt = connect_mpi(comm, layout=layout, config=config, roles={"receiver"} if rank == RX else {"sender"})
    pids = comm.allgather(os.getpid())
    seq = [0]

    def rid() -> int:
        seq[0] += 1
        return make_request_id(7, seq[0])

    if rank != RX:  # writers: answer every publication from rank 0 (ids arrive in order over MPI)
        while True:
            r = comm.recv(source=RX, tag=5)
            if r is None:
                break
            rt.sender.send(r, range(4))
        return 0
    receiver = rt.receiver
    live, completed, slow = _load(receiver, comm, rid, args)
    # stuck: published to the writer about to freeze, and no report from it yet (its claim is open)
    stuck = [h.request_id for w, h in live if w == FROZEN and not h.landed.is_set()]
    for _, h in list(live):
        if h.landed.is_set() and not h.closing:
            receiver.release(h.request_id)
    # Frozen first, then one more session published to it: that one can never be answered. Published
    # first, the writer now and then wrote and reported it before the signal took effect (1-4 runs in
    # 60): nothing was left stuck, so rank 0 rightly never fail-stopped and the run hit its bound.
    os.kill(pids[FROZEN], signal.SIGSTOP)
    r = rid()
    receiver.receive(r, 4, writers=(FROZEN,))
    comm.send(r, dest=FROZEN, tag=5)
    stuck.append(r)
    time.sleep(0.01)
    deadline = rt.statistics().receiver.oldest_fail_stop_deadline_ns
    marker = {"deadline_ns": deadline, "stuck": stuck, "completed": completed, "frozen_pid": pids[FROZEN],
              "slow_sessions": slow.report()}
    tmp = out / "frozen.json.tmp"
    tmp.write_text(json.dumps(marker))
    tmp.replace(out / "frozen.json")
    while True:  # keep the steady writer busy until the world dies (bounded by the launcher)
        r = rid()
        h = receiver.receive(r, 4, writers=(STEADY,))
        comm.send(r, dest=STEADY, tag=5)
        if h.landed.wait(2):
            receiver.release(r)
            h.retired.wait(2)


def _load(receiver: Any, comm: Any, rid: Callable[[], int], args: argparse.Namespace) -> tuple:
    """The load phase: both writers in turn, ``--window`` sessions in flight, for ``--load-s``.
    Returns (the sessions still live, how many completed, the slow sessions)."""
    live: collections.deque = collections.deque()
    completed = 0
    slow = SlowSessions(slow_s=2 * args.timeout_s, give_up_s=10 * args.timeout_s + 10.0)
    t_end = time.monotonic() + args.load_s
    turn = 0
    while time.monotonic() < t_end:
        while len(live) < args.window:
            writer = STEADY if turn % 2 == 0 else FROZEN
            turn += 1
            r = rid()
            h = receiver.receive(r, 4, writers=(writer,))
            comm.send(r, dest=writer, tag=5)
            live.append((writer, h))
        _, h = live.popleft()
        # a session kvown timed out under load retires without landing: slow, counted, never a crash
        if slow.wait("frozen-load", h.request_id, "landed", h.landed, instead=h.retired):
            receiver.release(h.request_id)
            slow.wait("frozen-load", h.request_id, "retired", h.retired)
            completed += 1
    return live, completed, slow


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvown bench frozen", description=__doc__.splitlines()[0])
    ap.add_argument("--rank-program", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    ap.add_argument("--load-s", type=float, default=2.0)
    ap.add_argument("--window", type=count, default=4)
    ap.add_argument("--timeout-s", type=float, default=0.5, help="transfer timeout and grace (deadline = 2x)")
    ap.add_argument("--runs", type=count, default=3)
    ap.add_argument("--world-timeout-s", type=float, default=120.0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=sys.stderr.isatty())
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG: deadline -> world gone per run")
    args = ap.parse_args(argv)
    if args.rank_program:
        return rank_program(args)
    if args.quick:
        args.runs, args.load_s = 1, 0.5
    from kvown.apps.benchmarks.common import progress

    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="kvown-bench-frozen-"))
    runs = []
    with progress(args.runs, "W5 frozen writer", args.progress) as bar:
        for i in range(args.runs):
            runs.append(launch(base / f"run{i}", args))
            bar.update(1)
    ok = [r for r in runs if "deadline_to_world_gone_s" in r]
    times = sorted(r["deadline_to_world_gone_s"] for r in ok)
    result = {"benchmark": "frozen", "runs": runs, "environment": environment(),
              "w5_failstop_s": times[len(times) // 2] if times else None,
              "w5_failstop_max_s": times[-1] if times else None,
              "retired_before_abort": any(r.get("retired_before_abort") for r in runs),
              "all_dumps_name_the_deadline": all(r.get("reason") == "deadline" for r in runs),
              "out": str(base)}
    for r in runs:
        print(f"W5 frozen writer: deadline -> world gone {r.get('deadline_to_world_gone_s')} s "
              f"(mpirun exit {r.get('deadline_to_mpirun_exit_s')} s); stuck sessions {r['stuck_sessions']}, "
              f"retired before the abort: {r.get('retired_before_abort')}; dump reason {r.get('reason')} "
              f"({r.get('detail')}); slow sessions in the load phase {r.get('slow_sessions')}")
    print(f"W5: median {result['w5_failstop_s']} s over {len(ok)}/{len(runs)} runs; "
          f"no stuck block retired: {not result['retired_before_abort']}")
    write_json(args.json, result)
    if args.plot:
        from kvown.apps.benchmarks.common import plot_figure, save

        fig, axes = plot_figure(args.plot, 1, "W5 frozen writer: deadline -> world gone")
        axes[0].bar([f"run {i + 1}" for i in range(len(runs))], [r.get("deadline_to_world_gone_s") or 0 for r in runs],
                    color=["tab:red" if r.get("retired_before_abort") else "tab:green" for r in runs])
        axes[0].set_ylabel("s after the fail-stop deadline")
        save(fig, args.plot)
    return 0 if ok and not result["retired_before_abort"] else 1


if __name__ == "__main__":
    sys.exit(main())
