"""The user's proof: the disaggregated stack streams exactly the tokens a single server produces.

60 prompts of mixed lengths (1 to 500 bytes, ASCII and multi-byte UTF-8, across block boundaries),
greedy, through the router (prefill server -> KV link -> decode server) against the single-process
server, and both against in-process generation. Sampled requests (fixed seed) must agree too.
A client that leaves mid-stream gets its blocks retired on both sides.
"""

from __future__ import annotations

import concurrent.futures
import random
import time

import httpx
import pytest
import torch
from servekit import identities, text_of, wait_at_rest

from kvown.apps.serve.model import ByteTokenizer, ModelConfig, TinyLM, generate_reference


def _prompts(n: int, seed: int = 10) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    words = ["kv", "block", "prefill", "decode", "ownership", "quiescent", "écrit", "全部", "🙂", "\n", "  "]
    out = []
    lengths = [1, 2, 15, 16, 17, 31, 32, 33, 64, 100, 255, 256, 257, 400, 500]
    for i in range(n):
        target = lengths[i] if i < len(lengths) else rng.randint(1, 480)
        text = ""
        while len(text.encode()) < target:
            text += rng.choice(words) + rng.choice(["", " ", ".", ","])
        raw = text.encode()[:target].decode("utf-8", errors="ignore") or "x"
        out.append((raw, rng.choice([1, 2, 7, 16, 17, 24])))
    return out


PROMPTS = _prompts(60)


@pytest.fixture(scope="module")
def reference_model():
    torch.set_num_threads(1)
    return TinyLM(ModelConfig())


def test_greedy_disaggregated_equals_single_equals_in_process(disagg_stack, single_stack, reference_model):
    """Four requests at a time on each stack: outputs must not depend on what else is running."""
    before = identities(disagg_stack)
    tok = ByteTokenizer()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        disagg = pool.map(lambda p: text_of(disagg_stack.url, p[0], p[1], temperature=0), PROMPTS)
        single = pool.map(lambda p: text_of(single_stack.url, p[0], p[1], temperature=0), PROMPTS)
        local = [tok.decode(generate_reference(reference_model, tok.encode(p), n)) for p, n in PROMPTS]
        disagg, single = list(disagg), list(single)
    mismatches = [
        (prompt[:30], n, d, s, loc)
        for (prompt, n), d, s, loc in zip(PROMPTS, disagg, single, local, strict=True)
        if not (d == s == loc and len(d) == n)
    ]
    assert mismatches == []
    assert identities(disagg_stack) == before  # nothing restarted
    health = wait_at_rest(disagg_stack)
    assert health["decode"]["link"]["landed"] >= len(PROMPTS)
    assert health["decode"]["link"]["protocol_errors"] == 0


def test_sampled_outputs_agree_for_a_fixed_seed(disagg_stack, single_stack):
    for i, (prompt, _) in enumerate(PROMPTS[:12]):
        kw = {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + i}
        assert text_of(disagg_stack.url, prompt, 20, **kw) == text_of(single_stack.url, prompt, 20, **kw)


def test_client_disconnect_mid_stream_retires_blocks_on_both_sides(disagg_stack):
    body = {"prompt": "leave early " * 30, "max_tokens": 400, "temperature": 0, "stream": True}
    for keep in (0, 1, 5):
        with httpx.stream("POST", f"{disagg_stack.url}/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for n, _ in enumerate(r.iter_lines()):
                if n >= keep:
                    break
        # leaving the block closed the connection mid-stream
    health = wait_at_rest(disagg_stack)
    assert health["decode"]["blocks"]["free"] == health["decode"]["blocks"]["total"]
    metrics = httpx.get(f"{disagg_stack.procs['decode'].url}/metrics", timeout=5).text
    assert 'kvown_serve_requests_total{outcome="cancelled"}' in metrics


def test_disconnect_while_waiting_for_the_kv_cancels_through_the_link(disagg_stack):
    """A client gone before decode starts: the decode server cancels the destination, and the
    destination's blocks come back only after the prefill side's last frame."""
    decode = disagg_stack.procs["decode"].url
    with pytest.raises(httpx.ReadTimeout):  # the prefill was never told: the KV will not come
        httpx.post(
            f"{decode}/internal/decode",
            timeout=0.5,
            json={
                "prompt": "x" * 100,
                "max_tokens": 4,
                "kv_transfer": {"request_id": 12345, "prefill": "prefill-0"},
            },
        )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        h = httpx.get(f"{decode}/health", timeout=5).json()
        if h["link"]["recv_cancelled"] >= 1 and h["blocks"]["lent"] == 0:
            break
        time.sleep(0.05)
    assert h["link"]["recv_cancelled"] >= 1
    wait_at_rest(disagg_stack)
