"""The OpenAI contract with real clients over loopback: the official ``openai`` client and ``httpx``.

Bad requests get OpenAI-style 4xx bodies naming the parameter, from a single server and through the
router alike, and the servers keep serving. Streaming equals non-streaming; /health and /metrics answer.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from servekit import complete, text_of, wait_at_rest

BAD_REQUESTS = [
    ({"prompt": "", "max_tokens": 4}, 400, "prompt"),
    ({"prompt": [], "max_tokens": 4}, 400, "prompt"),
    ({"prompt": "x" * 513, "max_tokens": 4}, 400, "prompt"),
    ({"prompt": "x" * 500, "max_tokens": 600}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ({"prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "n": 2}, 400, "n"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "hi", "seed": -1}, 400, "seed"),
    ({"prompt": "hi", "logprobs": 3}, 400, "logprobs"),
    ({"prompt": "hi", "frobnicate": {"x": 1}}, 400, "frobnicate"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": [1, 300]}, 400, "prompt"),
    ({"prompt": 42}, 400, "prompt"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
]


@pytest.fixture(scope="module", params=["single", "router"])
def url(request, single_stack):
    if request.param == "single":
        return single_stack.url
    return request.getfixturevalue("disagg_stack").url


@pytest.mark.parametrize(("body", "status", "param"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors_naming_the_param(url, body, status, param):
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b'"just a string"'])
def test_malformed_bodies_are_400(url, raw):
    r = httpx.post(
        f"{url}/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=10
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_oversized_body_is_413(url):
    r = httpx.post(f"{url}/v1/completions", content=b" " * (1 << 20 + 1), timeout=10)
    assert r.status_code == 413


def test_servers_keep_serving_after_bad_requests_and_leak_nothing(url, single_stack):
    for body, _, _ in BAD_REQUESTS:
        httpx.post(f"{url}/v1/completions", json=body, timeout=10)
    assert len(text_of(url, "still alive?", 8, temperature=0)) == 8
    wait_at_rest(single_stack)


def test_official_client_completion_and_stream_agree(url):
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        whole = client.completions.create(
            model="kvown-tiny", prompt="The quick brown fox", max_tokens=24, temperature=0
        )
        assert whole.choices[0].finish_reason == "length"
        assert whole.usage.prompt_tokens == 19 and whole.usage.completion_tokens == 24
        pieces, finish, usage = [], None, None
        for event in client.completions.create(
            model="kvown-tiny",
            prompt="The quick brown fox",
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        ):
            if event.choices:
                pieces.append(event.choices[0].text)
                finish = event.choices[0].finish_reason or finish
            if event.usage is not None:
                usage = event.usage
        assert "".join(pieces) == whole.choices[0].text and len(whole.choices[0].text) == 24
        assert finish == "length" and usage.completion_tokens == 24
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="kvown-tiny", prompt="hi", max_tokens=0)
        assert caught.value.body["param"] == "max_tokens"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other-model", prompt="hi", max_tokens=2)


def test_stop_strings_cut_the_text_the_same_way_streamed_or_not(url):
    full = text_of(url, "stop here", 40, temperature=0)
    stop = full[10:12]
    cut = text_of(url, "stop here", 40, temperature=0, stop=[stop])
    assert cut == full[: full.index(stop)]
    r = complete(url, "stop here", 40, temperature=0, stop=[stop])
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    streamed = []
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        timeout=30,
        json={"prompt": "stop here", "max_tokens": 40, "temperature": 0, "stop": [stop], "stream": True},
    ) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                streamed.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(streamed) == cut


def test_token_id_prompts_and_utf8_prompts_are_the_same_bytes(url):
    text = "héllo ✓"
    assert text_of(url, text, 12, temperature=0) == text_of(url, list(text.encode()), 12, temperature=0)


def test_health_and_metrics(url):
    h = httpx.get(f"{url}/health", timeout=5).json()
    assert h["status"] == "ok" and h["pid"] > 0
    text_of(url, "count me", 3, temperature=0)
    metrics = httpx.get(f"{url}/metrics", timeout=5).text
    prefix = "kvown_router" if h["role"] == "router" else "kvown_serve"
    assert f'{prefix}_requests_total{{outcome="completed"}}' in metrics
    assert f'{prefix}_requests_total{{outcome="rejected"}}' in metrics


def test_decode_and_prefill_metrics_show_the_link(disagg_stack):
    text_of(disagg_stack.url, "through the link", 4, temperature=0)
    d = httpx.get(f"{disagg_stack.procs['decode'].url}/metrics", timeout=5).text
    p = httpx.get(f"{disagg_stack.procs['prefill'].url}/metrics", timeout=5).text
    assert 'kvown_serve_link_blocks{state="held"} 0.0' in d
    assert 'kvown_serve_link_returned_blocks_total{outcome="completed"}' in d
    assert 'kvown_serve_kv_blocks{state="lent"}' in p
    bytes_in = float(d.split('kvown_serve_link_bytes_total{direction="in"} ')[1].split()[0])
    assert bytes_in > 0


def test_internal_endpoints_validate_too(disagg_stack):
    decode, prefill = disagg_stack.procs["decode"].url, disagg_stack.procs["prefill"].url
    r = httpx.post(f"{decode}/internal/decode", json={"prompt": "x", "max_tokens": 2}, timeout=5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer"
    r = httpx.post(
        f"{decode}/internal/decode",
        timeout=5,
        json={"prompt": "x", "max_tokens": 2, "kv_transfer": {"request_id": 5, "prefill": "ghost"}},
    )
    assert r.status_code == 502 and r.json()["error"]["code"] == "kv_transfer_failed"
    r = httpx.post(f"{prefill}/internal/prefill", json={"prompt": "x", "request_id": "7"}, timeout=5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"
    wait_at_rest(disagg_stack)
