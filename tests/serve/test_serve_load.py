"""Bounded load with disconnects: N concurrent clients for M seconds against the disaggregated stack,
30 % of requests abandoned at random points (before the answer starts, or after k streamed tokens).

It must end with 0 blocks held, 0 leaks (every allocator back to free == total, every link empty),
0 mismatched tokens among the requests that ran to the end, and no server restarted. The quick run is
in CI; the long one is marked slow.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time

import httpx
import pytest
import torch
from servekit import identities, wait_at_rest

from kvown.apps.serve.model import ByteTokenizer, ModelConfig, TinyLM, generate_reference


def _pool(seed: int = 3) -> list[tuple[str, int, str]]:
    torch.set_num_threads(1)
    model, tok, rng = TinyLM(ModelConfig()), ByteTokenizer(), random.Random(seed)
    out = []
    for i in range(24):
        prompt = f"request {i}: " + "".join(rng.choice("abcdefgh ij.") for _ in range(rng.randint(1, 300)))
        max_tokens = rng.randint(4, 48)
        out.append(
            (prompt, max_tokens, tok.decode(generate_reference(model, tok.encode(prompt), max_tokens)))
        )
    return out


def run_load(url: str, *, clients: int, duration_s: float, disconnect_fraction: float, seed: int) -> dict:
    pool = _pool()
    stats = {"completed": 0, "mismatched": 0, "errors": 0, "abandoned": 0, "streamed": 0}
    errors: list[str] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + duration_s

    def count(key: str, detail: str | None = None) -> None:
        with lock:
            stats[key] += 1
            if detail:
                errors.append(detail)

    def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        with httpx.Client(timeout=30) as http:
            while time.monotonic() < stop_at:
                prompt, max_tokens, expected = rng.choice(pool)
                body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
                leave = rng.random() < disconnect_fraction
                try:
                    if leave and rng.random() < 0.4:  # gone before the answer starts (prefill or landing)
                        with contextlib.suppress(httpx.ReadTimeout):
                            http.post(
                                f"{url}/v1/completions",
                                json={**body, "stream": rng.random() < 0.5},
                                timeout=httpx.Timeout(30, read=rng.uniform(0.001, 0.08)),
                            )
                        count("abandoned")
                    elif leave or rng.random() < 0.5:  # streamed; abandoned after k tokens when leaving
                        keep = rng.randint(0, max_tokens) if leave else None
                        text, finished = "", False
                        with http.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
                            if r.status_code != 200:
                                count("errors", f"HTTP {r.status_code}: {r.read()[:200]!r}")
                                continue
                            for line in r.iter_lines():
                                if line == "data: [DONE]":
                                    finished = True
                                elif line.startswith("data: "):
                                    event = json.loads(line[6:])
                                    if "error" in event:
                                        count("errors", str(event["error"])[:200])
                                        break
                                    text += event["choices"][0]["text"]
                                    if keep is not None and len(text) >= keep:
                                        break
                        if keep is not None:
                            count("abandoned")
                        elif finished:
                            count("streamed")
                            count("completed" if text == expected else "mismatched")
                    else:
                        r = http.post(f"{url}/v1/completions", json=body)
                        if r.status_code != 200:
                            count("errors", f"HTTP {r.status_code}: {r.text[:200]}")
                            continue
                        text = r.json()["choices"][0]["text"]
                        count("completed" if text == expected else "mismatched")
                except httpx.HTTPError as error:
                    count("errors", f"{type(error).__name__}: {error}")

    threads = [threading.Thread(target=client, args=(i,), name=f"load-client-{i}") for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(duration_s + 60)
    assert not any(t.is_alive() for t in threads), "a client hung"
    stats["error_samples"] = errors[:5]
    return stats


def _check(stack, stats: dict, before: dict) -> None:
    assert stats["errors"] == 0, stats
    assert stats["mismatched"] == 0, stats
    assert stats["completed"] > 0 and stats["abandoned"] > 0 and stats["streamed"] > 0, stats
    health = wait_at_rest(stack, timeout_s=30)  # 0 blocks held, 0 lent, allocators whole
    print(stats, {k: h["link"] for k, h in health.items()})
    for h in health.values():
        assert h["link"]["protocol_errors"] == 0
    # the disconnects really went through the link (destinations cancelled before landing, sources aborted)
    cancels = health["decode"]["link"]["recv_cancelled"] + health["prefill"]["link"]["send_cancelled"]
    assert cancels > 0, "no disconnect reached the KV link"
    assert identities(stack) == before, "a server restarted"
    assert not stack.dead()


def test_load_with_disconnects_quick(disagg_stack):
    before = identities(disagg_stack)
    stats = run_load(disagg_stack.url, clients=6, duration_s=8, disconnect_fraction=0.3, seed=1)
    _check(disagg_stack, stats, before)


@pytest.mark.slow
def test_load_with_disconnects_long(disagg_stack):
    before = identities(disagg_stack)
    stats = run_load(disagg_stack.url, clients=16, duration_s=60, disconnect_fraction=0.3, seed=2)
    _check(disagg_stack, stats, before)
