"""kvown's vLLM proxy against fake vLLM instances (fakevllm.py, the adapter seam): the leg plans send
what each connector expects, a client that leaves aborts every open leg, kvown's plan sends both legs
at once and aborts D when P fails, and /health waits for a completion. Each safety property is also
checked against a mutant of the proxy that breaks it. Fast: no vLLM, no model."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time

import httpx
import pytest
from fakevllm import AppThread, FakeVllm

from kvown.apps.serve.vllm import legs as lg
from kvown.apps.serve.vllm import proxy as px
from kvown.apps.serve.vllm.connectors import BASELINE_FIX_ENV, CONNECTORS, Instance, StackInfo
from kvown.core.errors import ConfigError


@contextlib.contextmanager
def proxied(connector: str | None, p: FakeVllm | None, d: FakeVllm, *, ready: bool = True):
    """Fakes for P and D, and the proxy (in this process, so a test can patch it) in front of them."""
    with contextlib.ExitStack() as stack:
        dt = stack.enter_context(AppThread(d.app()))
        pt = stack.enter_context(AppThread(p.app())) if p is not None else None
        spec = px.ProxySpec("tiny", Instance("decode-0", "decode", dt.port, 0),
                            Instance("prefill-0", "prefill", pt.port, 0) if pt else None, connector,
                            read_timeout_s=20, warmup_timeout_s=20)
        proxy, sock, url = px.bind(spec)
        stack.enter_context(AppThread(proxy.app, sock))
        if ready:
            _wait(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, 10)
            for fake in (p, d):
                if fake is not None:
                    fake.seen.clear()  # forget the warm-up
        yield url, proxy


def _wait(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def _stream_some(url: str, body: dict, chunks: int) -> list[dict]:
    got: list[dict] = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=20) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got.append(json.loads(line[6:]))
                if len(got) >= chunks:
                    break
    return got


# ---- what each plan sends ------------------------------------------------------------------------

def test_pull_plan_sends_p_one_token_then_d_p_params():
    p, d = FakeVllm("p"), FakeVllm("d")
    with proxied("nixl", p, d) as (url, _):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream_options": {}},
                       timeout=20)
    assert r.status_code == 200, r.text
    (ps,), (ds,) = p.seen, d.seen
    assert ps.body["max_tokens"] == 1 and ps.body["stream"] is False and "stream_options" not in ps.body
    assert ps.body["kv_transfer_params"] == {"do_remote_decode": True}
    assert ds.body["kv_transfer_params"]["remote_block_ids"] == [1, 2] and ds.body["max_tokens"] == 5
    assert ps.headers["x-request-id"] == ds.headers["x-request-id"]
    assert ds.t_in >= ps.t_out  # pull: D only after P answered


def test_push_plan_gives_d_coordinates_only():
    p, d = FakeVllm("p"), FakeVllm("d")
    with proxied("nixl-push", p, d) as (url, _):
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=20).status_code == 200
    params = d.seen[0].body["kv_transfer_params"]
    assert "remote_block_ids" not in params and params["do_remote_prefill"] is True
    assert params["remote_engine_id"] == "kvown-prefill-0"


def kvown_legs_overlap(p: FakeVllm, d: FakeVllm) -> bool:
    with proxied("kvown", p, d) as (url, _):
        for _ in range(2):
            assert httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                              timeout=20).status_code == 200
    rids = set()
    for ps, ds in zip(p.seen, d.seen, strict=True):
        rid = ps.body["kv_transfer_params"]["kvown_request_id"]
        assert ds.body["kv_transfer_params"] == {"do_remote_prefill": True, "kvown_request_id": rid,
                                                 "kvown_writer": 0}
        assert ps.headers["x-request-id"] == ds.headers["x-request-id"]
        rids.add(rid)
    assert len(rids) == 2  # one id per client request, never reused
    return all(ds.t_in < ps.t_out for ps, ds in zip(p.seen, d.seen, strict=True))


def test_kvown_plan_sends_both_legs_at_once():
    assert kvown_legs_overlap(FakeVllm("p", delay_s=0.5), FakeVllm("d"))


def test_kvown_overlap_check_catches_a_sequential_plan(monkeypatch):
    async def sequential(legs, req):  # mutant: P's answer awaited before D is asked, as in pull mode
        rid = req.request_id
        await legs.prefill(req, {"do_remote_decode": True, "kvown_request_id": rid})
        return lg.Answer(await legs.decode(req, {"do_remote_prefill": True, "kvown_request_id": rid,
                                                 "kvown_writer": legs.prefill_instance.kvown_rank}))

    monkeypatch.setitem(CONNECTORS, "kvown", dataclasses.replace(CONNECTORS["kvown"], legs=sequential))
    assert not kvown_legs_overlap(FakeVllm("p", delay_s=0.5), FakeVllm("d"))


# ---- a failed companion aborts D ------------------------------------------------------------------

def p_failure_aborts_d() -> bool:
    p, d = FakeVllm("p", delay_s=0.3, fail_status=500), FakeVllm("d", token_delay_s=0.05)
    with proxied("kvown", p, d, ready=False) as (url, _):
        events = _stream_some(url, {"prompt": "x", "max_tokens": 200}, 1000)
        _wait(lambda: d.seen and d.seen[-1].t_out is not None, 5)
    errored = any("error" in e for e in events)
    return errored and d.seen[-1].aborted and len(events) < 100


def test_kvown_plan_aborts_decode_when_prefill_fails():
    assert p_failure_aborts_d()


def test_p_failure_check_catches_a_proxy_that_ignores_the_prefill(monkeypatch):
    async def never(tasks):  # mutant: the companion's failure is never looked at
        await px.asyncio.Event().wait()

    monkeypatch.setattr(px, "first_failure", never)
    assert not p_failure_aborts_d()


# ---- a client that leaves aborts every open leg ---------------------------------------------------

def disconnect_aborts_decode(connector: str | None) -> bool:
    p, d = FakeVllm("p"), FakeVllm("d", token_delay_s=0.05)
    with proxied(connector, p if connector else None, d) as (url, _):
        assert len(_stream_some(url, {"prompt": "x", "max_tokens": 400}, 3)) == 3
        return _wait(lambda: d.seen and d.seen[-1].aborted, 5)


@pytest.mark.parametrize("connector", [None, "nixl", "nixl-push", "kvown"])
def test_disconnect_mid_stream_aborts_decode(connector):
    assert disconnect_aborts_decode(connector)


def test_disconnect_check_catches_a_proxy_that_keeps_the_upstream_open(monkeypatch):
    async def keep_open(answer, *tasks):  # mutant: neither D's response closed nor companions cancelled
        for t in tasks:
            t.cancel()

    monkeypatch.setattr(px, "_close", keep_open)
    assert not disconnect_aborts_decode("nixl")


def disconnect_during_prefill_aborts_it() -> bool:
    p, d = FakeVllm("p", delay_s=3.0), FakeVllm("d")
    with proxied("nixl", p, d) as (url, _):
        with contextlib.suppress(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=0.5)
        aborted = _wait(lambda: p.seen and p.seen[-1].aborted, 5)
        time.sleep(0.3)
        return aborted and not d.seen  # D never asked: the request ended with its prefill


def test_disconnect_during_prefill_aborts_prefill_and_never_reaches_decode():
    assert disconnect_during_prefill_aborts_it()


def test_prefill_disconnect_check_catches_a_proxy_deaf_to_disconnects(monkeypatch):
    async def deaf(request):  # mutant: the proxy never notices that the client left
        await px.asyncio.Event().wait()

    monkeypatch.setattr(px.api, "disconnected", deaf)
    assert not disconnect_during_prefill_aborts_it()


# ---- health waits for a completion -----------------------------------------------------------------

def health_waits_for_a_completion() -> bool:
    d = FakeVllm("d", fail_status=503)
    with proxied(None, None, d, ready=False) as (url, _):
        time.sleep(0.8)
        early = httpx.get(f"{url}/health", timeout=5)
        d.fail_status = None
        ready = _wait(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, 10)
        d.healthy = False
        late = httpx.get(f"{url}/health", timeout=5).status_code
    return early.status_code == 503 and early.json()["status"] == "starting" and ready and late == 503


def test_health_is_503_until_a_completion_went_through():
    assert health_waits_for_a_completion()


def test_health_check_catches_a_proxy_ready_at_start(monkeypatch):
    async def instant(self):  # mutant: ready without a completion
        self.ready_reason = None

    monkeypatch.setattr(px.Proxy, "warm_up", instant)
    assert not health_waits_for_a_completion()


def test_models_and_bad_bodies():
    with proxied(None, None, FakeVllm("d")) as (url, _):
        assert httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"] == "tiny"
        r = httpx.post(f"{url}/v1/completions", content=b"[1, 2]", timeout=5)
        assert r.status_code == 400 and r.json()["error"]["message"]


def test_upstream_error_is_relayed_with_its_status():
    with proxied("nixl", FakeVllm("p", fail_status=400), FakeVllm("d"), ready=False) as (url, _):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=20)
    assert r.status_code == 400 and r.json()["error"]["message"] == "p failed"


# ---- the connector table ---------------------------------------------------------------------------

def test_connector_configs():
    info = StackInfo("c", "http://127.0.0.1:2379", Instance("prefill-0", "prefill", 1, 2),
                     Instance("decode-0", "decode", 3, 4))
    nixl = CONNECTORS["nixl"].kv_config(info.prefill, info)
    assert nixl["kv_connector"] == "NixlConnector" and nixl["kv_role"] == "kv_producer"
    assert CONNECTORS["nixl-push"].kv_config(info.decode, info)["kv_role"] == "kv_consumer"
    kv = CONNECTORS["kvown"].kv_config(info.decode, info)
    assert kv["kv_connector_module_path"] == "kvown.integrations.vllm" and kv["kv_role"] == "kv_consumer"
    extra = {"etcd": "http://127.0.0.1:2379", "cluster": "c", "rank": 1}  # decode is kvown rank 1
    assert kv["kv_connector_extra_config"] == extra
    assert CONNECTORS["nixl"].instance_env() == {BASELINE_FIX_ENV: "1"}
    assert CONNECTORS["kvown"].instance_env() == {}  # kvown runs its own agent: no baseline fix
    with pytest.raises(ConfigError) as e:
        CONNECTORS["nixl"].kv_config(Instance("single-0", "single", 1, 2), info)
    assert e.value.field == "role"


def test_baseline_fix_env_is_the_plugins():
    from kvown.integrations.vllm import plugin

    assert plugin.BASELINE_FIX_ENV == BASELINE_FIX_ENV
