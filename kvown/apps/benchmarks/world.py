"""W1 happy path, W2 cancellation sweep and W3 fan-in in one mpirun world, against B0 and B1.

Run under ``mpirun -n 1+K``: rank 0 receives, ranks 1..K write. One run, fixed seeds, the same pools
throughout; every figure on rank 0's monotonic clock. Baselines (B0 raw NIXL, B1 timeout): ``raw.py``.

Workloads (one function each: ``run_w1``, ``run_w2``, ``run_w3``, after ``yardsticks``):
  W1  sessions of 64 KiB .. 16 MiB, ``--window`` in flight, kvown vs B0, alternating repetitions:
      throughput ratio with an event-driven consumer (callbacks on the engine thread: the headline) and
      with a consumer thread that waits per session, beside B0 and B0+pub (B0 plus the publication);
      then release -> retired, one session at a time.
  W2  cancel rates 0/10/50/90 %, 64 KiB .. 4 MiB, one session at a time, context-first, cancelled
      after a seeded delay in [0, WRITE(S)]: cancel -> retired vs ``3 RTT + WRITE`` (p50) and
      ``10 RTT + WRITE`` (p99); violations (a canary changed after the slot was given back) for
      kvown, B0 and B1.
  W3  fan-in: K = 1..(size-1) writers, head slice i of K each, 20 % cancelled.

Rules:
  1. Every wait is bounded: ``--deadline-s`` for the run; a session's waits by ``slow.py`` - a slow
     session is counted and reported (``slow_sessions``), left out of the percentiles, never a crash.
  2. When any rank saw a new slow session, every rank writes its flight recorder (``--flight-dir``);
     run as a rank, SIGTERM (a peer's abort) makes each rank dump before it dies.
  3. A baseline runs only once kvown's engines nap (``quiet_engines``): an idle engine is not raw NIXL's.

Usage (the launcher builds this): ``mpirun -n 2 python -m kvown.apps.benchmarks.world --json out.json``.
"""

from __future__ import annotations

import signal

if __name__ == "__main__":  # a rank of the world: SIGTERM blocked before any thread exists (open_bench)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

import argparse  # noqa: E402
import collections  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np  # noqa: E402

from kvown.apps.benchmarks.common import KIB, MIB, cdf, environment, pct, plot_figure, progress, save, size_name  # noqa: E402
from kvown.apps.benchmarks.common import count, count0, emit, w1_bars  # noqa: E402
from kvown.apps.benchmarks.raw import CANARY, RX, BenchError, Raw, soft_barrier, soft_recv  # noqa: E402
from kvown.apps.benchmarks.raw import spin_until_ns, sync_device  # noqa: E402
from kvown.apps.benchmarks.slow import SlowSessions  # noqa: E402

TAG_OPENED = 11


def runs_of(blocks: tuple[int, ...]) -> int:
    return 1 + sum(1 for a, b in zip(blocks, blocks[1:]) if b != a + 1) if blocks else 0


class Rids:
    """Request ids, identical on every rank (drawn in the same order); never reused."""

    def __init__(self) -> None:
        self.seq = 0

    def take(self, n: int) -> list[int]:
        from kvown import make_request_id

        out = [make_request_id(1, self.seq + i) for i in range(n)]
        self.seq += n
        return out

# ---------------------------------------------------------------------------------------- kvown


def engine_clocks(rt: Any) -> tuple[int, int | None]:
    """The engine thread's work and CPU so far (``Statistics.engine_busy_ns`` / ``engine_cpu_ns``). W1
    reports both per session, so a reader sees which side's engine is the bottleneck (its work fills the
    loop) and what kvown adds to raw's session; CPU alone cannot say it: a polling engine is always on one."""
    stats = rt.statistics()
    return stats.engine_busy_ns, stats.engine_cpu_ns


def _clocks_used(before: tuple[int, int | None], rt: Any) -> tuple[int, int | None]:
    busy, cpu = engine_clocks(rt)
    return busy - before[0], None if cpu is None or before[1] is None else cpu - before[1]


def kv_throughput_threads(rt: Any, comm: Any, rank: int, rids: list[int], nb: int, window: int, deadline: float,
                          slow: SlowSessions) -> dict[str, Any]:
    """W1 with a consumer thread that waits for each session's events (landed, released, retired) and
    then acts: the second figure. Every wait wakes a thread that then needs its process's GIL."""
    from kvown import Outcome

    soft_barrier(comm, deadline)
    clocks0 = engine_clocks(rt)
    t0 = time.perf_counter_ns()
    bad, runs = 0, 0
    if rank == 1:
        live: collections.deque = collections.deque()
        for i, rid in enumerate(rids):
            if len(live) == window:
                h = live.popleft()
                slow.wait("w1", h.request_id, "sender released", h.released)
                bad += h.outcome.result(1) is not Outcome.COMPLETED
            slot = i % window
            live.append(rt.sender.send(rid, range(slot * nb, (slot + 1) * nb)))
        while live:
            h = live.popleft()
            slow.wait("w1", h.request_id, "sender released", h.released)
            bad += h.outcome.result(1) is not Outcome.COMPLETED
    elif rank == RX:
        receiver = rt.receiver
        todo = collections.deque(rids)
        live = collections.deque()  # published, not yet released
        rel: collections.deque = collections.deque()  # released, not yet retired
        done = 0
        while done < len(rids):
            while todo and len(live) + len(rel) < window:
                h = receiver.receive(todo.popleft(), nb, writers=(1,))
                runs += runs_of(h.blocks)
                live.append(h)
            if live:
                h = live.popleft()
                slow.wait("w1", h.request_id, "landed", h.landed, instead=h.retired)
                receiver.release(h.request_id)
                rel.append(h)
            while rel and rel[0].retired.is_set():
                h = rel.popleft()
                bad += h.outcome.result(1) is not Outcome.COMPLETED
                done += 1
            if rel and not live and (not todo or len(rel) >= window):
                h = rel.popleft()
                slow.wait("w1", h.request_id, "retired", h.retired)
                bad += h.outcome.result(1) is not Outcome.COMPLETED
                done += 1
            if time.monotonic() > deadline:
                raise BenchError("kvown throughput past the run deadline")
    ns = time.perf_counter_ns() - t0
    clocks = _clocks_used(clocks0, rt)
    soft_barrier(comm, deadline)
    return {"ns": ns, "engine": clocks, "not_completed": bad, "dst_runs": runs,
            "slow_sessions": slow.count("w1")}


class CallbackLoop:
    """One rank's share of ``kv_throughput_callbacks``. Its callbacks run on the engine thread and never
    raise: what they catch ends the loop, and ``wait`` raises it in the main thread."""

    def __init__(self, rt: Any, rank: int, rids: list[int], nb: int, window: int) -> None:
        self.rt, self.rank, self.nb, self.window = rt, rank, nb, window
        self.finished: list[Any] = []  # handles, in the order they finished
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.todo = iter(enumerate(rids))
        self.left = len(rids) if rank in (RX, 1) else 0  # W1 is rank 0 and writer 1; the others wait
        if not self.left:
            self.done.set()
        self.bad = self.runs = 0

    def start(self) -> None:
        for _ in range(min(self.window, self.left)):
            self._open_next()

    def _open_next(self) -> None:
        item = next(self.todo, None)
        if item is None:
            return
        i, rid = item
        if self.rank == RX:
            self.rt.receiver.submit_receive(rid, self.nb, (1,), on_landed=self._landed, on_done=self._finished)
        else:
            slot = i % self.window
            self.rt.sender.send(rid, range(slot * self.nb, (slot + 1) * self.nb), on_done=self._finished)

    def _landed(self, h: Any) -> None:
        try:
            self.rt.receiver.release(h.request_id)
        except Exception as exc:  # noqa: BLE001 - handed to the main thread
            self._fail(exc)

    def _finished(self, h: Any) -> None:
        try:
            from kvown import Outcome

            self.bad += h.result() is not Outcome.COMPLETED
            self.runs += runs_of(h.blocks) if self.rank == RX else 0
            self.finished.append(h)
            self.left -= 1
            if self.left:
                self._open_next()
            else:
                self.done.set()
        except Exception as exc:  # noqa: BLE001 - handed to the main thread
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.error = self.error or exc
        self.done.set()

    def wait(self, slow: SlowSessions, deadline: float) -> None:
        """Bounded: a loop that stops finishing sessions for ``slow.give_up_s`` raises (slow.py rule 3)."""
        seen, since = -1, time.monotonic()
        while not self.done.wait(0.05):
            now = time.monotonic()
            if len(self.finished) != seen:
                seen, since = len(self.finished), now
            if now - since > slow.give_up_s or now > deadline:
                raise BenchError(f"W1 callbacks: no session finished for {now - since:.1f} s")
        if self.error is not None:
            raise BenchError(f"W1 callbacks: {self.error!r}") from self.error
        for h in self.finished:  # a session that took longer than slow_s is slow (slow.py rule 1)
            end_ns = h.retired_ns if self.rank == RX else h.released_ns
            slow.note("w1", h.request_id, "retired" if self.rank == RX else "released", (end_ns - h.opened_ns) / 1e9)


def kv_throughput_callbacks(rt: Any, comm: Any, rank: int, rids: list[int], nb: int, window: int, deadline: float,
                            slow: SlowSessions) -> dict[str, Any]:
    """W1 with an event-driven consumer (the headline figure): each side opens its next session from the
    last one's callback on the engine thread (the receiver releases from ``on_landed`` and receives again
    from ``on_done``; the writer sends again from ``on_done``), as a server's event loop does. Like the
    raw baseline, one thread per process does the work; nothing waits per session."""
    soft_barrier(comm, deadline)
    loop = CallbackLoop(rt, rank, rids, nb, window)
    clocks0 = engine_clocks(rt)
    t0 = time.perf_counter_ns()
    loop.start()
    loop.wait(slow, deadline)
    ns = time.perf_counter_ns() - t0
    clocks = _clocks_used(clocks0, rt)
    soft_barrier(comm, deadline)
    return {"ns": ns, "engine": clocks, "not_completed": loop.bad, "dst_runs": loop.runs,
            "slow_sessions": slow.count("w1")}


def kv_sessions(rt: Any, comm: Any, rank: int, rids: list[int], nb: int, writers: tuple[int, ...],
                plan: list[tuple[bool, int]], settle_ns: int, canary: bool, deadline: float,
                slow: SlowSessions, workload: str, warmup: int = 0, bar: Any = None) -> dict[str, Any]:
    """One session at a time, context-first. ``plan[i] = (cancel, delay_ns)``; not cancelled means
    landed -> release. Rank 0 canaries every retired destination and checks it after ``settle_ns``.
    The latency lists (``*_ns``) leave out the first ``warmup`` sessions and every slow one
    (``kvown.apps.benchmarks.slow``: counted in ``slow_sessions``, not timed)."""
    soft_barrier(comm, deadline)
    k = len(writers)
    out: dict[str, Any] = collections.defaultdict(list)
    outcomes: collections.Counter = collections.Counter()
    if rank in writers:
        sender = rt.sender
        for i, rid in enumerate(rids):
            h = sender.send(rid, range(nb))
            req = comm.isend(i, dest=RX, tag=TAG_OPENED)  # context-first: opened before publication
            slow.wait(workload, rid, "sender released", h.released)
            outcomes[h.outcome.result(1).value] += 1
            req.wait()
            if time.monotonic() > deadline:
                raise BenchError("session phase past the run deadline")
    elif rank == RX:
        receiver, pool = rt.receiver, rt.pool.tensor
        block = rt.pool.layout.block_nbytes
        violations = 0
        for i, rid in enumerate(rids):
            for w in writers:
                if soft_recv(comm, w, TAG_OPENED, deadline) != i:
                    raise BenchError("ranks out of step")
            h = receiver.receive(rid, nb, writers=writers, num_slices=k)
            cancel, delay_ns = plan[i]
            if cancel:
                spin_until_ns(time.monotonic_ns() + delay_ns)
                t_decide = time.monotonic_ns()
                receiver.cancel(rid)
            else:
                slow.wait(workload, rid, "landed", h.landed, instead=h.retired)
                t_decide = time.monotonic_ns()
                receiver.release(rid)
            slow.wait(workload, rid, "retired", h.retired)
            outcome = h.outcome.result(1).value
            outcomes[outcome] += 1
            key = "cancel" if cancel else "release"
            if cancel and h.landed_ns:
                out["landed_before_cancel"].append(1)
            if i >= warmup and not slow.is_slow(rid):  # a slow session is counted, not timed (slow.py rule 1)
                out[f"{key}_to_retired_ns"].append(h.retired_ns - t_decide)
                if not cancel and h.landed_ns:
                    out["publish_to_landed_ns"].append(h.landed_ns - h.opened_ns)
            if canary:  # the blocks are FREE: nobody may write them any more
                spans = [pool[b * block : (b + 1) * block] for b in h.blocks]
                for span in spans:
                    span.fill_(CANARY)
                sync_device(pool)
                end = time.monotonic_ns() + settle_ns
                while time.monotonic_ns() < end:
                    os.sched_yield()
                violations += sum(int(bool((span != CANARY).any())) for span in spans)
            if bar is not None:
                bar.update(1)
        out["violations"] = violations
    out["outcomes"] = dict(outcomes)
    out["slow_sessions"] = sum(1 for rid in rids if slow.is_slow(rid))
    soft_barrier(comm, deadline)
    return dict(out)

# ---------------------------------------------------------------------------------------- main


class _PublicRecorder:
    """What ``install_sigterm_dump`` needs of a recorder, through the public ``RankRuntime.flight_dump``."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt

    def record(self, kind: str, request_id: int | None, **detail: Any) -> None:
        pass  # the runtime's own ring is not ours to write

    def dump(self, path_or_dir: str | None, reason: str) -> str:
        return self.rt.flight_dump(path_or_dir, reason)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvown bench world", description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="w1,w2,w3", help="comma list of w1, w2, w3")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--window", type=count, default=4)
    ap.add_argument("--reps", type=count, default=5, help="alternating raw/kvown repetitions per W1 size")
    ap.add_argument("--w1-bytes", type=count, default=64 * MIB, help="bytes per W1 repetition")
    ap.add_argument("--w1-sizes", type=sizes, default="64K,256K,1M,4M,16M")
    ap.add_argument("--w2-sizes", type=sizes, default="64K,1M,4M")
    ap.add_argument("--w2-rates", type=percents, default="0,10,50,90")
    ap.add_argument("--w2-sessions", type=count, default=1000,
                    help="sessions per (size, rate) point: at 10 %% about 100 are cancelled, so p99 is not the max")
    ap.add_argument("--w3-sessions", type=count, default=200, help="sessions per K")
    ap.add_argument("--w3-blocks", type=count, default=16)
    ap.add_argument("--b1-timeout-s", type=float, default=0.2)
    ap.add_argument("--b1-sessions", type=count, default=5)
    ap.add_argument("--settle", type=float, default=3.0, help="canary check after this many WRITE(S) + 1 ms")
    ap.add_argument("--rtt-iters", type=count, default=2000)
    ap.add_argument("--spin-s", type=float, default=0.05,
                    help="engines keep polling this long after progress (the baselines poll all the time); "
                         "kvown's default is 0.002 (then naps), which adds a wake-up to an idle rank's hop")
    ap.add_argument("--idle-sleep-s", type=float, default=0.02,
                    help="then engines nap this long between polls (kvown's default is 200 us): an idle engine "
                         "in the same process slowed the raw baselines by 10-45 %% (quiet_engines)")
    ap.add_argument("--warmup", type=count0, default=30)
    ap.add_argument("--deadline-s", type=float, default=900.0)
    ap.add_argument("--slow-s", type=float, default=1.0,
                    help="a session whose wait for an event is longer is slow: counted, reported, not timed")
    ap.add_argument("--flight-dir", default=None, help="where slow-session and abort dumps go ($KVOWN_FLIGHT_DIR)")
    ap.add_argument("--flight-capacity", type=count, default=4096,
                    help="events each rank's flight recorder keeps")
    ap.add_argument("--no-carry", action="store_true",
                    help="reports travel as control frames after the DONE poll (TransferConfig.carry_results=False)")
    ap.add_argument("--no-coalesce", action="store_true",
                    help="one transfer per session (TransferConfig.coalesce_writes=False)")
    ap.add_argument("--no-huge-pages", action="store_true",
                    help="CPU pools and raw buffers in base pages (both sides; TransferConfig.huge_pages)")
    ap.add_argument("--device", default="cpu", help="cpu (DRAM pools) or cuda (VRAM pools, one GPU per host)")
    ap.add_argument("--layers", type=count, default=4, help="KV geometry; 4/2/128/16 is perf.md's CPU 'mini'")
    ap.add_argument("--kv-heads", type=count0, default=0, help="0: 2, or 6 when W3 runs with 3 writers")
    ap.add_argument("--head-dim", type=count, default=128)
    ap.add_argument("--tokens", type=count, default=16, help="tokens per block")
    ap.add_argument("--w3-rates", type=percents, default="20", help="cancel percent in W3 (the first)")
    ap.add_argument("--w3-writers", default="", help="comma list of K for W3 (default: 1 .. ranks - 1)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=sys.stderr.isatty())
    ap.add_argument("--quick", action="store_true", help="few samples (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.w1_bytes, args.w2_sessions, args.w3_sessions, args.b1_sessions = 1, 8 * MIB, 20, 10, 2
        args.rtt_iters, args.warmup, args.w1_sizes, args.w2_sizes = 200, 5, sizes("64K,1M,4M"), sizes("64K,1M")
        args.w2_rates = [0, 50]
    _check_args(ap, args)
    return args


WORKLOADS = ("w1", "w2", "w3")
QUIET_MARGIN_S = 0.005  # past --spin-s: the engines' last step before their first nap
# W1: sessions each side runs, uncounted, before each measured run: the other side's run (or a CPU that
# slept in quiet_engines) left this side's buffers out of the caches, and the first ones ran ~2x slower
WARMUP = 16


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what the ranks could not run (``ap.error``: the usage and exit status 2), naming the option;
    ``kvown bench`` calls ``parse_args`` before it starts mpirun, so a bad option starts no world. The
    sizes and rates are refused by their argparse types (``sizes``, ``percents``)."""
    unknown = sorted(set(args.workloads.split(",")) - set(WORKLOADS))
    if unknown:
        ap.error(f"--workloads: unknown {', '.join(unknown)} (choose from {', '.join(WORKLOADS)})")
    from kvown import ConfigError, TransferConfig

    try:  # the engines' own rule (TransferConfig), and a nap: quiet_engines waits for one
        TransferConfig(spin_s=args.spin_s, idle_sleep_s=args.idle_sleep_s)
        if not args.idle_sleep_s > 0:
            raise ConfigError("must be > 0 here (0: engines that never nap)", field="idle_sleep_s")
    except ConfigError as exc:
        ap.error(f"--{exc.fields['field'].replace('_', '-')}: {exc}")


def sizes(text: str) -> list[int]:
    """argparse ``type=``: a comma list of positive sizes in bytes, K or M (``64K,1M``)."""
    try:
        out = [_parse_size(t) for t in text.split(",")]
    except (ValueError, IndexError):
        out = []
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of positive sizes (e.g. 64K,1M,4M)")
    return out


def percents(text: str) -> list[int]:
    """argparse ``type=``: a comma list of percents 0-100."""
    if not all(t.strip().isdigit() and int(t) <= 100 for t in text.split(",")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of percents 0-100")
    return [int(t) for t in text.split(",")]


@dataclass
class Bench:
    """One rank's share of the run: what every workload reads (built by ``open_bench``)."""

    args: argparse.Namespace
    comm: Any
    rank: int
    writers: tuple[int, ...]
    block: int
    w1_sizes: list[int]
    w2_sizes: list[int]
    rt: Any
    raw: Raw
    slow: SlowSessions
    deadline: float
    t_start: float
    rng: random.Random = field(default_factory=random.Random)
    rids: Rids = field(default_factory=Rids)
    result: dict[str, Any] = field(default_factory=dict)
    slow_dumped: int = 0  # slow sessions (all ranks) whose flight recorders were written already

    def dump_if_slow(self) -> None:
        """Collective, after a workload step: when any rank saw a new slow session, every rank writes
        its flight recorder now (the ring still holds the slow session's events), for ``kvown inspect``."""
        total = self.comm.allreduce(self.slow.count())
        if total <= self.slow_dumped:
            return
        self.slow_dumped = total
        folder = Path(self.args.flight_dir or os.environ.get("KVOWN_FLIGHT_DIR") or ".")
        name = f"kvown-flight-rank{self.rank}-pid{os.getpid()}-slow{total}.jsonl"
        path = self.rt.flight_dump(str(folder / name), f"slow_sessions: {total}")
        dumps = self.comm.gather(path, root=RX)
        if self.rank == RX:
            self.result.setdefault("slow_session_dumps", []).extend(dumps)

    @property
    def show(self) -> bool:
        return bool(self.args.progress and self.rank == RX)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        print("kvown bench world: run under mpirun -n 2 (or more: writers for W3)", file=sys.stderr)
        return 2
    b = open_bench(args, comm)
    workloads = set(args.workloads.split(","))
    yardsticks(b)
    for name, run in (("w1", run_w1), ("w2", run_w2), ("w3", run_w3)):
        if name in workloads:
            run(b)
    finish(b)
    return 0


def open_bench(args: argparse.Namespace, comm: Any) -> Bench:
    """Connect the runtime and the raw baseline's agents; fill the writers' seeded source bytes."""
    from kvown import KVLayout, TransferConfig, connect_mpi
    from kvown.cache.hostmem import thp_mode

    size, rank = comm.Get_size(), comm.Get_rank()
    heads = args.kv_heads or (2 if size <= 3 else 6)  # W3 slices heads among K writers: 6 divides by 1, 2, 3
    t_start = time.monotonic()
    window = args.window
    geometry = dict(num_layers=args.layers, tokens_per_block=args.tokens, num_kv_heads=heads,
                    head_dim=args.head_dim, dtype="bfloat16")
    block = KVLayout.standard(num_blocks=1, **geometry).block_nbytes
    w1_sizes = sorted({max(block, s // block * block) for s in args.w1_sizes})  # whole blocks
    w2_sizes = sorted({max(block, s // block * block) for s in args.w2_sizes})
    num_blocks = max(max(w1_sizes) // block * window * 2, args.w3_blocks * 2, 8)
    layout = KVLayout.standard(num_blocks=num_blocks, **geometry)
    levers = {"carry_results": not args.no_carry, "coalesce_writes": not args.no_coalesce}
    config = TransferConfig(transfer_timeout_s=5.0, spin_s=args.spin_s, idle_sleep_s=args.idle_sleep_s,
                            flight_capacity=args.flight_capacity, huge_pages=not args.no_huge_pages, **levers)
    rt = connect_mpi(comm, layout=layout, config=config, roles={"receiver"} if rank == RX else {"sender"},
                     device=args.device)
    if signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, ()):  # run as a rank (see the top)
        from kvown.runtime.failstop import install_sigterm_dump

        install_sigterm_dump(_PublicRecorder(rt), dump_dir=args.flight_dir)  # a peer's abort: dump, then die
    tag = comm.bcast(f"{os.getpid():x}" if rank == RX else None, root=RX)
    raw_nbytes = max(max(w1_sizes) * window, max(w2_sizes))
    raw = Raw(comm, rank, raw_nbytes, tag, args.device, huge_pages=not args.no_huge_pages)
    if rank != RX:  # fixed, seeded source bytes (never the canary value)
        import torch

        g = torch.Generator(device="cpu").manual_seed(args.seed + rank)
        src = rt.pool.tensor
        src.copy_(torch.randint(0, 255, (src.numel(),), generator=g, dtype=torch.uint8).to(src.device))
        src[src == CANARY] = 0
        raw.buf.fill_((rank * 37) % 251 + 1)
        sync_device(src)
    # a wait past --slow-s marks its session slow; only one past kvown's deadline + grace (+ 5 s) raises
    slow = SlowSessions(args.slow_s, config.transfer_timeout_s + (config.grace_s or config.transfer_timeout_s) + 5)
    result: dict[str, Any] = {"benchmark": "world", "ranks": size, "block_nbytes": block, "window": window,
                              "heads": heads, "engine_spin_s": config.spin_s,
                              "carry_results": config.carry_results, "coalesce_writes": config.coalesce_writes,
                              "engine_idle_sleep_s": config.idle_sleep_s,
                              "huge_pages": {"asked": config.huge_pages, "thp_mode": thp_mode(),
                                             "advised": getattr(rt.pool, "huge_pages_advised", False)},
                              "args": {k: str(v) for k, v in vars(args).items()}}
    return Bench(args, comm, rank, tuple(range(1, size)), block, w1_sizes, w2_sizes, rt, raw, slow,
                 t_start + args.deadline_s, t_start, random.Random(args.seed), Rids(), result)


def yard_sizes(w2_sizes: list[int], block: int, raw_nbytes: int) -> list[int]:
    """The raw WRITE yardstick's sizes: W2's, and 64 KiB / 1 MiB / 4 MiB where they are whole blocks
    (or under one) and fit the raw buffer, which is sized for the run's own sizes (a run of small sizes
    only once wrote past it: NIXL_ERR_NOT_FOUND, and the world aborted)."""
    fixed = {s for s in (64 * KIB, MIB, 4 * MIB) if (s % block == 0 or s < block) and s <= raw_nbytes}
    return sorted(set(w2_sizes) | fixed)


def quiet_engines(b: Bench) -> None:
    """Before a baseline: wait, on every rank, until kvown's engines have spun down and nap
    (``--idle-sleep-s``). An idle engine still polls NIXL and takes its process's GIL at every poll; beside
    one that spun, or napped kvown's default 200 us, the raw WRITE loop of the same process ran 10-45 %
    slower than with the engine stopped (docs/benchmarks.md, issue 19 seventeenth pass). kvown's own runs
    need no such wait: each starts with an API call, which wakes its engine at once."""
    soft_barrier(b.comm, b.deadline)
    time.sleep(b.args.spin_s + QUIET_MARGIN_S)


def yardsticks(b: Bench) -> None:
    """The notification RTT and one raw WRITE of each size (post -> DONE), before any workload."""
    args, comm, rank, raw, result = b.args, b.comm, b.rank, b.raw, b.result
    quiet_engines(b)
    rtt = raw.rtt(args.rtt_iters, b.deadline)
    sizes = yard_sizes(b.w2_sizes, b.block, raw.nbytes)
    write_ns = {s: raw.write_latency(s, max(50, args.rtt_iters // 10), b.deadline) for s in sizes}
    yard = comm.bcast({"notif_rtt": pct(rtt) if rank == RX else None} if rank == RX else None, root=RX)
    writes = comm.bcast({str(s): pct(v) for s, v in write_ns.items()} if rank == 1 else None, root=1)
    result["notif_rtt"], result["raw_write"] = yard["notif_rtt"], writes


def run_w1(b: Bench) -> None:
    """W1: throughput of kvown vs B0 per size, alternating repetitions; then release -> retired."""
    args, comm, rank, rt, raw, deadline, window = b.args, b.comm, b.rank, b.rt, b.raw, b.deadline, b.args.window
    rows = []
    with progress(len(b.w1_sizes) * args.reps, "W1 happy path", b.show) as bar:
        for s in b.w1_sizes:
            nb = s // b.block
            n = int(min(1000, max(32, args.w1_bytes // s)))
            row: dict[str, Any] = {"size": s, "sessions": n, "raw_gbps": [], "raw_pub_gbps": [],
                                   "kvown_gbps": [], "kvown_threads_gbps": [], "not_completed": 0,
                                   "engine_cpu_beside_raw_us": []}
            for _ in range(args.reps):
                quiet_engines(b)
                raw.throughput(s, min(n, WARMUP), window, deadline)
                before = engine_clocks(rt)
                row["raw_gbps"].append(n * s / raw.throughput(s, n, window, deadline))
                row["raw_pub_gbps"].append(n * s / raw.throughput(s, n, window, deadline, published=True))
                beside = comm.gather(_clocks_used(before, rt)[1], root=RX)
                if rank == RX:  # the evidence for quiet_engines: what the busiest engine spent meanwhile
                    row["engine_cpu_beside_raw_us"].append(_per_session_us(beside, 2 * n))
                for key, loop in LOOPS.items():
                    loop(rt, comm, rank, b.rids.take(min(n, WARMUP)), nb, window, deadline, b.slow)
                    k = loop(rt, comm, rank, b.rids.take(n), nb, window, deadline, b.slow)
                    b.dump_if_slow()
                    row[key].append(n * s / k["ns"])  # wall clock: slow sessions included
                    row["not_completed"] += k["not_completed"]
                    row["dst_runs_per_session"] = k["dst_runs"] / n
                    _note_engine(row, key, comm.gather((*k["engine"], k["ns"]), root=RX), n)
                bar.update(1)
            if rank == RX:
                row.update(_w1_ratios(row))
            rows.append(row)
    # release -> retired, one session at a time (RL_complete), 64 KiB
    plan = [(False, 0)] * (args.w2_sessions + args.warmup)
    rl = kv_sessions(rt, comm, rank, b.rids.take(len(plan)), 64 * KIB // b.block or 1, (1,), plan, 0, False,
                     deadline, b.slow, "w1", args.warmup)
    b.dump_if_slow()
    w1: dict[str, Any] = {"throughput": rows}
    if rank == RX:
        w1["release_to_retired"] = pct(rl.get("release_to_retired_ns", []))
        w1["publish_to_landed"] = pct(rl.get("publish_to_landed_ns", []))
        rtt_us = b.result["notif_rtt"]["p50_us"]
        w1["release_to_retired_over_rtt"] = round(w1["release_to_retired"]["p50_us"] / rtt_us, 3)
    b.result["w1"] = comm.bcast(w1 if rank == RX else None, root=RX)


# W1's consumers: the headline first (row keys; ``ratio`` is the first one's)
LOOPS = {"kvown_gbps": kv_throughput_callbacks, "kvown_threads_gbps": kv_throughput_threads}


def _note_engine(row: dict[str, Any], key: str, per_rank: list[tuple[int, int | None, int]] | None,
                 n: int) -> None:
    """Rank 0: per session, each engine's work (steps that moved) and CPU (polling included) over one
    loop, and each side's busy share: its work over the loop's wall clock (near 1: the bottleneck)."""
    if per_rank is None:
        return
    out = row.setdefault("engine", {}).setdefault(key, {})
    for side, (busy_ns, cpu_ns, loop_ns) in (("writer", per_rank[1]), ("receiver", per_rank[RX])):
        out.setdefault(f"{side}_work_us", []).append(round(busy_ns / n / 1e3, 1))
        out.setdefault(f"{side}_busy", []).append(round(busy_ns / loop_ns, 3))
        if cpu_ns is not None:
            out.setdefault(f"{side}_cpu_us", []).append(round(cpu_ns / n / 1e3, 1))


def _per_session_us(cpu_ns: list[int | None], sessions: int) -> float | None:
    """The largest of the ranks' engine CPU over ``sessions``, in us (None: an engine has no thread clock)."""
    known = [c for c in cpu_ns if c is not None]
    return round(max(known) / sessions / 1e3, 2) if known and len(known) == len(cpu_ns) else None


def _w1_ratios(row: dict[str, Any]) -> dict[str, float]:
    """The headline: the median of each repetition's kvown / raw, measured back to back, so a machine whose
    load drifts between repetitions moves both sides of each ratio. The thread consumer's beside it."""
    out = {"raw_gbps_median": float(np.median(row["raw_gbps"]))}
    for key, name in (("kvown_gbps", "ratio"), ("kvown_threads_gbps", "ratio_threads")):
        out[f"{key}_median"] = float(np.median(row[key]))
        out[name] = _median_ratio(row[key], row["raw_gbps"])
    out["ratio_of_medians"] = out["kvown_gbps_median"] / out["raw_gbps_median"]
    # B0+pub: raw plus the publication alone - the most any receiver-publishes protocol could reach here
    out["raw_pub_gbps_median"] = float(np.median(row["raw_pub_gbps"]))
    out["raw_pub_over_raw"] = _median_ratio(row["raw_pub_gbps"], row["raw_gbps"])
    out["ratio_vs_raw_pub"] = _median_ratio(row["kvown_gbps"], row["raw_pub_gbps"])
    out["raw_us_per_session"] = round(row["size"] / out["raw_gbps_median"] / 1e3, 1)
    for name, values in row.get("engine", {}).get("kvown_gbps", {}).items():  # the headline consumer's
        out[f"{name}_median"] = float(np.median(values))
    return out


def _median_ratio(num: list[float], den: list[float]) -> float:
    """The median of the repetitions' own ratios (each pair measured back to back)."""
    return float(np.median([n / d for n, d in zip(num, den)]))


def run_w2(b: Bench) -> None:
    """W2: cancellation sweep per (size, rate), kvown then B0 on the same plan; then B1's timeout."""
    args, comm, rank, rng, result = b.args, b.comm, b.rank, b.rng, b.result
    rates = args.w2_rates
    points = []
    with progress(len(b.w2_sizes) * len(rates), "W2 cancellation sweep", b.show) as bar:
        for s in b.w2_sizes:
            nb = max(1, s // b.block)
            w_ns = int(result["raw_write"][str(s)]["p50_us"] * 1e3)
            settle = int(args.settle * w_ns) + 1_000_000
            for rate in rates:
                n = args.w2_sessions + args.warmup
                plan = [(rng.random() * 100 < rate, int(rng.uniform(0, w_ns))) for _ in range(n)]
                kv = kv_sessions(b.rt, comm, rank, b.rids.take(n), nb, (1,), plan, settle, True, b.deadline, b.slow,
                                 "w2", args.warmup)
                b.dump_if_slow()
                quiet_engines(b)
                b0 = b.raw.cancel_sweep(s, plan[args.warmup:], 0, settle, b.deadline)
                point: dict[str, Any] = {"size": s, "rate": rate, "sessions": n - args.warmup}
                if rank == RX:
                    point.update(_w2_point(kv, b0, result["notif_rtt"]["p50_us"], w_ns / 1e3))
                points.append(point)
                bar.update(1)
    # B1: a few cancelled sessions held for the timeout (its RL is the timeout by construction)
    b1_plan = [(True, int(rng.uniform(0, int(result["raw_write"][str(max(b.w2_sizes))]["p50_us"] * 1e3))))
               for _ in range(args.b1_sessions)]
    quiet_engines(b)
    b1 = b.raw.cancel_sweep(max(b.w2_sizes), b1_plan, int(args.b1_timeout_s * 1e9), 1_000_000, b.deadline)
    w2: dict[str, Any] = {"points": points}
    if rank == RX:
        w2["b1"] = {"timeout_s": args.b1_timeout_s, "size": max(b.w2_sizes), "sessions": len(b1_plan),
                    "cancel_to_free": pct(b1["freed_ns"]), "violations": b1["violations"]}
        cancelled = [p for p in points if p.get("kvown_cancel_to_retired", {}).get("n")]
        w2["violations_kvown"] = sum(p["kvown_violations"] for p in points)
        w2["violations_raw"] = sum(p["b0_violations"] for p in points)
        w2["retire_p50_over_bound"] = max((p["p50_over_bound"] for p in cancelled), default=None)
        w2["retire_p99_over_bound"] = max((p["p99_over_bound"] for p in cancelled), default=None)
    result["w2"] = comm.bcast(w2 if rank == RX else None, root=RX)


def run_w3(b: Bench) -> None:
    """W3: fan-in, K writers each writing head slice i of K, 20 % cancelled."""
    args, rank, result = b.args, b.rank, b.result
    rows = []
    ks = [int(k) for k in args.w3_writers.split(",")] if args.w3_writers else list(range(1, len(b.writers) + 1))
    with progress(len(ks), "W3 fan-in", b.show) as bar:
        for k in ks:
            n = args.w3_sessions + args.warmup
            w_ns = int(result["raw_write"][str(min(int(k) for k in result["raw_write"]))]["p50_us"] * 1e3)
            rate = args.w3_rates[0]
            plan = [(b.rng.random() * 100 < rate, int(b.rng.uniform(0, w_ns))) for _ in range(n)]
            t0 = time.perf_counter_ns()
            kv = kv_sessions(b.rt, b.comm, rank, b.rids.take(n), args.w3_blocks, b.writers[:k], plan, 0, False,
                             b.deadline, b.slow, "w3")
            b.dump_if_slow()
            wall = time.perf_counter_ns() - t0
            if rank == RX:
                row = {"writers": k, "sessions": n, "blocks": args.w3_blocks,
                       "session_nbytes": args.w3_blocks * b.block,
                       "cancel_to_retired": pct(kv.get("cancel_to_retired_ns", [])),
                       "release_to_retired": pct(kv.get("release_to_retired_ns", [])),
                       "sessions_per_s": round(n / (wall / 1e9), 1), "outcomes": kv["outcomes"],
                       "slow_sessions": kv["slow_sessions"]}
                rows.append(row)
            bar.update(1)
    result["w3"] = b.comm.bcast({"points": rows} if rank == RX else None, root=RX)


def finish(b: Bench) -> None:
    """Gather statistics and slow sessions, close both agents, and let rank 0 report."""
    comm, rank, result = b.comm, b.rank, b.result
    slow_waits = comm.gather(b.slow.waits, root=RX)
    stats = comm.gather(b.rt.statistics().to_dict(), root=RX)
    env = environment(b.args.seed) if rank == RX else None
    soft_barrier(comm, b.deadline)
    b.raw.close()
    b.rt.close()
    if rank == RX:
        result["slow_sessions"] = b.slow.report(slow_waits[1:])
        result["engine_statistics"] = stats
        result["environment"] = env
        result["wall_s"] = round(time.monotonic() - b.t_start, 1)
        emit(result, b.args, report, plot)


def _w2_point(kv: dict[str, Any], b0: dict[str, Any], rtt_us: float, write_us: float) -> dict[str, Any]:
    """One W2 point; ``kv``'s latency lists already leave out the warm-up and the slow sessions."""
    cancel_ns = kv.get("cancel_to_retired_ns", [])
    bound50, bound99 = 3 * rtt_us + write_us, 10 * rtt_us + write_us
    out: dict[str, Any] = {
        "kvown_cancel_to_retired": pct(cancel_ns),
        "kvown_release_to_retired": pct(kv.get("release_to_retired_ns", [])),
        "slow_sessions": kv.get("slow_sessions", 0),
        "kvown_violations": kv.get("violations", 0), "kvown_outcomes": kv.get("outcomes", {}),
        "b0_violations": b0["violations"], "b0_cancel_to_free": pct(b0["freed_ns"]),
        "bound_p50_us": round(bound50, 1), "bound_p99_us": round(bound99, 1),
        "samples_us": [round(x / 1e3, 1) for x in cancel_ns],
    }
    if cancel_ns:
        s = out["kvown_cancel_to_retired"]
        out["p50_over_bound"] = round(s["p50_us"] / bound50, 3)
        out["p99_over_bound"] = round(s["p99_us"] / bound99, 3)
    return out


def _parse_size(text: str) -> int:
    t = text.strip().upper()
    mult = {"K": KIB, "M": MIB}.get(t[-1], 1)
    return int(t[:-1] if t[-1] in "KM" else t) * mult


def report(r: dict[str, Any]) -> None:
    e = r["environment"]
    print(f"world ranks={r['ranks']}  python {e['python']} (libpython {e.get('libpython', '?')})  "
          f"nixl {e['nixl']}  ucx {e['ucx']}  cpus={e['cpus']}  "
          f"load={e['loadavg'][0]}  block={r['block_nbytes'] // KIB} KiB  wall={r['wall_s']} s")
    hp = r.get("huge_pages", {})
    print(f"memory: {'2 MiB huge pages' if hp.get('advised') else '4 KiB pages'} on both sides "
          f"(THP {hp.get('thp_mode', '?')}{'' if hp.get('asked', True) else ', --no-huge-pages'})")
    n = r["notif_rtt"]
    print(f"yardsticks: notification RTT p50 {n['p50_us']} us (p99 {n['p99_us']}); raw WRITE p50 "
          + ", ".join(f"{size_name(int(s))} {v['p50_us']} us" for s, v in r["raw_write"].items()))
    if "w1" in r:
        print("W1 happy path (window %d): session  raw GB/s  kvown GB/s  ratio  | consumer threads: GB/s  ratio"
              % r["window"])
        for row in r["w1"]["throughput"]:
            print(f"  {size_name(row['size']):>8} {row['raw_gbps_median']:9.2f} {row['kvown_gbps_median']:10.2f} "
                  f"{row['ratio']:6.2f}  | {row['kvown_threads_gbps_median']:22.2f} {row['ratio_threads']:6.2f}")
            if "writer_work_us_median" in row:  # each engine's work per session, and its share of the loop
                w, rx = (f"{row[f'{s}_work_us_median']:.0f} us ({100 * row[f'{s}_busy_median']:.0f} % busy)"
                         for s in ("writer", "receiver"))
                print(f"  {'':>8} engine work / session: writer {w}, receiver {rx}; "
                      f"raw session {row['raw_us_per_session']:.0f} us")
            if "raw_pub_gbps_median" in row:  # the publication's own price, and kvown's beyond it
                print(f"  {'':>8} B0+pub (raw + one publication per session) "
                      f"{row['raw_pub_gbps_median']:.2f} GB/s = {row['raw_pub_over_raw']:.2f} x raw; "
                      f"kvown / B0+pub {row['ratio_vs_raw_pub']:.2f}")
            beside = [v for v in row.get("engine_cpu_beside_raw_us", []) if v is not None]
            if beside:  # quiet_engines at work: near 0 when the idle engines kept out of B0's way
                print(f"  {'':>8} kvown engines beside B0: at most {max(beside):.2f} us CPU per raw session")
        rl = r["w1"]["release_to_retired"]
        print(f"  release -> retired p50 {rl['p50_us']} us = {r['w1']['release_to_retired_over_rtt']} x RTT; "
              f"1 block publish -> landed p50 {r['w1'].get('publish_to_landed', {}).get('p50_us')} us")
    if "w2" in r:
        print("W2 cancel sweep: size rate  kvown cancel->retired p50/p99 us  bound p50/p99  viol kvown/B0")
        for p in r["w2"]["points"]:
            c = p["kvown_cancel_to_retired"]
            if c.get("n"):
                print(f"  {size_name(p['size']):>7} {p['rate']:3d}%  {c['p50_us']:8.1f} / {c['p99_us']:8.1f}   "
                      f"{p['bound_p50_us']:7.1f} / {p['bound_p99_us']:7.1f}   {p['kvown_violations']} / {p['b0_violations']}")
            else:
                print(f"  {size_name(p['size']):>7} {p['rate']:3d}%  (no cancels)   viol {p['kvown_violations']} / "
                      f"{p['b0_violations']}")
        b1 = r["w2"]["b1"]
        print(f"  B1 (timeout {b1['timeout_s']} s): cancel -> free p50 {b1['cancel_to_free'].get('p50_us')} us, "
              f"violations {b1['violations']}")
        print(f"  worst p50/bound {r['w2']['retire_p50_over_bound']}, p99/bound {r['w2']['retire_p99_over_bound']}; "
              f"violations kvown {r['w2']['violations_kvown']}, B0 {r['w2']['violations_raw']}")
    slow = r.get("slow_sessions") or {}
    if slow.get("count"):
        print(f"slow sessions (a wait > {slow['slow_s']} s; left out of the percentiles): {slow['count']}: "
              + ", ".join(f"{s['workload']} {s['request_id']:#x} {s['waited_for']} {s['waited_s']} s"
                          for s in slow["waits"][:8]))
    if "w3" in r:
        print("W3 fan-in: K  cancel->retired p50/p99 us  release->retired p50  sessions/s")
        for p in r["w3"]["points"]:
            c, rel = p["cancel_to_retired"], p["release_to_retired"]
            print(f"  {p['writers']}  {c.get('p50_us', '-')} / {c.get('p99_us', '-')}   {rel.get('p50_us', '-')}   "
                  f"{p['sessions_per_s']}")


def plot(r: dict[str, Any], path: Path) -> None:
    panels = [k for k in ("w1", "w2", "w3") if k in r]
    fig, axes = plot_figure(path, max(1, len(panels)), f"kvown bench world ({r['environment']['date']})")
    i = 0
    if "w1" in r:
        w1_bars(axes[i], r["w1"]["throughput"])
        axes[i].set_title("W1 throughput ratio")
        i += 1
    if "w2" in r:
        ax = axes[i]
        for p in r["w2"]["points"]:
            if p.get("samples_us"):
                cdf(ax, p["samples_us"], f"{size_name(p['size'])} {p['rate']}%")
        ax.axvline(r["notif_rtt"]["p50_us"], color="grey", ls="--", lw=1, label="notif RTT p50")
        ax.set_xscale("log")
        ax.set_xlabel("cancel -> retired (us)")
        ax.set_ylabel("CDF")
        ax.set_title("W2 cancellation (kvown)")
        ax.legend(fontsize=6)
        i += 1
    if "w3" in r:
        ax, pts = axes[i], r["w3"]["points"]
        ax.plot([p["writers"] for p in pts], [p["cancel_to_retired"].get("p50_us", 0) for p in pts], "o-",
                label="cancel -> retired p50")
        ax.plot([p["writers"] for p in pts], [p["release_to_retired"].get("p50_us", 0) for p in pts], "s-",
                label="release -> retired p50")
        ax.set_xlabel("writers K")
        ax.set_ylabel("us")
        ax.set_title("W3 fan-in")
        ax.legend(fontsize=7)
    save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
