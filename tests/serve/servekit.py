"""Helpers for the serve tests (clients, health checks); fixtures live in conftest.py."""

from __future__ import annotations

import time

import httpx
import pytest

from kvown.apps.serve.etcd import INSTALL_HINT, find_etcd
from kvown.apps.serve.local import LocalStack


def need_etcd() -> None:
    if find_etcd() is None:
        pytest.skip(f"no etcd binary: {INSTALL_HINT}")


def complete(url: str, prompt, max_tokens: int, **kw) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, **kw}, timeout=60
    )


def text_of(url: str, prompt, max_tokens: int, **kw) -> str:
    r = complete(url, prompt, max_tokens, **kw)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def server_urls(stack: LocalStack) -> dict[str, str]:
    return {k: p.url for k, p in stack.procs.items() if k != "router"}


def identities(stack: LocalStack) -> dict[str, tuple[int, int]]:
    """(pid, started_ns) of every server: a restart would change them."""
    out = {}
    for key, p in stack.procs.items():
        h = httpx.get(f"{p.url}/health", timeout=5).json()
        out[key] = (h["pid"], h["started_ns"])
    return out


def wait_at_rest(stack: LocalStack, timeout_s: float = 20.0) -> dict[str, dict]:
    """Bounded wait until no server holds a block for anyone (INV-SRV-1); returns the last health."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, dict] = {}
    while time.monotonic() < deadline:
        last = {k: httpx.get(f"{u}/health", timeout=5).json() for k, u in server_urls(stack).items()}
        if all(_at_rest(h) for h in last.values()):
            return last
        time.sleep(0.1)
    raise AssertionError(f"servers not at rest after {timeout_s} s: {last}")


def _at_rest(h: dict) -> bool:
    b, link = h["blocks"], h["link"] or {"owned": 0, "held": 0, "sending": 0}
    return (
        h["inflight"] == 0
        and b["free"] == b["total"]
        and b["in_use"] == 0
        and b["lent"] == 0
        and link["owned"] == link["held"] == link["sending"] == 0
    )
