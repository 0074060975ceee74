"""Transfer benchmark: kvown's full ownership path against raw NIXL WRITEs, and retirement latency.

Run under ``mpirun -n 2``: rank 0 is the context (sender) rank, rank 1 the generation (receiver) rank.
One run, a fixed seed, the same buffers for every point. Three parts (perf.md sections 4 and 5):

  (a) throughput, W1-style: sessions of 64 KiB .. 16 MiB (contiguous 64 KiB blocks), back to back with
      ``--window`` sessions in flight. kvown = receive -> send -> landed -> release -> retired, timed on
      the receiver from the start barrier to the last retirement. raw (B0) = NIXL WRITE + notification
      of the same bytes between a second pair of NixlEndpoints and pools that this benchmark creates
      in the same processes (the engine thread owns the runtime's endpoint), with the same window,
      timed on the receiver to the last notification. Repetitions alternate raw / kvown.
  (b) RL_cancel: the sender opens a session of size S first (context-first, so its WRITE is posted
      as soon as the publication arrives), the receiver publishes and cancels at once ("immediate")
      or after a seeded delay in [0, one WRITE of S] ("mid"), and waits for retirement. Latency =
      ``handle.retired_ns`` - the monotonic time taken just before ``cancel()`` (the decision); the
      engine-stamped ``retired_ns - cancelled_ns`` is reported too. In the same run: the NIXL
      notification ping-pong RTT and one raw WRITE of S (post -> DONE), and the bounds
      p50 <= 3 RTT + WRITE(S), p99 <= 10 RTT + WRITE(S) (RTT and WRITE at their p50).
  (c) RL_complete: one session at a time; latency = ``retired_ns`` - time just before ``release()``.

Every wait is bounded (``--deadline-s`` for the whole run, 10 s per event). Output: a table on stdout
(rank 0), ``--json PATH``, ``--plot PATH`` (PNG: kvown/raw ratio bars + latency CDFs).

Usage:
  PYTHONPATH=. mpirun --oversubscribe -n 2 python benchmarks/bench_transfer.py --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np  # noqa: E402

KIB, MIB = 1024, 1 << 20
THROUGHPUT_SIZES = (64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB)
LATENCY_SIZES = (64 * KIB, 1 * MIB, 4 * MIB)
EVENT_WAIT_S = 10.0
SENDER, RECEIVER = 0, 1
TAG_OPENED = 11


class BenchError(RuntimeError):
    pass


# ----------------------------------------------------------------------------- small helpers


def pct(values_ns: list[int] | np.ndarray) -> dict[str, float]:
    us = np.asarray(values_ns, dtype=np.float64) / 1e3
    if us.size == 0:
        return {"n": 0}
    q = np.percentile(us, [50, 90, 99, 99.9])
    return {"n": int(us.size), "p50_us": round(float(q[0]), 1), "p90_us": round(float(q[1]), 1),
            "p99_us": round(float(q[2]), 1), "p999_us": round(float(q[3]), 1),
            "max_us": round(float(us.max()), 1), "mean_us": round(float(us.mean()), 1)}


def soft_barrier(comm: Any, deadline: float) -> None:
    """A barrier that sleeps instead of spinning (Open MPI's blocking Barrier burns a core, and this
    machine has two: a spinning rank would steal CPU from the other rank's engine thread)."""
    req = comm.Ibarrier()
    while not req.Test():
        if time.monotonic() > deadline:
            raise BenchError("barrier past the run deadline")
        time.sleep(1e-4)


def soft_recv(comm: Any, source: int, tag: int, deadline: float) -> Any:
    req = comm.irecv(source=source, tag=tag)
    while True:
        done, value = req.test()
        if done:
            return value
        if time.monotonic() > deadline:
            raise BenchError("receive past the run deadline")
        time.sleep(2e-5)


def wait_event(ev: Any, what: str) -> None:
    if not ev.wait(EVENT_WAIT_S):
        raise BenchError(f"{what} did not happen within {EVENT_WAIT_S} s")


def spin_until_ns(t_ns: int) -> None:
    """Wait until ``t_ns`` without holding the GIL for a whole switch interval (sched_yield drops it)."""
    while time.monotonic_ns() < t_ns:
        os.sched_yield()


class Rids:
    """Request ids, identical on both ranks because both draw them in the same order; never reused."""

    def __init__(self) -> None:
        self.seq = 0

    def take(self, n: int) -> list[int]:
        from kvown import make_request_id

        out = [make_request_id(1, self.seq + i) for i in range(n)]
        self.seq += n
        return out


def runs_of(blocks: tuple[int, ...]) -> int:
    """Number of contiguous ascending runs (one NIXL descriptor each after coalescing)."""
    return 1 + sum(1 for a, b in zip(blocks, blocks[1:]) if b != a + 1) if blocks else 0


# ----------------------------------------------------------------------------- raw NIXL (B0)


class Raw:
    """A second NixlEndpoint + pool per rank, owned by the main thread, for the no-protocol baseline."""

    def __init__(self, comm: Any, rank: int, nbytes: int, tag: str) -> None:
        import torch

        from kvown.adapters.nixl import MemKind, NixlEndpoint

        self.MemKind = MemKind
        self.comm, self.rank = comm, rank
        self.buf = torch.full((nbytes,), rank + 1, dtype=torch.uint8)
        self.ep = NixlEndpoint(f"bench-raw-{tag}-r{rank}")
        self.ep.register_tensor(self.buf)
        info = comm.allgather((self.ep.metadata(), self.buf.data_ptr()))
        other = 1 - rank
        self.peer = self.ep.add_peer(info[other][0])
        self.remote_addr = int(info[other][1])
        self.addr = self.buf.data_ptr()

    def post(self, src_off: int, dst_off: int, nbytes: int, notif: bytes | None) -> Any:
        return self.ep.post_write(self.peer, [(self.addr + src_off, nbytes)], [(self.remote_addr + dst_off, nbytes)],
                                  self.MemKind.DRAM, notif=notif)

    def wait_done(self, handle: Any, deadline: float) -> None:
        from kvown.adapters.nixl import XferStatus

        while True:
            status = self.ep.poll(handle)
            if status is XferStatus.DONE:
                self.ep.release(handle)
                return
            if status is XferStatus.ERROR or time.monotonic() > deadline:
                raise BenchError(f"raw WRITE ended {status}: {handle.error}")
            os.sched_yield()

    def drain_until(self, want: int, deadline: float, prefix: bytes = b"") -> int:
        """Receiver: drain notifications until ``want`` of them (with ``prefix``) arrived."""
        got = 0
        while got < want:
            msgs = self.ep.drain_notifs()
            for _, msg in msgs:
                if msg.startswith(prefix):
                    got += 1
            if not msgs:
                os.sched_yield()
            if time.monotonic() > deadline:
                raise BenchError(f"raw: {got}/{want} notifications before the deadline")
        return got

    # -- the phases; both ranks call each one, in the same order

    def rtt(self, iters: int, deadline: float) -> list[int]:
        soft_barrier(self.comm, deadline)
        out = []
        if self.rank == SENDER:
            for i in range(iters + 100):
                t0 = time.perf_counter_ns()
                self.ep.send_notif(self.peer, b"p%d" % i)
                want, ok = b"a%d" % i, False
                while not ok:
                    msgs = self.ep.drain_notifs()
                    ok = any(m == want for _, m in msgs)
                    if not msgs:
                        os.sched_yield()
                    if time.monotonic() > deadline:
                        raise BenchError("notification ping-pong past the deadline")
                if i >= 100:
                    out.append(time.perf_counter_ns() - t0)
        else:
            seen = 0
            while seen < iters + 100:
                msgs = self.ep.drain_notifs()
                for _, msg in msgs:
                    if msg[:1] == b"p":
                        self.ep.send_notif(self.peer, b"a" + msg[1:])
                        seen += 1
                if not msgs:
                    os.sched_yield()
                if time.monotonic() > deadline:
                    raise BenchError("notification echo past the deadline")
        return out

    def write_latency(self, size: int, iters: int, deadline: float) -> list[int]:
        """One WRITE of ``size`` bytes, post -> DONE, one at a time; the receiver keeps progressing."""
        soft_barrier(self.comm, deadline)
        out = []
        if self.rank == SENDER:
            for i in range(iters + 20):
                t0 = time.perf_counter_ns()
                h = self.post(0, 0, size, None)
                self.wait_done(h, deadline)
                if i >= 20:
                    out.append(time.perf_counter_ns() - t0)
            self.ep.send_notif(self.peer, b"end")
        else:
            self.drain_until(1, deadline, b"end")
        return out

    def throughput(self, size: int, n: int, window: int, deadline: float) -> dict[str, Any]:
        """``n`` WRITEs of ``size`` with a notification each, ``window`` in flight, slots reused in turn."""
        soft_barrier(self.comm, deadline)
        t0 = time.perf_counter_ns()
        if self.rank == SENDER:
            live: collections.deque = collections.deque()
            for i in range(n):
                if len(live) == window:
                    self.wait_done(live.popleft(), deadline)
                slot = (i % window) * size
                live.append(self.post(slot, slot, size, b"w%d" % i))
            while live:
                self.wait_done(live.popleft(), deadline)
        else:
            self.drain_until(n, deadline, b"w")
        return {"ns": time.perf_counter_ns() - t0}

    def close(self) -> None:
        self.ep.close()


# ----------------------------------------------------------------------------- kvown phases


def kv_throughput(rt: Any, comm: Any, rank: int, rids: list[int], nb: int, window: int, deadline: float
                  ) -> dict[str, Any]:
    """Sessions of ``nb`` blocks back to back, ``window`` in flight on each side."""
    from kvown import Outcome

    soft_barrier(comm, deadline)
    t0 = time.perf_counter_ns()
    bad, descs = 0, 0
    if rank == SENDER:
        sender, live = rt.sender, collections.deque()
        for i, rid in enumerate(rids):
            if len(live) == window:
                h = live.popleft()
                wait_event(h.released, "sender released")
                bad += h.outcome.result(1) is not Outcome.COMPLETED
            slot = i % window
            live.append(sender.send(rid, range(slot * nb, (slot + 1) * nb)))
        while live:
            h = live.popleft()
            wait_event(h.released, "sender released")
            bad += h.outcome.result(1) is not Outcome.COMPLETED
    else:
        receiver = rt.receiver
        todo = collections.deque(rids)
        live: collections.deque = collections.deque()  # published, not yet released
        rel: collections.deque = collections.deque()  # released, not yet retired
        done = 0
        while done < len(rids):
            while todo and len(live) + len(rel) < window:
                h = receiver.receive(todo.popleft(), nb, writers=(SENDER,))
                descs += runs_of(h.blocks)
                live.append(h)
            if live:
                h = live.popleft()
                wait_event(h.landed, "landed")
                receiver.release(h.request_id)
                rel.append(h)
            while rel and rel[0].retired.is_set():
                h = rel.popleft()
                bad += h.outcome.result(1) is not Outcome.COMPLETED
                done += 1
            if rel and not live and (not todo or len(rel) >= window):  # nothing else to do: block
                h = rel.popleft()
                wait_event(h.retired, "retired")
                bad += h.outcome.result(1) is not Outcome.COMPLETED
                done += 1
            if time.monotonic() > deadline:
                raise BenchError("kvown throughput past the run deadline")
    return {"ns": time.perf_counter_ns() - t0, "not_completed": bad, "dst_runs": descs}


def kv_latency(rt: Any, comm: Any, rank: int, rids: list[int], nb: int, mode: str, delays_ns: list[int],
               deadline: float) -> dict[str, Any]:
    """One session at a time. mode: "complete" (release after landing), "immediate" / "mid" (cancel)."""

    soft_barrier(comm, deadline)
    if rank == SENDER:
        sender, engine = rt.sender, rt.engine
        posted, outcomes = [], collections.Counter()
        for i, rid in enumerate(rids):
            before = engine.driver.stats["bytes_written"]
            h = sender.send(rid, range(nb))
            req = comm.isend(i, dest=RECEIVER, tag=TAG_OPENED)  # context-first: opened before publication
            wait_event(h.released, "sender released")
            outcomes[h.outcome.result(1).value] += 1
            posted.append(engine.driver.stats["bytes_written"] - before)  # engine counter: read-only peek
            req.wait()
            if time.monotonic() > deadline:
                raise BenchError("latency phase past the run deadline")
        return {"bytes_posted": posted, "sender_outcomes": dict(outcomes)}
    receiver = rt.receiver
    lat, eng, landed_lat, open_to_land, outcomes = [], [], [], [], collections.Counter()
    for i, rid in enumerate(rids):
        if soft_recv(comm, SENDER, TAG_OPENED, deadline) != i:
            raise BenchError("sender and receiver out of step")
        h = receiver.receive(rid, nb, writers=(SENDER,))
        if mode == "complete":
            wait_event(h.landed, "landed")
            t_decide = time.monotonic_ns()
            receiver.release(rid)
        else:
            if mode == "mid":
                spin_until_ns(time.monotonic_ns() + delays_ns[i])
            t_decide = time.monotonic_ns()
            receiver.cancel(rid)
        wait_event(h.retired, "retired")
        outcomes[h.outcome.result(1).value] += 1
        lat.append(h.retired_ns - t_decide)
        eng.append(h.retired_ns - (h.released_ns if mode == "complete" else h.cancelled_ns))
        if h.landed_ns:
            open_to_land.append(h.landed_ns - h.opened_ns)
            landed_lat.append(h.retired_ns - h.landed_ns)
    return {"decide_to_retired_ns": lat, "engine_stamp_to_retired_ns": eng, "landed_to_retired_ns": landed_lat,
            "opened_to_landed_ns": open_to_land, "receiver_outcomes": dict(outcomes)}


# ----------------------------------------------------------------------------- environment


def ucx_version() -> str:
    import ctypes
    import glob

    import nixl

    mod = sys.modules.get(getattr(nixl, "__name__", "nixl"))
    roots = {os.path.dirname(os.path.dirname(p)) for p in (getattr(mod, "__file__", "") or "",) if p}
    for root in roots | {os.path.dirname(os.path.dirname(np.__file__))}:
        for lib in glob.glob(os.path.join(root, "nixl_cu*.libs", "libucp*.so*")):
            try:
                fn = ctypes.CDLL(lib).ucp_get_version_string
                fn.restype = ctypes.c_char_p
                return fn().decode()
            except OSError:
                continue
    return "unknown"


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    def ver(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "-"

    from mpi4py import MPI

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "torch": torch.__version__, "nixl": ver("nixl"),
        "ucx": ucx_version(), "mpi4py": ver("mpi4py"), "mpi": MPI.Get_library_version().splitlines()[0].strip(),
        "cpus": os.cpu_count(), "loadavg": list(os.getloadavg()), "machine": platform.machine(),
        "switchinterval_s": sys.getswitchinterval(),
        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "nixl_progress_thread": False, "memory": "DRAM (CPU)", "seed": args.seed,
    }


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--window", type=int, default=4, help="sessions in flight in the throughput part")
    ap.add_argument("--reps", type=int, default=3, help="alternating raw/kvown repetitions per size")
    ap.add_argument("--tput-bytes", type=int, default=128 * MIB, help="bytes per repetition (sessions clamped)")
    ap.add_argument("--lat-iters", type=int, default=500, help="samples per latency point (+ warm-up)")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--rtt-iters", type=int, default=2000)
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval value (default: leave Python's 5 ms)")
    ap.add_argument("--idle-sleep-s", type=float, default=None,
                    help="TransferConfig.idle_sleep_s (engine back-off when idle; default: kvown's)")
    ap.add_argument("--deadline-s", type=float, default=85.0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="few samples (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.tput_bytes, args.lat_iters, args.warmup, args.rtt_iters = 1, 32 * MIB, 60, 10, 200
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)

    from mpi4py import MPI

    from kvown import KVLayout, TransferConfig, connect_mpi

    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        print("bench_transfer: run with mpirun -n 2", file=sys.stderr)
        return 2
    rank = comm.Get_rank()
    t_start = time.monotonic()
    deadline = t_start + args.deadline_s
    rng = random.Random(args.seed)
    window = args.window
    num_blocks = max(16 * MIB // (64 * KIB) * window, 4 * MIB // (64 * KIB))
    layout = KVLayout.standard(num_layers=4, num_blocks=num_blocks, tokens_per_block=16, num_kv_heads=2,
                               head_dim=128, dtype="bfloat16")
    block = layout.block_nbytes
    assert block == 64 * KIB, block
    config = TransferConfig(transfer_timeout_s=5.0) if args.idle_sleep_s is None else \
        TransferConfig(transfer_timeout_s=5.0, idle_sleep_s=args.idle_sleep_s)
    result_idle = config.idle_sleep_s
    rt = connect_mpi(comm, layout=layout, config=config,
                     roles={"sender"} if rank == SENDER else {"receiver"})
    tag = comm.bcast(f"{os.getpid():x}" if rank == 0 else None, root=0)
    raw = Raw(comm, rank, layout.pool_nbytes, tag)
    if rank == SENDER:  # fixed, seeded source bytes in the kvown pool (the raw pool holds a constant)
        g = np.random.default_rng(args.seed)
        rt.engine.pool.tensor.numpy()[:] = g.integers(0, 256, size=layout.pool_nbytes, dtype=np.uint8)
    rids = Rids()
    result: dict[str, Any] = {"benchmark": "bench_transfer", "args": {k: str(v) for k, v in vars(args).items()},
                              "block_nbytes": block, "window": window,
                              "engine_idle_sleep_s": result_idle}

    # ---- control RTT and raw WRITE latency (the yardsticks of part b)
    rtt = raw.rtt(args.rtt_iters, deadline)
    write_lat = {}
    for size in LATENCY_SIZES:
        write_lat[size] = raw.write_latency(size, max(100, args.lat_iters // 2), deadline)
    if rank == SENDER:
        result["notif_rtt"] = pct(rtt)
        result["raw_write"] = {str(s): pct(v) for s, v in write_lat.items()}
    result["raw_write"] = comm.bcast(result.get("raw_write"), root=SENDER)
    result["notif_rtt"] = comm.bcast(result.get("notif_rtt"), root=SENDER)

    # ---- (a) throughput
    tput = []
    for size in THROUGHPUT_SIZES:
        nb = size // block
        n = int(min(1000, max(64, args.tput_bytes // size)))
        row: dict[str, Any] = {"size": size, "sessions": n, "raw_gbps": [], "kvown_gbps": [], "not_completed": 0}
        kv_throughput(rt, comm, rank, rids.take(min(n, 32)), nb, window, deadline)  # warm-up
        for _ in range(args.reps):
            r = raw.throughput(size, n, window, deadline)
            row["raw_gbps"].append(n * size / r["ns"])
            k = kv_throughput(rt, comm, rank, rids.take(n), nb, window, deadline)
            row["kvown_gbps"].append(n * size / k["ns"])
            row["not_completed"] += k["not_completed"]
            row["dst_runs_per_session"] = k["dst_runs"] / n if rank == RECEIVER else None
        tput.append(row)
    if rank == RECEIVER:  # receiver-side timings are the reported ones
        for row in tput:
            row["raw_gbps_median"] = float(np.median(row["raw_gbps"]))
            row["kvown_gbps_median"] = float(np.median(row["kvown_gbps"]))
            row["ratio"] = row["kvown_gbps_median"] / row["raw_gbps_median"]
            row["ratio_best"] = max(row["kvown_gbps"]) / max(row["raw_gbps"])
    result["throughput"] = comm.bcast(tput if rank == RECEIVER else None, root=RECEIVER)

    # ---- (b) cancel -> retired, (c) release -> retired
    lat: dict[str, Any] = {}
    for size in LATENCY_SIZES:
        nb = size // block
        w50 = write_lat.get(size)
        w50 = comm.bcast(int(np.median(w50)) if rank == SENDER else None, root=SENDER)
        n = args.lat_iters + args.warmup
        for mode in ("complete", "immediate", "mid"):
            delays = [int(rng.uniform(0, w50)) for _ in range(n)] if mode == "mid" else []
            r = kv_latency(rt, comm, rank, rids.take(n), nb, mode, delays, deadline)
            gathered = comm.gather(r, root=RECEIVER)
            if rank == RECEIVER:
                rx, tx = gathered[RECEIVER], gathered[SENDER]
                w = args.warmup
                posted = np.asarray(tx["bytes_posted"][w:])
                lat[f"{mode}/{size}"] = {
                    "mode": mode, "size": size,
                    "decide_to_retired": pct(rx["decide_to_retired_ns"][w:]),
                    "engine_stamp_to_retired": pct(rx["engine_stamp_to_retired_ns"][w:]),
                    "landed_to_retired": pct(rx["landed_to_retired_ns"][w:]) if mode == "complete" else None,
                    "opened_to_landed": pct(rx["opened_to_landed_ns"][w:]) if mode == "complete" else None,
                    "write_posted_fraction": float((posted > 0).mean()) if posted.size else 0.0,
                    "receiver_outcomes": rx["receiver_outcomes"], "sender_outcomes": tx["sender_outcomes"],
                    "samples_us": [round(x / 1e3, 2) for x in rx["decide_to_retired_ns"][w:]],
                }
    result["latency"] = comm.bcast(lat if rank == RECEIVER else None, root=RECEIVER)

    # ---- one tiny kvown round (1 block, publish -> landed): the protocol's own round trip
    tiny = kv_latency(rt, comm, rank, rids.take(args.warmup + 300), 1, "complete", [], deadline)
    if rank == RECEIVER:
        result["kvown_tiny_round"] = {"opened_to_landed": pct(tiny["opened_to_landed_ns"][args.warmup:]),
                                      "release_to_retired": pct(tiny["decide_to_retired_ns"][args.warmup:])}
    result["kvown_tiny_round"] = comm.bcast(result.get("kvown_tiny_round"), root=RECEIVER)

    stats = comm.gather(rt.engine.statistics(), root=RECEIVER)
    env = comm.gather(environment(args), root=RECEIVER)
    soft_barrier(comm, deadline)
    raw.close()
    rt.close()
    if rank == RECEIVER:
        result["engine_statistics"] = stats
        result["environment"] = env[RECEIVER]
        result["wall_s"] = round(time.monotonic() - t_start, 1)
        bounds(result)
        report(result)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        if args.plot:
            plot(result, args.plot)
    return 0


def bounds(r: dict[str, Any]) -> None:
    rtt = r["notif_rtt"]["p50_us"]
    for key, row in r["latency"].items():
        if row["mode"] == "complete":
            continue
        w = r["raw_write"][str(row["size"])]["p50_us"]
        p50, p99 = row["decide_to_retired"]["p50_us"], row["decide_to_retired"]["p99_us"]
        row["bound_p50_us"] = round(3 * rtt + w, 1)
        row["bound_p99_us"] = round(10 * rtt + w, 1)
        row["p50_ok"] = p50 <= row["bound_p50_us"]
        row["p99_ok"] = p99 <= row["bound_p99_us"]


def report(r: dict[str, Any]) -> None:
    e = r["environment"]
    print(f"bench_transfer  python {e['python']}  torch {e['torch']}  nixl {e['nixl']}  ucx {e['ucx']}  "
          f"{e['mpi']}  cpus={e['cpus']}  load={e['loadavg'][0]:.1f}  switchinterval={e['switchinterval_s']}  "
          f"engine idle_sleep_s={r['engine_idle_sleep_s']}")
    print(f"window={r['window']} sessions in flight, block={r['block_nbytes'] // KIB} KiB, wall={r['wall_s']} s")
    print("\n(a) throughput, receiver clock, median of repetitions (GB/s = 1e9 B/s)")
    print(f"  {'session':>8} {'n':>5} {'raw GB/s':>9} {'kvown GB/s':>11} {'ratio':>6} {'best/best':>9}  runs/session")
    for row in r["throughput"]:
        print(f"  {_size(row['size']):>8} {row['sessions']:>5} {row['raw_gbps_median']:9.2f} "
              f"{row['kvown_gbps_median']:11.2f} {row['ratio']:6.2f} {row['ratio_best']:9.2f}  "
              f"{row['dst_runs_per_session']:.2f}" + ("" if not row["not_completed"] else f"  NOT COMPLETED {row['not_completed']}"))
    n = r["notif_rtt"]
    print(f"\nyardsticks: NIXL notif RTT p50={n['p50_us']} us p99={n['p99_us']} us (n={n['n']});  raw WRITE post->DONE: "
          + ", ".join(f"{_size(int(s))} p50={v['p50_us']} p99={v['p99_us']} us" for s, v in r["raw_write"].items()))
    t = r["kvown_tiny_round"]
    print(f"kvown 1-block round: publish->landed p50={t['opened_to_landed']['p50_us']} us "
          f"p99={t['opened_to_landed']['p99_us']} us; release->retired p50={t['release_to_retired']['p50_us']} us")
    print("\n(b)/(c) retirement latency, decision (cancel()/release() call) -> retired_ns, receiver clock, us")
    print(f"  {'mode':>9} {'size':>7} {'n':>5} {'p50':>8} {'p90':>8} {'p99':>8} {'max':>9} {'eng p50':>8} "
          f"{'posted':>6} {'bound50':>8} {'bound99':>8}  ok")
    for row in r["latency"].values():
        d, eng = row["decide_to_retired"], row["engine_stamp_to_retired"]
        ok = "" if row["mode"] == "complete" else f"{'Y' if row['p50_ok'] else 'N'}/{'Y' if row['p99_ok'] else 'N'}"
        print(f"  {row['mode']:>9} {_size(row['size']):>7} {d['n']:>5} {d['p50_us']:8.1f} {d['p90_us']:8.1f} "
              f"{d['p99_us']:8.1f} {d['max_us']:9.1f} {eng['p50_us']:8.1f} {row['write_posted_fraction']:6.2f} "
              f"{row.get('bound_p50_us', ''):>8} {row.get('bound_p99_us', ''):>8}  {ok}")
    for row in r["latency"].values():
        if row["mode"] == "complete":
            print(f"  complete {_size(row['size'])}: publish->landed p50={row['opened_to_landed']['p50_us']} us, "
                  f"landed->retired p50={row['landed_to_retired']['p50_us']} us; outcomes {row['receiver_outcomes']}")
        else:
            print(f"  {row['mode']} {_size(row['size'])}: receiver outcomes {row['receiver_outcomes']}, "
                  f"sender outcomes {row['sender_outcomes']}")


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = r["throughput"]
    x = np.arange(len(rows))
    a1.bar(x, [row["ratio"] for row in rows], color="tab:blue")
    a1.axhline(0.95, color="tab:red", ls="--", lw=1, label="target 0.95")
    a1.set_xticks(x, [_size(row["size"]) for row in rows])
    a1.set_ylabel("kvown GB/s / raw NIXL GB/s")
    a1.set_title(f"throughput ratio (window {r['window']}, receiver clock)")
    for i, row in enumerate(rows):
        a1.text(i, row["ratio"] + 0.01, f"{row['kvown_gbps_median']:.1f}/{row['raw_gbps_median']:.1f}",
                ha="center", fontsize=8)
    a1.legend(loc="lower right")
    for row in r["latency"].values():
        us = np.sort(np.asarray(row["samples_us"]))
        if us.size:
            a2.plot(us, np.arange(1, us.size + 1) / us.size, label=f"{row['mode']} {_size(row['size'])}",
                    ls="-" if row["mode"] != "complete" else ":")
    a2.axvline(r["notif_rtt"]["p50_us"], color="grey", lw=1, ls="--", label="notif RTT p50")
    a2.set_xscale("log")
    a2.set_xlabel("decision -> retired (us)")
    a2.set_ylabel("CDF")
    a2.set_title("retirement latency (cancel / release)")
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
