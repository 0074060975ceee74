"""The router's OpenAI surface: ``/health`` is 503 until a completion can be served (before, it said ok
~3 s before the first request could be routed, which answered 503 "no decode server is up") and
``/v1/models`` lists the decode servers' model (it answered 404)."""

from __future__ import annotations

import secrets
import time

import httpx
import pytest
from servekit import need_etcd

from kvown.apps.serve.ranks import RankInfo
from kvown.apps.serve.etcd import EtcdProcess
from kvown.apps.serve.local import ServerProcess
from kvown.apps.serve.router import Router, RouterConfig

META = {"model": "d1", "model_name": "kvown-tiny", "max_model_len": 1024, "max_prompt_tokens": 512}


class FakeDirectory:
    def __init__(self) -> None:
        self.ranks: dict[str, RankInfo] = {}

    def snapshot(self) -> dict[str, RankInfo]:
        return dict(self.ranks)

    def add(self, name: str, role: str, meta: dict) -> None:
        self.ranks[name] = RankInfo(name=name, role=role, pid=1, started_ns=1, http="127.0.0.1:1", meta=meta)


def health_follows_pairing(router: Router) -> bool:
    """503 with no server, with a decode alone, with a prefill of another model; 200 with a pair."""
    d = FakeDirectory()
    router.directory = d  # type: ignore[assignment]
    states = [router.health()["status"]]
    d.add("decode-0", "decode", META)
    states.append(router.health()["status"])
    d.add("prefill-0", "prefill", {**META, "model": "other"})
    states.append(router.health()["status"])
    d.add("prefill-1", "prefill", META)
    states.append(router.health()["status"])
    return states == ["starting", "starting", "starting", "ok"] and router.pick()[0].name == "prefill-1"


def test_router_health_follows_what_a_request_would_find():
    assert health_follows_pairing(Router(RouterConfig(etcd="http://127.0.0.1:1")))


def test_router_health_check_catches_a_router_always_ok(monkeypatch):
    monkeypatch.setattr(Router, "unready", lambda self: None)  # mutant: the old always-ok health
    assert not health_follows_pairing(Router(RouterConfig(etcd="http://127.0.0.1:1")))


def test_first_ok_health_serves_a_completion_and_models_list_the_model(tmp_path):
    """Real processes: poll the router's /health while the servers start; the first 200 must be
    followed by a served completion, and /v1/models answers throughout."""
    need_etcd()
    with EtcdProcess(log_path=tmp_path / "etcd.log") as etcd:
        common = ["--etcd", etcd.endpoint, "--cluster", "surface", "--lease-ttl", "2"]
        router = ServerProcess("router", [*common, "--name", "router-0"], tmp_path / "router.log")
        procs = [router]
        try:
            url = router.wait_ready(30)
            first = httpx.get(f"{url}/health", timeout=5)
            assert first.status_code == 503 and first.json()["reason"] == "no decode server is up"
            assert httpx.get(f"{url}/v1/models", timeout=5).json() == {"object": "list", "data": []}
            env = {"KVOWN_JOB_KEY": secrets.token_hex(32)}
            for name, role, rank in (("prefill-0", "prefill", "0"), ("decode-0", "decode", "1")):
                procs.append(ServerProcess(role, [*common, "--name", name, "--rank", rank],
                                           tmp_path / f"{name}.log", env))
            deadline = time.monotonic() + 90
            while httpx.get(f"{url}/health", timeout=5).status_code != 200:
                assert time.monotonic() < deadline and all(p.alive() for p in procs), "router never ready"
                time.sleep(0.02)
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
            assert r.status_code == 200, r.text
            models = httpx.get(f"{url}/v1/models", timeout=5).json()
            assert [m["id"] for m in models["data"]] == ["kvown-tiny"]
        finally:
            for p in reversed(procs):
                p.stop()


@pytest.mark.parametrize("path", ["/health"])
def test_server_health_is_still_200(disagg_stack, path):
    for p in disagg_stack.procs.values():
        assert httpx.get(f"{p.url}{path}", timeout=5).status_code == 200
