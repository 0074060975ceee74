"""Time to first token and tokens/s of the reference server: disaggregated against single-process.

Starts three stacks in the same run (``kvown serve local --single``; ``kvown serve local``, whose KV
moves over kvown and NIXL; and ``kvown serve local --link loopback``, the same servers with an
in-process copy instead of kvown: same model, same seed, same KV blocks), then sends the same
streamed greedy workload to each, alternating per round so machine load drifts hit all alike.
Measured at the client:
  - TTFT: request sent -> first streamed text (p50, p90), ms;
  - tokens/s: completion tokens / wall time of the round;
  - end-to-end latency p50, ms.
Every disaggregated answer is also checked against the single-process answer (token-exact).

Usage: python benchmarks/bench_serve.py [--prompts N] [--max-tokens T] [--concurrency 1,8] [--rounds R]
                                        [--seed S] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import threading
import time

import httpx
import torch

from kvown.apps.serve.local import LocalStack


def _prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghij klmnop.,") for _ in range(rng.randint(16, 400))) for _ in range(n)]


def _one(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> tuple[float, float, str]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft, text = None, ""
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                piece = json.loads(line[6:])["choices"][0]["text"]
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text += piece
    return (ttft if ttft is not None else float("nan")), time.perf_counter() - t0, text


def _round(url: str, prompts: list[str], max_tokens: int, concurrency: int) -> dict:
    results: list[tuple[int, float, float, str]] = []
    lock = threading.Lock()
    queue = list(enumerate(prompts))

    def worker() -> None:
        with httpx.Client(timeout=120) as client:
            while True:
                with lock:
                    if not queue:
                        return
                    i, prompt = queue.pop(0)
                ttft, e2e, text = _one(client, url, prompt, max_tokens)
                with lock:
                    results.append((i, ttft, e2e, text))

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    wall = time.perf_counter() - start
    ttfts = sorted(r[1] for r in results)
    return {
        "requests": len(results),
        "wall_s": wall,
        "tokens_per_s": sum(len(r[3]) for r in results) / wall,
        "ttft_p50_ms": 1e3 * statistics.median(ttfts),
        "ttft_p90_ms": 1e3 * ttfts[int(0.9 * (len(ttfts) - 1))],
        "e2e_p50_ms": 1e3 * statistics.median(r[2] for r in results),
        "texts": {r[0]: r[3] for r in results},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="smoke test: 8 prompts, 8 tokens, one round")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help=argparse.SUPPRESS)  # kvown bench passes it; no plot here
    a = p.parse_args(argv)
    if a.quick:
        a.prompts, a.max_tokens, a.rounds = 8, 8, 1
    prompts = _prompts(a.prompts, a.seed)
    levels = [int(c) for c in a.concurrency.split(",")]
    args = ["--num-blocks", "2048"]
    report: dict = {
        "benchmark": "serve",
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": _cpus()},
        "config": {
            "prompts": a.prompts,
            "max_tokens": a.max_tokens,
            "rounds": a.rounds,
            "seed": a.seed,
            "model": "kvown-tiny (2 layers, d=64, 4 heads / 2 KV heads, fp32, CPU, 1 torch thread each)",
        },
        "results": {},
        "mismatches": 0,
    }
    with (
        LocalStack(single=True, server_args=args) as single,
        LocalStack(server_args=[*args, "--link", "kvown"]) as disagg,
        LocalStack(server_args=[*args, "--link", "loopback"]) as loopback,
    ):
        urls = {"single": single.url, "disaggregated": disagg.url, "disaggregated_loopback": loopback.url}
        for url in urls.values():  # warm up both (first forwards, connections)
            _round(url, prompts[:4], 4, 2)
        for c in levels:
            per_mode: dict[str, list[dict]] = {m: [] for m in urls}
            for _ in range(a.rounds):
                for mode, url in urls.items():
                    per_mode[mode].append(_round(url, prompts, a.max_tokens, c))
            ref = per_mode["single"][0]["texts"]
            for r in per_mode["disaggregated"] + per_mode["disaggregated_loopback"]:
                report["mismatches"] += sum(r["texts"][i] != ref[i] for i in ref)
            for mode, rounds in per_mode.items():
                report["results"].setdefault(mode, {})[f"c{c}"] = {
                    k: statistics.median(r[k] for r in rounds)
                    for k in ("tokens_per_s", "ttft_p50_ms", "ttft_p90_ms", "e2e_p50_ms", "wall_s")
                } | {"requests": sum(r["requests"] for r in rounds)}
    def ratios(num: str, den: str) -> dict:
        return {
            f"c{c}": {
                k: report["results"][num][f"c{c}"][k] / report["results"][den][f"c{c}"][k]
                for k in ("tokens_per_s", "ttft_p50_ms", "e2e_p50_ms")
            }
            for c in levels
        }

    report["ratios_disagg_over_single"] = ratios("disaggregated", "single")
    report["ratios_kvown_link_over_loopback"] = ratios("disaggregated", "disaggregated_loopback")
    text = json.dumps(report, indent=2)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 0 if report["mismatches"] == 0 else 1


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    sys.exit(main())
