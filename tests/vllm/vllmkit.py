"""Helpers of the real-vLLM tests: prompts of known token lengths, greedy completions with token ids,
and vLLM's own Prometheus counters (how a test sees that vLLM aborted a request)."""

from __future__ import annotations

import contextlib
import json
import random
import re

import httpx

from kvown.apps.serve.vllm.model import WORDS
from kvown.apps.serve.vllm.stack import StackOptions, VllmStack


@contextlib.contextmanager
def running(connector: str | None, model: str, run_dir, **kw):
    """A stack for a fixture: started, yielded, always stopped."""
    with VllmStack(StackOptions(connector=connector, model=model, run_dir=str(run_dir), **kw)) as stack:
        yield stack


def text_prompt(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def complete(url: str, prompt, max_tokens: int = 16, *, stream: bool = False, timeout_s: float = 180,
             **kw) -> tuple[list[int], str, dict]:
    """Greedy completion through ``url``: (token ids, text, usage). Streams when asked (the ids then come
    from the chunks), so streamed and whole answers are compared the same way."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True, "stream": stream, **kw}
    if stream:
        body["stream_options"] = {"include_usage": True}
        ids: list[int] = []
        text, usage = "", {}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout_s) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                for c in event.get("choices", []):
                    ids += c.get("token_ids") or []
                    text += c.get("text") or ""
                usage = event.get("usage") or usage
        return ids, text, usage
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["token_ids"], out["choices"][0]["text"], out["usage"]


def counter(url: str, name: str, **labels: str) -> float:
    """Sum of a vLLM Prometheus counter's samples whose labels include ``labels``."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        m = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def kv_usage(url: str) -> float:
    return counter(url, "vllm:kv_cache_usage_perc")


def token_prompt(n_tokens: int, seed: int) -> list[int]:
    """A prompt of exactly ``n_tokens`` token ids (no special tokens: ids 3..2047)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(n_tokens)]
