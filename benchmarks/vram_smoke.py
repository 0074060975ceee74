"""VRAM -> VRAM WRITE through real NIXL between two processes: the smoke test the GPU scripts run first.

Usage: python benchmarks/vram_smoke.py [--device cuda|cpu] [--mib N] [--timeout-s S]

A target process registers a buffer, an initiator process WRITEs a known byte pattern into it with a
notification, and the target checks every byte. Prints ``SMOKE OK: ...`` and exits 0 when every byte
landed; otherwise prints ``SMOKE FAILED: <why>`` and exits 1. With ``UCX_PROTO_INFO=y`` UCX prints the
transport that carried the WRITE (``cuda_ipc`` expected between two processes on one GPU).
``--device cpu`` is the same over host memory: the GPU scripts' fallback, and what CI runs.

Rules: every wait is bounded by ``--timeout-s`` (one deadline for the whole run); both processes end.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from typing import Any

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def _expected(nbytes: int, device: str) -> Any:
    import torch

    return (torch.arange(nbytes, dtype=torch.int64, device=device) % 251).to(torch.uint8)


def _target(conn: Any, nbytes: int, device: str, deadline: float) -> None:
    import torch

    from kvown.adapters.nixl import NixlEndpoint

    ep = NixlEndpoint(f"smoke-target-{os.getpid()}")
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    ep.register_tensor(buf)
    conn.send((ep.metadata(), buf.data_ptr()))
    ep.add_peer(conn.recv())
    landed = False
    while not landed and time.monotonic() < deadline:
        landed = any(msg == b"done" for _, msg in ep.drain_notifs())
    if device == "cuda":
        torch.cuda.synchronize()
    conn.send("no notification before the deadline" if not landed
              else "" if torch.equal(buf, _expected(nbytes, device)) else "bytes differ after the WRITE")
    ep.close()


def run(device: str, nbytes: int, timeout_s: float) -> str:
    """'' when every byte landed, else why not."""
    from kvown.adapters.nixl import MemKind, NixlEndpoint, XferStatus

    deadline = time.monotonic() + timeout_s
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(theirs, nbytes, device, deadline), daemon=True)
    proc.start()
    try:
        ep = NixlEndpoint(f"smoke-initiator-{os.getpid()}")
        src = _expected(nbytes, device)
        ep.register_tensor(src)
        if not mine.poll(max(0.0, deadline - time.monotonic())):
            return "the target did not start in time"
        metadata, addr = mine.recv()
        peer = ep.add_peer(metadata)
        mine.send(ep.metadata())
        mem = MemKind.VRAM if device == "cuda" else MemKind.DRAM
        handle = ep.post_write(peer, [(src.data_ptr(), nbytes)], [(addr, nbytes)], mem, mem,
                               device_id=src.device.index or 0, remote_device_id=src.device.index or 0,
                               notif=b"done")
        status = XferStatus.IN_PROGRESS
        while status is XferStatus.IN_PROGRESS and time.monotonic() < deadline:
            status = ep.poll(handle)
        if status is not XferStatus.IN_PROGRESS:
            ep.release(handle)
        if status is not XferStatus.DONE:
            return f"the WRITE ended {status.name}"
        if not mine.poll(max(0.0, deadline - time.monotonic()) + 1.0):
            return "the target did not report"
        ep.close()
        return str(mine.recv())
    finally:
        proc.join(max(0.0, deadline - time.monotonic()) + 1.0)
        if proc.is_alive():
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=45.0)
    args = parser.parse_args(argv)
    memory = "VRAM" if args.device == "cuda" else "DRAM"
    try:
        problem = run(args.device, args.mib << 20, args.timeout_s)
    except Exception as exc:  # report, never hang: the caller falls back
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        print(f"SMOKE FAILED: {memory} -> {memory}, {args.mib} MiB across processes: {problem}", flush=True)
        return 1
    print(f"SMOKE OK: {args.mib} MiB {memory} -> {memory} across processes, every byte checked", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
