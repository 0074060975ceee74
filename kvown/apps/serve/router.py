"""The router in front of a disaggregated cluster: OpenAI ``/v1/completions`` in, prefill then decode out.

Owns: discovering the servers (etcd prefix watch: a server whose lease expires leaves the pools), picking
a pair per request (decode: least requests in flight; prefill: round robin, same model digest as the
decode), minting the request id, and relaying the decode server's answer (streamed or not) to the client.

Flow per request: validate (the same rules as every server) -> POST prefill ``/internal/prefill`` (the
prefill server computes the prompt's KV into its own blocks and lends them to its KV link) -> POST
decode ``/internal/decode`` with ``kv_transfer = {request_id, prefill}`` (the decode server lends its
own blocks as the destination, waits for the KV to land, then decodes) -> relay.

Rules:
  1. The router never waits without a bound: every upstream call has connect and read timeouts.
  2. A client that leaves closes the upstream decode stream, which cancels the request there (through
     the decode server's KV link). A request abandoned between prefill and decode is aborted on the
     prefill server, so its source blocks go back at once.
  3. Upstream failures become OpenAI error bodies: an HTTP status before the stream started, an error
     event in the stream after it (the official client raises on both). Upstream bytes are untrusted:
     the prefill's answer is validated before use.
  4. Torch-free: the router starts fast and never touches KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily

from kvown.adapters.registry import PrefixWatcher
from kvown.apps.serve.ranks import RankInfo, Registration, parse_rank_info
from kvown.apps.serve import protocol as api
from kvown.apps.serve.protocol import (
    ClosingStream,
    add_status_routes,
    check_port,
    cluster_prefix,
    error_response,
    serve_app,
)
from kvown.core.errors import require_positive_ints, require_positive_seconds


@dataclass
class RouterConfig:
    etcd: str
    name: str = "router-0"
    cluster: str = "default"
    host: str = "127.0.0.1"
    port: int = 0
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 60.0  # the longest an upstream may stay silent (rule 1)
    lease_ttl_s: int = 3

    def __post_init__(self) -> None:
        """``ConfigError`` naming the first bad field, before a socket or an etcd lease exists."""
        check_port(self.port)
        require_positive_ints(self, ("lease_ttl_s",))
        require_positive_seconds(self, ("connect_timeout_s", "request_timeout_s"))


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.started_ns = time.time_ns()
        self.ids = api.RequestIds()  # the epoch grows across restarts (a retry mints a new id)
        self._rr = itertools.count()
        self.inflight: dict[str, int] = {}
        self._lock = threading.Lock()
        self.directory: PrefixWatcher | None = None
        self.registration: Registration | None = None
        self.client: httpx.AsyncClient | None = None
        self._background: set[asyncio.Task[Any]] = set()
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvown_router_requests", "requests by outcome", ["outcome"], registry=self.registry
        )
        self.upstream_errors = Counter(
            "kvown_router_upstream_errors", "failed upstream calls", ["role"], registry=self.registry
        )
        self.ttft = Histogram(
            "kvown_router_time_to_first_byte_seconds",
            "request arrival to first streamed bytes",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.registry.register(self)
        self.app = self._build_app()

    def collect(self) -> Any:
        live = GaugeMetricFamily("kvown_router_servers", "live servers by role", labels=["role"])
        servers = self.servers()
        for role in ("prefill", "decode"):
            live.add_metric([role], sum(1 for i in servers.values() if i.role == role))
        yield live
        yield GaugeMetricFamily(
            "kvown_router_inflight_requests", "requests in flight", value=sum(self.inflight.values())
        )

    def servers(self) -> dict[str, RankInfo]:
        return self.directory.snapshot() if self.directory is not None else {}

    def start(self, http: str) -> None:
        prefix = cluster_prefix(self.config.cluster)
        self.directory = PrefixWatcher(self.config.etcd, prefix, parse=parse_rank_info).start()
        self.registration = Registration(
            self.config.etcd,
            prefix,
            RankInfo(
                name=self.config.name, role="router", pid=os.getpid(), started_ns=self.started_ns, http=http
            ),
            ttl_s=self.config.lease_ttl_s,
            rejoin=True,
        ).start()

    def close(self) -> None:
        if self.registration is not None:
            self.registration.close()
        if self.directory is not None:
            self.directory.stop()

    def candidates(self) -> tuple[list[RankInfo], RankInfo]:
        """(prefills with the decode's model, least-loaded decode); no side effect (health asks too)."""
        servers = sorted(self.servers().values(), key=lambda i: i.name)
        decodes = [i for i in servers if i.role == "decode"]
        if not decodes:
            raise api.ApiError(503, "no decode server is up", kind="server_error", code="no_server")
        with self._lock:
            decode = min(decodes, key=lambda i: self.inflight.get(i.name, 0))
        prefills = [
            i for i in servers if i.role == "prefill" and i.meta.get("model") == decode.meta.get("model")
        ]
        if not prefills:
            raise api.ApiError(
                503,
                "no prefill server with the decode server's model is up",
                kind="server_error",
                code="no_server",
            )
        return prefills, decode

    def pick(self) -> tuple[RankInfo, RankInfo]:
        """(prefill, decode): least-loaded decode, then a round-robin prefill with the same model."""
        prefills, decode = self.candidates()
        return prefills[next(self._rr) % len(prefills)], decode

    @staticmethod
    def limits(decode: RankInfo) -> api.Limits:
        meta = decode.meta
        ok = all(
            isinstance(meta.get(k), t)
            for k, t in (("model_name", str), ("max_model_len", int), ("max_prompt_tokens", int))
        )
        if not ok:
            raise api.ApiError(
                503, f"decode server {decode.name} advertises no model limits", kind="server_error"
            )
        return api.Limits(str(meta["model_name"]), int(meta["max_model_len"]), int(meta["max_prompt_tokens"]))

    async def _abort(self, prefill: RankInfo, request_id: int) -> None:
        assert self.client is not None
        with contextlib.suppress(httpx.HTTPError):
            await self.client.post(
                f"http://{prefill.http}/internal/abort",
                json={"request_id": request_id},
                timeout=self.config.connect_timeout_s,
            )

    async def completion(self, request: Request, raw: bytes, t0: float) -> Response:
        assert self.client is not None
        body = api.parse_body(raw)
        prefill, decode = self.pick()
        job = api.validate(body, self.limits(decode))
        request_id = self.ids.next()
        with self._lock:
            self.inflight[decode.name] = self.inflight.get(decode.name, 0) + 1
        handed_over = False  # once the stream owns the decode slot, its generator gives it back
        prefill_called = False

        def done_with_decode() -> None:
            with self._lock:
                self.inflight[decode.name] -= 1

        try:
            prefill_called = True
            await self._prefill(prefill, job, request_id)  # the first token reaches decode as the link's aux
            upstream_body = {
                **job.to_json(),
                "kv_transfer": {"request_id": request_id, "prefill": prefill.name},
            }
            upstream = self.client.build_request(
                "POST", f"http://{decode.http}/internal/decode", json=upstream_body
            )
            try:
                response = await self.client.send(upstream, stream=True)
            except httpx.HTTPError as error:
                raise await self._upstream_failed("decode", decode, prefill, request_id, error) from None
            if response.status_code != 200:
                raw = await response.aread()
                await response.aclose()
                await self._abort(prefill, request_id)
                return _relay_error(response.status_code, raw, decode.name)
            if not job.stream:
                try:
                    raw = await response.aread()
                except httpx.HTTPError as error:
                    self.upstream_errors.labels("decode").inc()
                    raise api.ApiError(
                        502,
                        f"decode server {decode.name} failed mid-answer: {type(error).__name__}",
                        kind="server_error",
                    ) from None
                finally:
                    await response.aclose()
                self.requests.labels("completed").inc()
                return Response(raw, media_type="application/json")
            handed_over = True
            return ClosingStream(
                self._relay(response, decode.name, t0, done_with_decode),
                on_close=lambda: None,
                media_type="text/event-stream",
            )
        except asyncio.CancelledError:
            # The client left before the stream started (rule 2). The cancelled upstream call closed its
            # connection, so a decode server cancels through its link; the prefill server is told to
            # drop the source blocks now rather than at its publication deadline.
            if prefill_called:
                self._detach(self._abort(prefill, request_id))
            raise
        finally:
            if not handed_over:
                done_with_decode()

    async def _upstream_failed(self, role: str, server: RankInfo, prefill: RankInfo, request_id: int,
                               error: Exception) -> api.ApiError:
        """A call to ``server`` (its ``role``) failed: count it, tell the prefill server to drop the source
        blocks now, and return the 502 to raise."""
        self.upstream_errors.labels(role).inc()
        await self._abort(prefill, request_id)
        return api.ApiError(502, f"{role} server {server.name} failed: {type(error).__name__}", kind="server_error",
                            code="upstream_failed")

    def _detach(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _prefill(self, prefill: RankInfo, job: api.Job, request_id: int) -> int:
        assert self.client is not None
        try:
            r = await self.client.post(
                f"http://{prefill.http}/internal/prefill", json={**job.to_json(), "request_id": request_id}
            )
        except httpx.HTTPError as error:
            raise await self._upstream_failed("prefill", prefill, prefill, request_id, error) from None
        if r.status_code != 200:
            raise _as_api_error(r.status_code, r.content, prefill.name)
        try:
            answer = json.loads(r.content)
            first = answer["first_token"]
            if answer["request_id"] != request_id or type(first) is not int:
                raise ValueError
        except (ValueError, KeyError, TypeError):
            await self._abort(prefill, request_id)
            raise api.ApiError(
                502, f"prefill server {prefill.name} answered nonsense", kind="server_error"
            ) from None
        return int(first)

    async def _relay(
        self, response: httpx.Response, decode: str, t0: float, done: Callable[[], None]
    ) -> AsyncIterator[bytes]:
        outcome, first = "cancelled", True
        try:
            async for data in response.aiter_raw():
                if first:
                    self.ttft.observe(time.perf_counter() - t0)
                    first = False
                yield data
            outcome = "completed"
        except httpx.HTTPError as error:
            outcome = "failed"
            self.upstream_errors.labels("decode").inc()
            yield api.error_chunk(
                api.ApiError(
                    502,
                    f"decode server {decode} failed mid-stream: {type(error).__name__}",
                    kind="server_error",
                )
            )
        finally:
            self.requests.labels(outcome).inc()
            done()
            await response.aclose()  # a client that left closes the upstream: the decode server cancels

    def unready(self) -> str | None:
        """Why a completion cannot be served now (None: it can): the same pairing a request makes."""
        try:
            self.limits(self.candidates()[1])
        except api.ApiError as error:
            return error.message
        return None

    def health(self) -> dict[str, Any]:
        reason = self.unready()
        return {
            "status": "ok" if reason is None else "starting",
            "reason": reason,
            "role": "router",
            "name": self.config.name,
            "pid": os.getpid(),
            "started_ns": self.started_ns,
            "inflight": dict(self.inflight),
            "servers": {
                n: {"role": i.role, "http": i.http, "pid": i.pid, "started_ns": i.started_ns}
                for n, i in self.servers().items()
            },
        }

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="kvown serve router", docs_url=None, redoc_url=None)

        add_status_routes(app, self.health, self.registry)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            names = {str(i.meta.get("model_name")) for i in self.servers().values()
                     if i.role == "decode" and isinstance(i.meta.get("model_name"), str)}
            return api.model_list(sorted(names))

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            t0 = time.perf_counter()
            body = await request.body()
            work = asyncio.create_task(self._answer(request, body, t0))
            gone = asyncio.create_task(api.disconnected(request))
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                gone.cancel()  # the response (maybe a stream) listens for the disconnect from here on
                return work.result()
            work.cancel()  # rule 2: cancel the upstream calls while the client is gone
            with contextlib.suppress(asyncio.CancelledError):
                await work
            self.requests.labels("cancelled").inc()
            return Response(status_code=499)

        return app

    async def _answer(self, request: Request, body: bytes, t0: float) -> Response:
        try:
            return await self.completion(request, body, t0)
        except api.ApiError as error:
            self.requests.labels("rejected" if error.status < 500 else "failed").inc()
            return error_response(error)


def _as_api_error(status: int, raw: bytes, upstream: str) -> api.ApiError:
    """An upstream's error body, re-validated (rule 3): keep its message only if it is well formed."""
    try:
        err = json.loads(raw)["error"]
        message, kind = str(err["message"])[:500], str(err.get("type", "server_error"))[:64]
        param = err.get("param") if isinstance(err.get("param"), str) else None
        code = err.get("code") if isinstance(err.get("code"), str) else None
    except (ValueError, KeyError, TypeError):
        message, kind, param, code = f"{upstream} answered HTTP {status}", "server_error", None, None
    status = status if 400 <= status < 600 else 502
    return api.ApiError(status, message, param=param, code=code, kind=kind)


def _relay_error(status: int, raw: bytes, upstream: str) -> Response:
    return error_response(_as_api_error(status, raw, upstream))


def serve_router(config: RouterConfig, *, announce: Callable[[str], None] | None = None) -> int:
    """Run the router until SIGINT/SIGTERM; prints ``READY http://host:port`` once it serves."""
    router = Router(config)
    sock = api.listen(config.host, config.port)
    http = f"{config.host}:{sock.getsockname()[1]}"

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        await asyncio.to_thread(router.start, http)
        timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s)
        async with httpx.AsyncClient(
            timeout=timeout, limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64)
        ) as client:
            router.client = client
            (announce or (lambda url: print(f"READY {url}", flush=True)))(f"http://{http}")
            yield

    router.app.router.lifespan_context = lifespan
    return serve_app(router.app, sock, router.close)
