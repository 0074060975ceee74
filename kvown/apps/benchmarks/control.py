"""Control-plane and data-plane micro-benchmark: what one ack and one WRITE cost on this host.

Measures, with fixed iteration counts, between two spawned processes on 127.0.0.1:
  * NIXL notification ping-pong RTT (kvown's ``NixlEndpoint.send_notif`` / ``drain_notifs``);
  * ZeroMQ DEALER/ROUTER RTT over tcp://127.0.0.1 with a msgpack ack (encode + decode both ends);
  * NIXL WRITE post -> DONE for 4 KiB / 64 KiB / 1 MiB: one descriptor, the same bytes as 4 KiB
    ranges that kvown coalesces (contiguous), as 4 KiB ranges that cannot be coalesced (scattered),
    and through the prepped path (contiguous and scattered indices);
  * the largest notification payload that arrives intact (up to 16 MiB);
  * the notification RTT again with ``UCX_MM_ERROR_HANDLING=y`` (UCX shared memory AM instead of
    tcp/lo), reported for comparison only: kvown does not set it.

Both processes busy-poll with no NIXL progress thread (the only sane mode on 2 cores). Each side of
the timed loop is bounded; a child that does not answer within ``--deadline-s`` fails the run.

Usage: kvown bench control (python -m kvown.apps.benchmarks.control) [--iters 2000] [--json PATH] [--no-sysv]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np  # noqa: E402

from kvown.apps.benchmarks.common import count  # noqa: E402

KIB = 1024
BUF_NBYTES = 4 << 20  # room for 1 MiB written as 256 scattered 4 KiB blocks (stride 8 KiB)
SIZES = (4 * KIB, 64 * KIB, 1 << 20)
NOTIF_SIZES = (64 * KIB, 1 << 20, 4 << 20, 16 << 20)


def _pct(ns: list[int]) -> dict[str, float]:
    us = np.asarray(ns, dtype=np.float64) / 1000.0
    return {"n": int(us.size), "p50_us": round(float(np.percentile(us, 50)), 2),
            "p99_us": round(float(np.percentile(us, 99)), 2), "mean_us": round(float(us.mean()), 2)}


# ----------------------------------------------------------------------------- NIXL roles


def _nixl_target(conn: Any, deadline_s: float) -> None:
    """Echo: b"p<i>" -> b"a<i>"; b"s..." -> b"z<len>"; b"q" quits. Keeps draining so WRITEs progress."""
    from kvown.adapters.nixl import MemKind, NixlEndpoint

    ep = NixlEndpoint(f"bench-target-{os.getpid()}")
    buf = np.zeros(BUF_NBYTES, dtype=np.uint8)
    ep.register(buf.ctypes.data, buf.nbytes, MemKind.DRAM)
    conn.send((ep.metadata(), buf.ctypes.data))
    peer = ep.add_peer(conn.recv())
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for _, msg in ep.drain_notifs():
            if msg == b"q":
                ep.close()
                conn.send("bye")
                return
            if msg[:1] == b"p":
                ep.send_notif(peer, b"a" + msg[1:])
            elif msg[:1] == b"s":
                ep.send_notif(peer, b"z%d" % len(msg))
    conn.send("deadline")


class _Initiator:
    """The initiating side of the NIXL control benchmark: one endpoint, one peer, one deadline, and the
    endpoint's NIXL agent (``agent``) for the one probe that must bypass kvown's payload cap."""

    def __init__(self, ep: Any, agent: Any, peer: Any, deadline_s: float) -> None:
        self.ep, self.agent, self.peer = ep, agent, peer
        self.end = time.monotonic() + deadline_s

    def wait_notif(self, want: bytes, limit_s: float | None = None) -> None:
        stop = self.end if limit_s is None else min(self.end, time.monotonic() + limit_s)
        while time.monotonic() < stop:
            for _, msg in self.ep.drain_notifs():
                if msg == want:
                    return
        raise TimeoutError(f"no {want[:16]!r} before the deadline")

    def ping_rtt(self, n: int) -> list[int]:
        rtt = []
        for i in range(n):
            t0 = time.perf_counter_ns()
            self.ep.send_notif(self.peer, b"p%d" % i)
            self.wait_notif(b"a%d" % i)
            rtt.append(time.perf_counter_ns() - t0)
        return rtt

    def write_lat(self, post: Any, n: int) -> tuple[list[int], int]:
        from kvown.adapters.nixl import XferStatus

        lat, descs = [], 0
        for _ in range(n):
            t0 = time.perf_counter_ns()
            h = post()
            while self.ep.poll(h) is XferStatus.IN_PROGRESS and time.monotonic() < self.end:
                self.ep.drain_notifs()
            lat.append(time.perf_counter_ns() - t0)
            if h.status is not XferStatus.DONE:
                raise RuntimeError(f"WRITE ended {h.status}: {h.error}")
            descs = h.num_descs
            self.ep.release(h)
        return lat, descs

    def variants(self, laddr: int, raddr: int, size: int, preps: tuple[Any, Any]) -> dict[str, Any]:
        """How one WRITE of ``size`` bytes can be posted: each a zero-argument poster."""
        from kvown.adapters.nixl import MemKind

        ep, peer, bs, nb = self.ep, self.peer, 4 * KIB, size // (4 * KIB)
        lp, rp = preps
        contig_l = [(laddr + i * bs, bs) for i in range(nb)]
        idx = np.arange(nb, dtype=np.int32)
        return {
            "one_desc": lambda: ep.post_write(peer, [(laddr, size)], [(raddr, size)], MemKind.DRAM),
            "4k_ranges_coalesced": lambda: ep.post_write(
                peer, contig_l, [(raddr + i * bs, bs) for i in range(nb)], MemKind.DRAM),
            "4k_ranges_scattered": lambda: ep.post_write(
                peer, contig_l, [(raddr + 2 * i * bs, bs) for i in range(nb)], MemKind.DRAM),
            "prepped_contiguous_idx": lambda: ep.post_write_blocks(peer, lp, idx, rp, idx),
            "prepped_scattered_idx": lambda: ep.post_write_blocks(
                peer, lp, idx, rp, np.arange(0, 2 * nb, 2, dtype=np.int32)),
        }

    def largest_notif(self, out: dict[str, Any]) -> int:
        """The library directly: kvown itself caps payloads at MAX_NOTIF_NBYTES."""
        largest = 0
        for size in NOTIF_SIZES:
            try:
                self.agent.send_notif(self.peer, b"s" + bytes(size - 1))
                self.wait_notif(b"z%d" % size, limit_s=10.0)
            except Exception as e:
                out["notif_error"] = f"{size}: {type(e).__name__}: {e}"
                break
            largest = size
        return largest


def _nixl_initiator(conn: Any, iters: int, deadline_s: float, full: bool) -> None:
    from kvown.adapters.nixl import MemKind, NixlEndpoint, make_agent

    name = f"bench-init-{os.getpid()}"
    agent = make_agent(name)
    ep = NixlEndpoint(name, agent=agent)
    src = np.ones(BUF_NBYTES, dtype=np.uint8)
    ep.register(src.ctypes.data, src.nbytes, MemKind.DRAM)
    tmd, raddr = conn.recv()
    peer = ep.add_peer(tmd)
    conn.send(ep.metadata())
    laddr = src.ctypes.data
    run = _Initiator(ep, agent, peer, deadline_s)
    out: dict[str, Any] = {}
    run.ping_rtt(100)  # warm up the connection
    out["notif_rtt"] = _pct(run.ping_rtt(iters))
    bs = 4 * KIB
    preps = (ep.prep_blocks(laddr, bs, BUF_NBYTES // bs, MemKind.DRAM),
             ep.prep_blocks(raddr, bs, BUF_NBYTES // bs, MemKind.DRAM, peer=peer))
    writes: dict[str, Any] = {}
    for size in SIZES if full else SIZES[:1]:
        n = iters if size // bs <= 16 else max(100, iters // 8)
        variants = run.variants(laddr, raddr, size, preps)
        for name, post in variants.items() if full else [("one_desc", variants["one_desc"])]:
            run.write_lat(post, 20)  # warm-up
            lat, descs = run.write_lat(post, n)
            writes[f"{size // KIB}KiB/{name}"] = {**_pct(lat), "descs": descs}
    out["write_post_to_done"] = writes
    if full:
        out["largest_notif_nbytes_ok"] = run.largest_notif(out)
    ep.send_notif(peer, b"q")
    ep.close()
    conn.send(out)


def _run_nixl(iters: int, deadline_s: float, env: dict[str, str], full: bool) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # spawn copies the environment at start()
    try:
        (it_conn, it_child), (tg_conn, tg_child) = ctx.Pipe(), ctx.Pipe()
        target = ctx.Process(target=_nixl_target, args=(tg_child, deadline_s), daemon=True)
        initiator = ctx.Process(target=_nixl_initiator, args=(it_child, iters, deadline_s, full), daemon=True)
        target.start()
        initiator.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        if not tg_conn.poll(30):
            raise RuntimeError("NIXL target did not start")
        it_conn.send(tg_conn.recv())
        if not it_conn.poll(30):
            raise RuntimeError("NIXL initiator did not start")
        tg_conn.send(it_conn.recv())
        if not it_conn.poll(deadline_s):
            raise RuntimeError("NIXL initiator gave no result")
        result = it_conn.recv()
        tg_conn.poll(10)
    finally:
        for p in (initiator, target):
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    result["exit_codes"] = [initiator.exitcode, target.exitcode]
    return result


# ----------------------------------------------------------------------------- ZeroMQ roles


def _zmq_echo(conn: Any, deadline_s: float) -> None:
    import msgpack
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    conn.send(port)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if not sock.poll(1000):
            continue
        ident, raw = sock.recv_multipart()
        msg = msgpack.unpackb(raw)
        if msg.get("t") == "quit":
            break
        msg["t"] = "ack"
        sock.send_multipart([ident, msgpack.packb(msg)])
    sock.close()
    ctx.term()


def _run_zmq(iters: int, deadline_s: float) -> dict[str, Any]:
    import msgpack
    import zmq

    mctx = mp.get_context("spawn")
    here, there = mctx.Pipe()
    proc = mctx.Process(target=_zmq_echo, args=(there, deadline_s), daemon=True)
    proc.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        if not here.poll(30):
            raise RuntimeError("ZeroMQ echo did not start")
        sock.connect(f"tcp://127.0.0.1:{here.recv()}")
        pc = time.perf_counter_ns
        rtt = []
        blocks = list(range(16))
        for i in range(iters + 100):
            t0 = pc()
            sock.send(msgpack.packb({"t": "q", "rid": 1000 + i, "seq": i, "blocks": blocks}))
            if not sock.poll(int(deadline_s * 1000)):
                raise RuntimeError("ZeroMQ echo stopped answering")
            reply = msgpack.unpackb(sock.recv())
            assert reply["seq"] == i
            if i >= 100:
                rtt.append(pc() - t0)
        sock.send(msgpack.packb({"t": "quit"}))
    finally:
        sock.close()
        ctx.term()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return {"zmq_dealer_router_tcp_msgpack_rtt": _pct(rtt)}


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="kvown bench control", description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=count, default=2000)
    ap.add_argument("--deadline-s", type=float, default=60.0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-sysv", action="store_true", help="skip the UCX_MM_ERROR_HANDLING=y comparison")
    ap.add_argument("--quick", action="store_true", help="200 iterations, no sysv comparison (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.iters, args.no_sysv = 200, True
    t0 = time.monotonic()
    report: dict[str, Any] = {
        "benchmark": "bench_control",
        "iters": args.iters,
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine()},
        "mode": "2 spawned processes, busy polling, no NIXL progress thread, UCX backend, DRAM",
    }
    report["nixl_default"] = _run_nixl(args.iters, args.deadline_s, {}, full=True)
    report.update(_run_zmq(args.iters, args.deadline_s))
    if not args.no_sysv:
        report["nixl_ucx_mm_error_handling"] = _run_nixl(args.iters, args.deadline_s,
                                                         {"UCX_MM_ERROR_HANDLING": "y"}, full=False)
    report["wall_s"] = round(time.monotonic() - t0, 1)
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


def _print(r: dict[str, Any]) -> None:
    def line(name: str, s: dict[str, Any]) -> None:
        extra = f" descs={s['descs']}" if "descs" in s else ""
        print(f"  {name:44s} p50={s['p50_us']:9.2f}us p99={s['p99_us']:9.2f}us n={s['n']}{extra}")

    print(f"bench_control: iters={r['iters']} wall={r['wall_s']}s ({r['mode']})")
    d = r["nixl_default"]
    line("NIXL notif ping-pong RTT (tcp/lo AM)", d["notif_rtt"])
    line("ZeroMQ DEALER/ROUTER RTT + msgpack", r["zmq_dealer_router_tcp_msgpack_rtt"])
    if "nixl_ucx_mm_error_handling" in r:
        s = r["nixl_ucx_mm_error_handling"]
        line("NIXL notif RTT, UCX_MM_ERROR_HANDLING=y", s["notif_rtt"])
        line("  4KiB one_desc write, UCX_MM_ERROR_HANDLING=y", s["write_post_to_done"]["4KiB/one_desc"])
        print(f"  exit codes with UCX_MM_ERROR_HANDLING=y: {s['exit_codes']}")
    print("  NIXL WRITE post -> DONE:")
    for k, s in d["write_post_to_done"].items():
        line("  " + k, s)
    print(f"  largest notification payload delivered: {d.get('largest_notif_nbytes_ok')} B "
          f"{d.get('notif_error', '')}")
    print(f"  exit codes (default): {d['exit_codes']}")


if __name__ == "__main__":
    main()
