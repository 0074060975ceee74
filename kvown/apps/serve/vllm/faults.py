"""The fault matrix of ``kvown serve vllm``, the same for every connector (kvown, nixl, nixl-push).

    python -m kvown.apps.serve.vllm.faults --connectors nixl,nixl-push --json out.json [--quick]

Cells: a client abort aimed at each phase (before prefill, during prefill, after prefill and before
decode admits, mid-transfer, mid-decode), the prefill instance SIGKILLed mid-transfer, the prefill
SIGSTOPped after publication, the decode instance killed mid-decode, etcd restarted (connectors that
use etcd only), and a burst of aborts (89 % of requests abandoned at random times).

Detector (no vLLM patch): the single instance first answers every prompt of the pool (the oracle);
after every cell each *completed* request's token ids must equal the oracle's (a mismatch is served
corruption), every request must end with tokens or an error within ``bound_s`` (else it is "hung"),
both instances' ``vllm:kv_cache_usage_perc`` must return to 0 once idle (else blocks are held; after
``idle_s`` they count as leaked), and an instance that died without being killed is a fail-stop.

Rules:
  1. Phases are aimed by time, from a calibration per stack (P's answer time and the proxy's TTFT for
     the long prompt); the report says where each abort was aimed, not where it landed.
  2. Every wait is bounded; a destructive cell (kill, stop, etcd) gets a fresh stack; every stack
     is stopped (stack.py rule 1).
  3. NixlConnector figures are with kvown's baseline fix (plugin.py): say so wherever they appear.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvown.apps.serve.vllm.connectors import connector as connector_spec
from kvown.apps.serve.vllm.stack import StackOptions, VllmStack
from kvown.core.errors import KvownError

MAX_TOKENS = 32
# kvown's deadlines in the matrix: a request times out 10 s after its destination was published, and an
# unproven writer fail-stops the decode worker 10 s later - well inside the client bound and the 40 s stop
KVOWN_KNOBS = {"transfer_timeout_s": 10.0, "grace_s": 10.0, "publish_timeout_s": 30.0}


def prompt_pool(n: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts: short (under a block), medium and long (many blocks), fixed by ``seed``."""
    rng = random.Random(seed)
    sizes = [11, 200, 700, 1500]
    return [[rng.randrange(3, 2048) for _ in range(sizes[i % len(sizes)] + rng.randrange(0, 20))]
            for i in range(n)]


@dataclass
class Outcome:
    cell: str
    prompt: int
    status: str  # completed | error | abandoned (we left on purpose) | hung
    ids: list[int] = field(default_factory=list)
    mismatch: bool = False
    seconds: float = 0.0
    detail: str = ""


async def stream_one(client: httpx.AsyncClient, url: str, prompt: list[int], *, leave_after_s: float | None = None,
                     leave_after_tokens: int | None = None, bound_s: float = 90.0) -> tuple[str, list[int], str]:
    """One streamed greedy request: (status, token ids, detail). Leaving = closing the connection."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    ids: list[int] = []

    async def read() -> tuple[str, str]:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return "error", f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return "error", str(event["error"])[:200]
                for c in event.get("choices", []):
                    ids.extend(c.get("token_ids") or [])
                if leave_after_tokens is not None and len(ids) >= leave_after_tokens:
                    return "abandoned", f"after {len(ids)} tokens"
        return ("completed", "") if len(ids) == MAX_TOKENS else ("error", f"stream ended at {len(ids)} tokens")

    task = asyncio.create_task(read())
    try:
        if leave_after_s is not None:
            done, _ = await asyncio.wait({task}, timeout=leave_after_s)
            if not done:
                task.cancel()
                return "abandoned", ids, f"after {leave_after_s * 1000:.0f} ms"
        status, detail = await asyncio.wait_for(task, bound_s)
        return status, ids, detail
    except TimeoutError:
        return "hung", ids, f"no end within {bound_s:.0f} s"
    except httpx.HTTPError as error:
        return "error", ids, type(error).__name__


@dataclass
class Calibration:
    prefill_s: float  # P's answer time for the long prompt
    ttft_s: float  # the proxy's time to first token for it


class Matrix:
    def __init__(self, connector: str, model: str, oracle: dict[int, list[int]], prompts: list[list[int]],
                 run_dir: Path, *, bound_s: float, idle_s: float, quick: bool) -> None:
        self.connector, self.model, self.oracle, self.prompts = connector, model, oracle, prompts
        self.run_dir, self.bound_s, self.idle_s, self.quick = run_dir, bound_s, idle_s, quick
        self.outcomes: list[Outcome] = []
        self.cells: list[dict[str, Any]] = []
        self.stack_dirs: list[Path] = []
        self.notes: list[str] = []
        self.rng = random.Random(1)
        self.on_cell: Callable[[], None] = lambda: None  # called after every cell (run() saves the JSON)

    def stack(self, tag: str) -> VllmStack:
        self.stack_dirs.append(self.run_dir / f"{self.connector}-{tag}")
        extra = KVOWN_KNOBS if self.connector == "kvown" else {}
        return VllmStack(StackOptions(connector=self.connector, model=self.model, run_dir=str(self.stack_dirs[-1]),
                                      connector_extra=dict(extra)))

    async def calibrate(self, url: str, prefill_url: str, client: httpx.AsyncClient) -> Calibration:
        """Time P's answer and the proxy's TTFT for the long prompt; a failure (a request the connector
        loses) falls back to 0.5 s / 1 s, and the report says so."""
        long = self.prompts[3]
        try:
            t0 = time.monotonic()
            await client.post(f"{prefill_url}/v1/completions", json={"model": "tiny", "prompt": long, "max_tokens": 1})
            prefill_s = time.monotonic() - t0
            t0 = time.monotonic()
            status, _, _ = await stream_one(client, url, long, leave_after_tokens=1, bound_s=self.bound_s)
            if status != "abandoned":
                raise RuntimeError(f"calibration request {status}")
            return Calibration(prefill_s, max(time.monotonic() - t0, prefill_s))
        except (httpx.HTTPError, RuntimeError) as error:
            self.notes.append(f"calibration failed ({type(error).__name__}: {error}); aimed with 0.5 s / 1 s")
            return Calibration(0.5, 1.0)

    def record(self, cell: str, prompt: int, result: tuple[str, list[int], str], seconds: float) -> None:
        status, ids, detail = result
        mismatch = status == "completed" and ids != self.oracle[prompt]
        self.outcomes.append(Outcome(cell, prompt, status, ids, mismatch, round(seconds, 3), detail))

    async def run(self, cell: str, client: httpx.AsyncClient, url: str, prompt: int, **kw: Any) -> None:
        t0 = time.monotonic()
        self.record(cell, prompt, await stream_one(client, url, self.prompts[prompt], **kw), time.monotonic() - t0)

    async def follow_up(self, cell: str, client: httpx.AsyncClient, url: str, n: int = 2) -> None:
        """Requests after the fault: the stack must still answer them, and correctly."""
        for i in range(n):
            await self.run(f"{cell}/after", client, url, i % len(self.prompts), bound_s=self.bound_s)

    async def client_aborts(self, stack: VllmStack, client: httpx.AsyncClient, cal: Calibration) -> None:
        gap = max(cal.ttft_s - cal.prefill_s, 0.01)
        aims = {"abort-before-prefill": {"leave_after_s": 0.005},
                "abort-during-prefill": {"leave_after_s": cal.prefill_s * 0.5},
                "abort-after-prefill": {"leave_after_s": cal.prefill_s + 0.2 * gap},
                "abort-mid-transfer": {"leave_after_s": cal.prefill_s + 0.5 * gap},
                "abort-mid-decode": {"leave_after_tokens": 3}}
        reps = 1 if self.quick else 3
        for cell, aim in aims.items():
            for _ in range(reps):
                await self.run(cell, client, stack.url, 3, bound_s=self.bound_s, **aim)
            await self.follow_up(cell, client, stack.url)
            self.cells.append({"cell": cell, "aim": {k: round(v, 3) for k, v in aim.items()},
                               **await self.settle(stack, client)})
            self.on_cell()

    async def burst(self, stack: VllmStack, client: httpx.AsyncClient, cal: Calibration) -> None:
        n = 18 if self.quick else 54
        sem = asyncio.Semaphore(6)

        async def one(i: int) -> None:
            async with sem:
                p = self.rng.randrange(len(self.prompts))
                leave = self.rng.random() < 0.89
                kw = {"leave_after_s": self.rng.uniform(0.0, cal.ttft_s * 2)} if leave else {}
                await self.run("abort-burst-89%", client, stack.url, p, bound_s=self.bound_s, **kw)

        await asyncio.gather(*(one(i) for i in range(n)))
        await self.follow_up("abort-burst-89%", client, stack.url)
        self.cells.append({"cell": "abort-burst-89%", **await self.settle(stack, client)})

    async def settle(self, stack: VllmStack, client: httpx.AsyncClient,
                     killed: tuple[str, ...] = ()) -> dict[str, Any]:
        """Wait (bounded by idle_s) until both instances hold no KV; report what they held and for how
        long, and which instance died that nobody killed (a fail-stop)."""
        t0, first, held_s = time.monotonic(), None, None
        usage: dict[str, float | None] = {}
        while True:
            usage = {name: await kv_usage(client, p.instance.url) if p.alive() else None
                     for name, p in stack.instances.items()}
            first = first or usage
            if all(u in (None, 0.0) for u in usage.values()):
                held_s = round(time.monotonic() - t0, 1)
                break
            if time.monotonic() - t0 > self.idle_s:
                break
            await asyncio.sleep(1.0)
        stopped = {n: kvown_fail_stops(p.log_path.read_text(errors="replace") if p.log_path.exists() else "")
                   for n, p in stack.instances.items()}
        died = [n for n, p in stack.instances.items()
                if n not in killed and (stopped[n] or not p.alive())]  # a fail-stopped worker may leave its API server up
        return {"kv_usage_at_end": first, "kv_usage_after_idle": usage, "freed_after_s": held_s,
                "leaked": held_s is None, "fail_stops": died,
                "kvown_fail_stops": {n: lines for n, lines in stopped.items() if lines}}

    async def destructive(self, cell: str, act: Callable[[VllmStack, Calibration], Awaitable[tuple[str, ...]]],
                          kind: str) -> None:
        """A fresh stack, one long request with the fault ``act`` applied while it runs, follow-ups.
        A stack that does not start is reported as the cell's error (the matrix goes on)."""
        try:
            stack = self.stack(cell).start()
        except KvownError as error:
            self.cells.append({"cell": cell, "kind": kind, "error": f"stack did not start: {error}"[:500]})
            return
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(self.bound_s, connect=5)) as client:
                cal = await self.calibrate(stack.url, stack.instances["prefill-0"].instance.url, client)
                victim = asyncio.create_task(self.run(cell, client, stack.url, 3, bound_s=self.bound_s))
                killed = await act(stack, cal)
                await victim
                await self.follow_up(cell, client, stack.url)
                self.cells.append({"cell": cell, "kind": kind, **await self.settle(stack, client, killed)})
        except (httpx.HTTPError, KvownError, RuntimeError) as error:  # the cell's error; the matrix goes on
            self.cells.append({"cell": cell, "kind": kind, "error": f"{type(error).__name__}: {error}"[:500]})
        finally:
            stack.stop()
            self.on_cell()

    async def all_cells(self) -> None:
        with self.stack("aborts") as stack:
            async with httpx.AsyncClient(timeout=httpx.Timeout(self.bound_s, connect=5)) as client:
                cal = await self.calibrate(stack.url, stack.instances["prefill-0"].instance.url, client)
                self.calibration = asdict(cal)
                await self.client_aborts(stack, client, cal)
                await self.burst(stack, client, cal)

        async def kill_prefill(stack: VllmStack, cal: Calibration) -> tuple[str, ...]:
            await asyncio.sleep(cal.prefill_s + 0.5 * max(cal.ttft_s - cal.prefill_s, 0.01))
            stack.instances["prefill-0"].signal(signal.SIGKILL)
            return ("prefill-0",)

        async def stop_prefill(stack: VllmStack, cal: Calibration) -> tuple[str, ...]:
            await asyncio.sleep(cal.prefill_s + 0.05)  # P has answered: its KV is published
            stack.instances["prefill-0"].signal(signal.SIGSTOP)
            await asyncio.sleep(self.stop_s)
            stack.instances["prefill-0"].signal(signal.SIGCONT)
            return ()

        async def kill_decode(stack: VllmStack, cal: Calibration) -> tuple[str, ...]:
            await asyncio.sleep(cal.ttft_s + 0.2)
            stack.instances["decode-0"].signal(signal.SIGKILL)
            return ("decode-0",)

        async def restart_etcd(stack: VllmStack, cal: Calibration) -> tuple[str, ...]:
            await asyncio.sleep(cal.prefill_s * 0.5)
            assert stack.etcd is not None
            await asyncio.to_thread(stack.etcd.restart, down_s=2.0)
            return ()

        await self.destructive("prefill-killed-mid-transfer", kill_prefill, "SIGKILL prefill group")
        await self.destructive("prefill-stopped-after-publication", stop_prefill,
                               f"SIGSTOP prefill {self.stop_s:.0f} s")
        await self.destructive("decode-killed", kill_decode, "SIGKILL decode group mid-decode")
        if connector_spec(self.connector).needs_etcd:
            await self.destructive("etcd-restarted", restart_etcd, "etcd SIGKILLed, restarted after 2 s")
        else:
            self.cells.append({"cell": "etcd-restarted", "kind": "n/a: the connector does not use etcd"})

    stop_s = 40.0  # longer than NixlConnector's 30 s lease

    def summary(self) -> dict[str, Any]:
        o = self.outcomes
        count = lambda s: sum(1 for x in o if x.status == s)  # noqa: E731
        return {"connector": self.connector, "baseline_fix": connector_spec(self.connector).baseline_fix,
                "requests": len(o), "completed": count("completed"), "errors": count("error"),
                "abandoned": count("abandoned"), "hung": count("hung"),
                "token_mismatches": sum(1 for x in o if x.mismatch),
                "leaked_cells": [c["cell"] for c in self.cells if c.get("leaked")],
                "fail_stops": sorted({d for c in self.cells for d in c.get("fail_stops", [])}),
                "cells": self.cells, "calibration": getattr(self, "calibration", None), "notes": self.notes,
                "logs": {d.name: log_signals(d) for d in self.stack_dirs},
                "outcomes": [asdict(x) | {"ids": None} for x in o]}


# what vLLM's own logs confess (read after the run, no patch): a lease that expired with the blocks
# unread, a notification for blocks already released (the read-after-free window), aborts, crashes
LOG_SIGNALS = {"lease_expired": "Releasing expired KV blocks", "read_after_release": "Potentially invalid KV blocks",
               "aborted": "Aborted request", "tracebacks": "Traceback (most recent call last)"}


_FAIL_STOP = re.compile(r"kvown FAIL-STOP rank=(?P<rank>-?\d+) pid=\d+ reason=(?P<reason>\S+) "
                        r"request_id=\S+ exit_code=\d+ flight=(?P<flight>\S+)")


def kvown_fail_stops(text: str) -> list[dict[str, Any]]:
    """kvown's fail-stop lines in an instance's log (kvown/runtime/failstop.py writes one per fail-stop):
    the rank, the reason, and whether the flight recorder it names is on disk."""
    return [{"rank": int(m["rank"]), "reason": m["reason"], "flight": m["flight"],
             "flight_on_disk": Path(m["flight"]).is_file()} for m in _FAIL_STOP.finditer(text)]


def log_signals(run_dir: Path) -> dict[str, dict[str, int]]:
    """Per instance log under ``run_dir``: how often each of ``LOG_SIGNALS`` appears."""
    out = {}
    for log in sorted(run_dir.glob("*-0.log")):
        text = log.read_text(errors="replace")
        out[log.stem] = {k: text.count(v) for k, v in LOG_SIGNALS.items()}
    return out


async def kv_usage(client: httpx.AsyncClient, url: str) -> float | None:
    try:
        text = (await client.get(f"{url}/metrics", timeout=5)).text
    except httpx.HTTPError:
        return None
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:kv_cache_usage_perc"))


async def oracle_of(prompts: list[list[int]], model: str, run_dir: Path) -> dict[int, list[int]]:
    """Every prompt's greedy answer from the single instance (the detector's oracle)."""
    with VllmStack(StackOptions(connector=None, model=model, run_dir=str(run_dir / "single"))) as stack:
        async with httpx.AsyncClient(timeout=120) as client:
            out = {}
            for i, p in enumerate(prompts):
                status, ids, detail = await stream_one(client, stack.url, p)
                if status != "completed":
                    raise RuntimeError(f"oracle prompt {i}: {status} {detail}")
                out[i] = ids
            return out


def run(connectors: list[str], model: str | None, run_dir: Path, *, quick: bool = False,
        bound_s: float = 90.0, idle_s: float = 45.0, json_path: str | None = None) -> dict[str, Any]:
    from kvown.apps.serve.vllm.stack import build_model, find_vllm_python

    model = model or str(build_model(find_vllm_python(), run_dir / "model"))
    prompts = prompt_pool(8)
    oracle = asyncio.run(oracle_of(prompts, model, run_dir))
    report: dict[str, Any] = {"max_tokens": MAX_TOKENS, "prompt_tokens": [len(p) for p in prompts],
                              "bound_s": bound_s, "idle_s": idle_s, "connectors": {}}
    for name in connectors:
        m = Matrix(name, model, oracle, prompts, run_dir, bound_s=bound_s, idle_s=idle_s, quick=quick)
        t0 = time.monotonic()

        def save(m: Matrix = m, name: str = name, t0: float = t0) -> None:  # a run cut short keeps its cells
            report["connectors"][name] = {**m.summary(), "seconds": round(time.monotonic() - t0, 1)}
            if json_path:
                Path(json_path).write_text(json.dumps(report, indent=1))

        m.on_cell = save
        try:
            asyncio.run(m.all_cells())
        except (httpx.HTTPError, KvownError, RuntimeError) as error:  # the aborts stack itself failed
            m.notes.append(f"matrix stopped: {type(error).__name__}: {error}"[:500])
        save()
    return report


def table(report: dict[str, Any]) -> str:
    head = "| connector | requests | completed | errors | abandoned | hung | token mismatches | leaked (cells) | fail-stops |"
    rows = [head, "|" + "---|" * 9]
    for name, r in report["connectors"].items():
        tag = f"{name} (baseline fix)" if r["baseline_fix"] else name
        rows.append(f"| {tag} | {r['requests']} | {r['completed']} | {r['errors']} | {r['abandoned']} | "
                    f"{r['hung']} | {r['token_mismatches']} | {', '.join(r['leaked_cells']) or 0} | "
                    f"{', '.join(r['fail_stops']) or 0} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvown.apps.serve.vllm.faults")
    p.add_argument("--connectors", default="kvown,nixl,nixl-push")
    p.add_argument("--model", default=None)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="one abort per phase, a burst of 18")
    a = p.parse_args(argv)
    import tempfile

    run_dir = Path(a.run_dir or tempfile.mkdtemp(prefix="kvown-vllm-faults-"))
    report = run(a.connectors.split(","), a.model, run_dir, quick=a.quick, json_path=a.json)
    print(table(report))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
