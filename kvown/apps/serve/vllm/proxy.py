"""The OpenAI front of ``kvown serve vllm``: one client request -> the connector's legs -> D's answer.

    python -m kvown.apps.serve.vllm.proxy --spec JSON   (the stack starts it; prints READY URL)

Owns: ``/v1/completions`` and ``/v1/chat/completions`` (streamed or not), ``/v1/models`` (the decode
instance's), ``/health``, ``/metrics``; minting the request ids; running the leg plan
(``connectors.CONNECTORS[name].legs``, or ``legs.single_legs``) and relaying D's answer.

Rules:
  1. A client that leaves cancels every leg still open: the plan's task is cancelled before D answered;
     after that, closing the relayed stream closes D's response and cancels the companions (P for
     kvown). Each closed connection makes vLLM abort that request (its ``with_cancellation``);
     vLLM's toy proxy leaves P running.
  2. A companion leg that fails aborts D and ends the client's answer with an error (an HTTP status
     before the first byte, an error event in the stream after it).
  3. ``/health`` is 503 until a warm-up completion went through the whole plan, and afterwards unless
     every instance answers its own ``/health``: ready means a completion can be served.
  4. Every upstream call is bounded (connect and read timeouts); request ids are never reused, and the
     answer carries the legs' ``X-Request-Id`` (vLLM's logs name the request by it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, disable_created_metrics, generate_latest

from kvown.apps.serve import protocol as api
from kvown.apps.serve.vllm import legs as lg
from kvown.apps.serve.vllm.connectors import Instance, connector

PATHS = ("/v1/completions", "/v1/chat/completions")
WARMUP_BODY = {"prompt": "warm up", "max_tokens": 1, "temperature": 0}
WARMUP_ATTEMPT_S = 45.0


@dataclass(frozen=True)
class ProxySpec:
    model_name: str
    decode: Instance  # the single instance with --single
    prefill: Instance | None = None
    connector: str | None = None  # None: --single
    host: str = "127.0.0.1"
    port: int = 0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 300.0  # the longest an upstream may stay silent (rule 4)
    warmup_timeout_s: float = 300.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> ProxySpec:
        d = json.loads(text)
        d["decode"] = Instance(**d["decode"])
        d["prefill"] = Instance(**d["prefill"]) if d.get("prefill") else None
        return ProxySpec(**d)


def _error(status: int, message: str, code: str = "invalid_request_error") -> JSONResponse:
    return api.error_response(api.ApiError(status, message, kind=code if status < 500 else "server_error"))


async def first_failure(tasks: list[asyncio.Task[Any]]) -> lg.LegError:
    """Wait until one of ``tasks`` fails and return its error; wait forever if none does (rule 2)."""
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            error = None if t.cancelled() else t.exception()
            if isinstance(error, lg.LegError):
                return error
            if error is not None:
                return lg.LegError(502, f"a leg failed: {type(error).__name__}", leg="prefill")
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


class Proxy:
    def __init__(self, spec: ProxySpec) -> None:
        self.spec = spec
        self.plan: lg.LegPlan = lg.single_legs if spec.connector is None else connector(spec.connector).legs
        self.ids = api.RequestIds()
        self.client: httpx.AsyncClient | None = None
        self.ready_reason: str | None = "warming up"
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        self.requests = Counter("kvown_vllm_proxy_requests", "client requests by outcome", ["outcome"],
                                registry=self.registry)
        self.app = self._build_app()

    @property
    def instances(self) -> list[Instance]:
        return [i for i in (self.spec.prefill, self.spec.decode) if i is not None]

    def _legs(self) -> lg.Legs:
        assert self.client is not None
        return lg.Legs(self.client, self.spec.prefill, self.spec.decode)

    def _request(self, path: str, body: dict[str, Any]) -> lg.Request:
        rid = self.ids.next()
        return lg.Request(path, body, rid, f"kvown-{rid:016x}")

    async def _whole(self, req: lg.Request) -> Response:
        """A non-streamed answer: D's body, read while the companions are watched (rule 2)."""
        answer = await self.plan(self._legs(), req)
        read = asyncio.create_task(answer.response.aread())
        failed = asyncio.create_task(first_failure(answer.companions))
        try:
            await asyncio.wait({read, failed}, return_when=asyncio.FIRST_COMPLETED)
            if not read.done():
                error = failed.result()
                self.requests.labels("failed").inc()
                return JSONResponse(error.body, status_code=error.status)
            raw = read.result()
        except httpx.HTTPError as error:
            self.requests.labels("failed").inc()
            return _error(502, f"decode failed mid-answer: {type(error).__name__}")
        finally:
            await _close(answer, read, failed)
        self.requests.labels("completed").inc()
        return Response(raw, media_type="application/json", headers={"X-Request-Id": req.header_id})

    async def _relay(self, answer: lg.Answer) -> AsyncIterator[bytes]:
        """D's stream to the client; a failed companion ends it with an error event (rule 2)."""
        failed = asyncio.create_task(first_failure(answer.companions))
        chunks = answer.response.aiter_raw()
        outcome = "cancelled"
        try:
            while True:
                nxt = asyncio.ensure_future(anext(chunks))
                await asyncio.wait({nxt, failed}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    outcome = "failed"
                    yield b"data: " + json.dumps(failed.result().body).encode() + b"\n\n"
                    return
                try:
                    data = nxt.result()
                except StopAsyncIteration:
                    outcome = "completed"
                    return
                except httpx.HTTPError as error:
                    outcome = "failed"
                    yield api.error_chunk(api.ApiError(502, f"decode failed mid-stream: {type(error).__name__}",
                                                       kind="server_error"))
                    return
                yield data
        finally:
            self.requests.labels(outcome).inc()
            await _close(answer, failed)

    async def handle(self, request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = api.parse_body(raw)
        except api.ApiError as error:
            self.requests.labels("rejected").inc()
            return api.error_response(error)
        req = self._request(path, body)
        work = asyncio.create_task(self._whole(req) if not req.stream else self.plan(self._legs(), req))
        gone = asyncio.create_task(api.disconnected(request))
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # rule 1: the client left before D answered; cancel every open leg
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, lg.LegError, httpx.HTTPError):
                result = await work
                if isinstance(result, lg.Answer):
                    await _close(result)
            self.requests.labels("cancelled").inc()
            return Response(status_code=499)
        gone.cancel()
        try:
            result = work.result()
        except lg.LegError as error:
            self.requests.labels("failed").inc()
            return JSONResponse(error.body, status_code=error.status)
        if isinstance(result, Response):
            return result
        return api.ClosingStream(self._relay(result), on_close=lambda: None, media_type="text/event-stream",
                                 headers={"X-Request-Id": req.header_id})

    async def warm_up(self) -> None:
        """Rule 3: ready once one completion went through the plan (bounded by warmup_timeout_s)."""
        deadline = time.monotonic() + self.spec.warmup_timeout_s
        while time.monotonic() < deadline:
            try:  # one attempt is bounded: a first request lost to a connector's handshake (NIXL push:
                # its 30 s lease can expire before the handshake ends) must not end the warm-up
                attempt = self._whole(self._request("/v1/completions", dict(WARMUP_BODY)))
                r = await asyncio.wait_for(attempt, WARMUP_ATTEMPT_S)
                if r.status_code == 200:
                    self.ready_reason = None
                    return
                self.ready_reason = f"warm-up completion answered HTTP {r.status_code}"
            except (lg.LegError, httpx.HTTPError, TimeoutError) as error:
                self.ready_reason = f"warm-up completion failed: {type(error).__name__} {error}"
            await asyncio.sleep(0.5)
        self.ready_reason = f"no completion within {self.spec.warmup_timeout_s:.0f} s: {self.ready_reason}"

    async def health(self) -> JSONResponse:
        reason = self.ready_reason
        if reason is None:
            assert self.client is not None
            for inst in self.instances:
                try:
                    ok = (await self.client.get(inst.url + "/health", timeout=2.0)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if not ok:
                    reason = f"{inst.name} does not answer /health"
                    break
        body = {"status": "ok" if reason is None else "starting", "reason": reason,
                "connector": self.spec.connector or "single",
                "instances": {i.name: i.url for i in self.instances}}
        return JSONResponse(body, status_code=200 if reason is None else 503)

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="kvown serve vllm", docs_url=None, redoc_url=None)

        def route(path: str) -> Callable[[Request], Any]:
            async def answer(request: Request) -> Response:
                return await self.handle(request, path)

            return answer

        for path in PATHS:
            app.add_api_route(path, route(path), methods=["POST"])

        @app.get("/v1/models")
        async def models() -> Response:
            assert self.client is not None
            try:
                r = await self.client.get(self.spec.decode.url + "/v1/models")
            except httpx.HTTPError as error:
                return _error(502, f"decode failed: {type(error).__name__}")
            return Response(r.content, status_code=r.status_code, media_type="application/json")

        app.add_api_route("/health", self.health, methods=["GET"])

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4")

        return app


async def _close(answer: lg.Answer, *tasks: asyncio.Task[Any]) -> None:
    """Close D's response and cancel the companions and helper tasks (rule 1)."""
    for t in (*answer.companions, *tasks):
        t.cancel()
    await answer.response.aclose()


def bind(spec: ProxySpec) -> tuple[Proxy, socket.socket, str]:
    """The proxy, its listening socket and URL; the app's lifespan owns the upstream client and the
    warm-up. ``serve_proxy`` runs it; tests run the app in a thread."""
    proxy = Proxy(spec)
    sock = api.listen(spec.host, spec.port)
    url = f"http://{spec.host}:{sock.getsockname()[1]}"

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        timeout = httpx.Timeout(spec.read_timeout_s, connect=spec.connect_timeout_s)
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            proxy.client = client
            warm = asyncio.create_task(proxy.warm_up())
            print(f"READY {url}", flush=True)
            yield
            warm.cancel()

    proxy.app.router.lifespan_context = lifespan
    return proxy, sock, url


def serve_proxy(spec: ProxySpec) -> int:
    proxy, sock, _ = bind(spec)
    return api.serve_app(proxy.app, sock, lambda: None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvown.apps.serve.vllm.proxy")
    p.add_argument("--spec", required=True, help="ProxySpec as JSON (the stack writes it)")
    return serve_proxy(ProxySpec.from_json(p.parse_args(argv).spec))


if __name__ == "__main__":
    sys.exit(main())
