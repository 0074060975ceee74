"""Kernel throughput: NVFP4 quantize and dequantize and the block checksum, against torch's copy.

Reports, for the same device in the same run (fixed seed), each operation's bandwidth (bytes read +
bytes written per second) as a ratio of torch's ``dst.copy_(src)`` bandwidth (counted the same way:
2 x the bytes copied). On CUDA the kernels (kernels/ops.py through CuPy) run, and the torch
reference on the GPU beside them; on CPU the vectorised torch reference runs against a CPU copy.

  quantize    bf16 rows of 128 (a K/V head) -> packed E2M1 + E4M3 scales (global scale given)
  dequantize  the same NVFP4 data -> float32
  checksum    a pool of 2 MiB blocks, every block in one call

Usage: kvown bench kernels (python -m kvown.apps.benchmarks.kernels) [--device cpu|cuda] [--mib N] [--quick] [--seed S] [--json PATH]
Target (issue 8): >= 0.7x of the copy bandwidth for each kernel on an H200. On CPU there is no
target; the figure says how far the reference is from memory speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch

from kvown.kernels import nvfp4, ops
from kvown.kernels.cuda_loader import installed_cupy

TARGET_RATIO = 0.7
HEAD_DIM = 128
BLOCK_NBYTES = 2 << 20


def _timer(device: torch.device) -> Callable[[Callable[[], object], int, int], float]:
    """A median-of-iters timer in seconds: CUDA events on a GPU, perf_counter on the CPU."""

    def cpu(fn: Callable[[], object], warmup: int, iters: int) -> float:
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    def cuda(fn: Callable[[], object], warmup: int, iters: int) -> float:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize(device)
        samples = []
        for _ in range(iters):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end) / 1e3)
        return statistics.median(samples)

    return cuda if device.type == "cuda" else cpu


def run(device: torch.device, mib: int, seed: int, iters: int) -> dict[str, object]:
    generator = torch.Generator().manual_seed(seed)
    rows = max(1, (mib << 20) // (HEAD_DIM * 2))
    x = torch.randn(rows, HEAD_DIM, generator=generator).to(torch.bfloat16).to(device)
    pool_blocks = max(1, (mib << 20) // BLOCK_NBYTES)
    pool = torch.randint(0, 256, (pool_blocks, BLOCK_NBYTES), generator=generator, dtype=torch.int32)
    pool = pool.to(torch.uint8).to(device)
    timer = _timer(device)
    warmup = 2

    copy_src = torch.empty(mib << 20, dtype=torch.uint8, device=device).random_(0, 256, generator=None)
    copy_dst = torch.empty_like(copy_src)
    copy_s = timer(lambda: copy_dst.copy_(copy_src), warmup, iters)
    copy_bps = 2 * copy_src.numel() / copy_s

    gs = nvfp4.default_global_scale(float(x.float().abs().max()))
    q_bytes = x.numel() * 2 + x.numel() // 2 + x.numel() // 16
    dq_bytes = x.numel() // 2 + x.numel() // 16 + x.numel() * 4
    ck_bytes = pool.numel()
    backends = ["cuda", "torch"] if device.type == "cuda" and ops.cupy_available() else ["torch"]
    results: dict[str, object] = {}
    for backend in backends:
        q = ops.quantize(x, gs, check_finite=False, backend=backend)
        calls: dict[str, tuple[Callable[[], object], int]] = {
            "quantize": (partial(ops.quantize, x, gs, check_finite=False, backend=backend), q_bytes),
            "dequantize": (partial(ops.dequantize, q, backend=backend), dq_bytes),
            "checksum": (partial(ops.checksums, pool, backend=backend), ck_bytes),
        }
        timings = {name: (timer(call, warmup, iters), nbytes) for name, (call, nbytes) in calls.items()}
        for name, (seconds, nbytes) in timings.items():
            bps = nbytes / seconds
            results[f"{name}/{'kernel' if backend == 'cuda' else 'torch reference'}"] = {
                "seconds": seconds,
                "bytes_moved": nbytes,
                "gb_per_s": bps / 1e9,
                "ratio_to_copy": bps / copy_bps,
            }
    if "cuda" in backends:  # the kernels must agree with the reference on this very data
        q_kernel = ops.quantize(x, gs, backend="cuda")
        q_ref = ops.quantize(x, gs, backend="torch")
        agree = torch.equal(q_kernel.values, q_ref.values) and torch.equal(q_kernel.scales, q_ref.scales)
        agree &= torch.equal(ops.checksums(pool, backend="cuda"), ops.checksums(pool, backend="torch"))
        results["kernels_match_reference"] = bool(agree)
    cupy = installed_cupy()
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cupy": " ".join(cupy) if cupy else None,
        },
        "seed": seed,
        "iters": iters,
        "mib": mib,
        "copy": {"seconds": copy_s, "bytes_moved": 2 * copy_src.numel(), "gb_per_s": copy_bps / 1e9},
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvown bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mib", type=int, default=None, help="input size (default 512 on CUDA, 32 on CPU)")
    parser.add_argument("--quick", action="store_true", help="small sizes and few iterations (smoke test)")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    mib = args.mib or ((64 if args.quick else 512) if device.type == "cuda" else (4 if args.quick else 32))
    iters = args.iters or ((5 if args.quick else 20) if device.type == "cuda" else (3 if args.quick else 7))
    report = run(device, mib, args.seed, iters)
    copy = report["copy"]
    print(
        f"device {report['machine']['device']}, {mib} MiB, median of {iters}; "  # type: ignore[index]
        f"torch copy {copy['gb_per_s']:.2f} GB/s (read + write)"
    )  # type: ignore[index]
    missed = False
    for name, row in report["results"].items():  # type: ignore[attr-defined]
        if not isinstance(row, dict):
            print(f"{name:32s} {row}")
            missed |= row is False
            continue
        print(f"{name:32s} {row['gb_per_s']:9.2f} GB/s  {row['ratio_to_copy']:6.3f}x copy")
        if name.endswith("/kernel") and row["ratio_to_copy"] < TARGET_RATIO:
            missed = True
    if device.type == "cuda" and any(k.endswith("/kernel") for k in report["results"]):  # type: ignore[attr-defined]
        print(f"target >= {TARGET_RATIO}x copy for every kernel:", "MISSED" if missed else "met")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
