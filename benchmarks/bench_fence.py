"""Fence memory and lookup cost at one million cancelled ids, against TensorRT-LLM's dict[int, bool].

Reports, for the same ids in the same run (fixed seed):
  - bytes per fenced id: CancellationFence.nbytes() (the table storage) and tracemalloc (everything
    allocated while installing), and the same tracemalloc figure for a plain ``dict[int, bool]``;
  - nanoseconds per membership lookup, for hits and for misses.

Usage: python benchmarks/bench_fence.py [--ids N] [--seed S] [--json PATH]
Target: <= 16 bytes per fenced id.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import tracemalloc

from kvown.core.fence import CancellationFence, CancelOrigin
from kvown.core.ids import MAX_SEQ, make_request_id


def _ids(n: int, seed: int) -> tuple[list[int], list[int]]:
    """n distinct ids over 4 epochs (as a server that cancels ~1M requests would mint), plus n misses."""
    rng = random.Random(seed)
    seqs = rng.sample(range(MAX_SEQ + 1), 2 * n)
    ids = [make_request_id(i % 4, s) for i, s in enumerate(seqs[:n])]
    misses = [make_request_id(i % 4, s) for i, s in enumerate(seqs[n:])]
    return ids, misses


def _lookup_ns(contains, keys: list[int]) -> float:
    start = time.perf_counter_ns()
    hits = 0
    for k in keys:
        hits += contains(k)
    return (time.perf_counter_ns() - start) / len(keys)


def run(n: int, seed: int) -> dict[str, float]:
    ids, misses = _ids(n, seed)
    probe_hits, probe_misses = ids[: min(n, 200_000)], misses[: min(n, 200_000)]

    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    fence = CancellationFence()
    for rid in ids:
        fence.install(rid, CancelOrigin.CLIENT)
    fence_traced = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()

    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    table: dict[int, bool] = {}
    for rid in ids:
        table[rid] = False  # TensorRT-LLM: rid -> cancelled-by-peer
    dict_traced = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()

    assert len(fence) == n and all(fence.is_fenced(r) for r in probe_hits[:1000])
    return {
        "ids": n,
        "seed": seed,
        "fence_nbytes_per_id": fence.nbytes() / n,
        "fence_tracemalloc_bytes_per_id": fence_traced / n,
        "dict_tracemalloc_bytes_per_id": dict_traced / n,
        "fence_hit_ns": _lookup_ns(fence.is_fenced, probe_hits),
        "fence_miss_ns": _lookup_ns(fence.is_fenced, probe_misses),
        "dict_hit_ns": _lookup_ns(table.__contains__, probe_hits),
        "dict_miss_ns": _lookup_ns(table.__contains__, probe_misses),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=20240601)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    result = run(args.ids, args.seed)
    for key, value in result.items():
        print(f"{key:34s} {value:12.1f}" if isinstance(value, float) else f"{key:34s} {value:12d}")
    ok = result["fence_nbytes_per_id"] <= 16 and result["fence_tracemalloc_bytes_per_id"] <= 16
    print("target <= 16 bytes/id:", "met" if ok else "MISSED")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
