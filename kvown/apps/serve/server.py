"""The reference inference server: one process, one model, its own paged KV cache and block allocator.

Owns: the HTTP app of a ``single``, ``prefill`` or ``decode`` server, its model thread, its
``BlockAllocator`` (the only allocator of its KV blocks), its KV link (``link.Link``; prefill and decode roles),
its etcd registration and (decode) its view of the prefill servers.

Endpoints (every role): ``POST /v1/completions`` runs a whole request here (prefill and decode in one
process, no transfer: what ``serve local --single`` serves), ``GET /health``, ``GET /metrics``.
Prefill role: ``POST /internal/prefill`` (prefill into own blocks, lend them to the link, answer with
the first token) and ``POST /internal/abort``. Decode role: ``POST /internal/decode`` (lend blocks to
the link as the destination, wait for the KV to land, then decode from those blocks and stream).

Rules:
  1. Blocks of a request are freed (or given back to the link) only once no model computation can
     touch them: cleanup waits for the request's in-flight forward, even when the client is gone.
  2. A client disconnect (or a landing timeout) cancels the request through the link: lent blocks come
     back through ``on_returned`` once the writer is quiescent, never earlier.
  3. Bad requests are refused before any block is allocated (protocol.py rule 1); a failure of one
     request never stops the server.
  4. One model thread: forwards of all requests run one at a time, each for one request (model.py
     rule 3); the asyncio loop only waits.

Invariants:
  INV-SRV-1  At rest (no request in flight): allocator ``free == total`` and link owned/held/sending 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvown.adapters.registry import PrefixWatcher
from kvown.apps.serve.ranks import RankInfo, Registration, parse_rank_info
from kvown.apps.serve import protocol as api
from kvown.apps.serve.kvlink import KVLink
from kvown.apps.serve.link import Link, RecvHandle, TransferFailed
from kvown.apps.serve.model import BlockAllocator, ModelConfig, OutOfBlocks, PagedKVCache, TinyLM, sample
from kvown.apps.serve.protocol import (
    ClosingStream,
    add_status_routes,
    check_port,
    cluster_prefix,
    error_response,
    serve_app,
)
from kvown.core.errors import (
    ConfigError,
    KvownError,
    PeerProtocolError,
    require_positive_ints,
    require_positive_seconds,
)

ROLES = ("single", "prefill", "decode")
LINKS = ("kvown", "loopback")


@dataclass
class ServeConfig:
    role: str
    name: str
    model: ModelConfig = field(default_factory=ModelConfig)
    model_name: str = "kvown-tiny"
    host: str = "127.0.0.1"
    port: int = 0
    etcd: str | None = None
    cluster: str = "default"
    num_blocks: int = 2048
    device: str = "auto"
    threads: int = 1
    max_prompt_tokens: int = 512
    landing_timeout_s: float = 30.0
    publish_timeout_s: float = 30.0
    lease_ttl_s: int = 3
    link_pace_s: float = 0.0  # tests only: a slow fabric (slow WRITEs / DATA frames), to cancel mid-transfer
    link: str = "kvown"  # "kvown" (NIXL WRITEs, ownership with proof) or "loopback" (the reference TCP link)
    kvown_rank: int = -1  # this server's kvown rank, unique in the cluster (kvown link only)

    def __post_init__(self) -> None:
        """``ConfigError`` naming the first bad field, before a model, a pool or a socket exists."""
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {', '.join(ROLES)}", field="role", value=self.role)
        if self.link not in LINKS:
            raise ConfigError(f"link must be one of {', '.join(LINKS)}", field="link", value=self.link)
        require_positive_ints(self, ("num_blocks", "threads", "max_prompt_tokens", "lease_ttl_s"))
        check_port(self.port)
        if self.device != "auto" and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError("device must be auto, cpu, cuda or cuda:N", field="device", value=self.device)
        require_positive_seconds(self, ("landing_timeout_s", "publish_timeout_s"))


class ClientGone(Exception):
    """The client disconnected while we were working for it."""


class _Req:
    """One request's blocks and in-flight forward (rule 1)."""

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id
        self.own: list[int] = []  # IN_USE blocks the server frees itself
        self.handle: RecvHandle | None = None  # decode: the destination lent to the link
        self.inflight: concurrent.futures.Future[Any] | None = None
        self.lock = threading.Lock()
        self.finished = False
        self.completed = False


class Server:
    """One server process's state. Called: built once in ``serve``; request handlers on the asyncio
    loop; the model runs on the ``model`` thread; the link's callbacks on link threads."""

    def __init__(self, config: ServeConfig) -> None:
        if config.role not in ROLES:
            raise KvownError("unknown role", field="role", value=config.role)
        self.config = config
        torch.set_num_threads(config.threads)
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device
        self.model = TinyLM(config.model, device=device)
        self.cache = PagedKVCache(config.model, config.num_blocks, device=device)
        self.alloc = BlockAllocator(config.num_blocks)
        self.compute = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model")
        self.limits = api.Limits(
            config.model_name,
            config.model.max_model_len,
            min(config.max_prompt_tokens, config.model.max_model_len - 1),
        )
        self.started_ns = time.time_ns()
        self.link: Link | None = self._open_link(config)
        self.directory: PrefixWatcher | None = None
        self.registration: Registration | None = None
        self.inflight = 0
        self._seq = 0
        disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series: they only add noise to a scrape
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvown_serve_requests", "requests by outcome", ["outcome"], registry=self.registry
        )
        self.generated = Counter("kvown_serve_generated_tokens", "tokens generated", registry=self.registry)
        self.ttft = Histogram(
            "kvown_serve_time_to_first_token_seconds",
            "request arrival to first token sent",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.link_returns = Counter(
            "kvown_serve_link_returned_blocks",
            "blocks the KV link gave back",
            ["outcome"],
            registry=self.registry,
        )
        self.registry.register(self)  # ``collect`` below: gauges read at scrape time
        self.app = self._build_app()

    # --------------------------------------------------------------------------------- plumbing

    def _open_link(self, config: ServeConfig) -> Link | None:
        """The KV link of a prefill or decode server (kvown's, or the loopback one); none when single."""
        if config.role != "single" and config.link == "kvown":
            from kvown.apps.serve.kvownlink import KvownLink

            if config.etcd is None or config.kvown_rank < 0:
                raise KvownError("the kvown link needs --etcd and --rank", field="kvown_rank")
            return KvownLink(
                config.name,
                self.cache,
                on_returned=self._link_returned,
                etcd=config.etcd,
                cluster=config.cluster,
                rank=config.kvown_rank,
                role=config.role,
                rank_of=self._rank_of,
                publish_timeout_s=config.publish_timeout_s,
                transfer_timeout_s=config.landing_timeout_s,
                slow_writes_ms=round(config.link_pace_s * 1000),
                lease_ttl_s=config.lease_ttl_s,
            )
        if config.role != "single":
            link = KVLink(
                config.name,
                self.cache,
                on_returned=self._link_returned,
                resolve=self._resolve,
                host=config.host,
                publish_timeout_s=config.publish_timeout_s,
            )
            link.pace_s = config.link_pace_s
            return link
        return None

    def collect(self) -> Any:
        blocks = GaugeMetricFamily("kvown_serve_kv_blocks", "KV blocks by allocator state", labels=["state"])
        for state, n in self.alloc.statistics().items():
            blocks.add_metric([state], n)
        yield blocks
        yield GaugeMetricFamily("kvown_serve_inflight_requests", "requests in flight", value=self.inflight)
        if self.link is not None:
            stats = self.link.statistics()
            link = GaugeMetricFamily(
                "kvown_serve_link_blocks", "blocks lent to the KV link", labels=["state"]
            )
            for state in ("owned", "held", "sending"):
                link.add_metric([state], stats[state])
            yield link
            moved = CounterMetricFamily("kvown_serve_link_bytes", "KV bytes moved", labels=["direction"])
            moved.add_metric(["in"], stats["bytes_in"])
            moved.add_metric(["out"], stats["bytes_out"])
            yield moved
            yield CounterMetricFamily(
                "kvown_serve_link_protocol_errors",
                "malformed frames from peers",
                value=stats["protocol_errors"],
            )

    def _link_returned(self, request_id: int, blocks: tuple[int, ...], outcome: str) -> None:
        """The link's one way to give lent blocks back (any link thread)."""
        self.alloc.give_back(blocks)
        self.link_returns.labels(outcome).inc(len(blocks))

    def _resolve(self, name: str) -> str | None:
        info = self.directory.get(name) if self.directory is not None else None
        return info.link if info is not None and info.role == "prefill" else None

    def _rank_of(self, name: str) -> int | None:
        info = self.directory.get(name) if self.directory is not None else None
        rank = info.meta.get("kvown_rank") if info is not None and info.role == "prefill" else None
        return rank if type(rank) is int else None

    def _on_peer_deleted(self, name: str) -> None:
        if self.link is not None:
            self.link.peer_gone(name)

    def info(self, http: str) -> RankInfo:
        c = self.config
        return RankInfo(
            name=c.name,
            role=c.role if c.role != "single" else "rank",
            pid=os.getpid(),
            started_ns=self.started_ns,
            http=http,
            link=self.link.address if self.link else "",
            meta={
                **({"kvown_rank": c.kvown_rank} if c.link == "kvown" else {}),
                "model": c.model.digest(),
                "model_name": c.model_name,
                "max_model_len": self.limits.max_model_len,
                "max_prompt_tokens": self.limits.max_prompt_tokens,
            },
        )

    def start(self, http: str) -> None:
        """Join the cluster (etcd): register under a lease; a decode server also watches the prefill
        servers so a dead one is dropped (rule: lease expiry, see registry.py rule 3)."""
        if self.config.etcd is None:
            return
        prefix = cluster_prefix(self.config.cluster)
        if self.config.role == "decode":
            self.directory = PrefixWatcher(self.config.etcd, prefix, on_delete=self._on_peer_deleted,
                                           parse=parse_rank_info).start()
        self.registration = Registration(  # rejoin: a server starved past its TTL comes back to the router
            self.config.etcd, prefix, self.info(http), ttl_s=self.config.lease_ttl_s, rejoin=True
        ).start()

    def close(self) -> None:
        if self.registration is not None:
            self.registration.close()
        if self.directory is not None:
            self.directory.stop()
        if self.link is not None:
            self.link.close()
        self.compute.shutdown(wait=True, cancel_futures=True)

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "role": self.config.role,
            "name": self.config.name,
            "pid": os.getpid(),
            "started_ns": self.started_ns,
            "model": self.config.model.digest(),
            "device": self.device,
            "inflight": self.inflight,
            "blocks": self.alloc.statistics(),
            "link": self.link.statistics() if self.link is not None else None,
        }

    # --------------------------------------------------------------------------- request pieces
    async def _forward(self, req: _Req, tokens: list[int], start: int, table: list[int]) -> torch.Tensor:
        fut = self.compute.submit(self.model.forward, tokens, start, table, self.cache)
        req.inflight = fut
        return await asyncio.wrap_future(fut)

    def _finish(self, req: _Req) -> None:
        """Idempotent. Frees the request's blocks once its in-flight forward is over (rule 1)."""
        with req.lock:
            if req.finished:
                return
            req.finished = True
        fut = req.inflight
        if fut is not None and not fut.done():
            fut.add_done_callback(lambda _: self._release(req))
        else:
            self._release(req)

    def _release(self, req: _Req) -> None:
        if req.own:
            self.alloc.free(req.own)
            req.own = []
        with req.lock:
            handle = req.handle
        if handle is not None and self.link is not None:
            if req.completed:
                self.link.release(req.request_id)
            else:
                self.link.cancel(req.request_id)  # rule 2: back only once the writer is quiescent

    def _allocate(self, n: int) -> list[int]:
        try:
            return self.alloc.allocate(n)
        except OutOfBlocks as error:
            raise api.ApiError(
                503, f"out of KV blocks: {error}", kind="server_error", code="overloaded"
            ) from None

    def _next_id(self) -> int:
        self._seq += 1
        return (os.getpid() << 32) | self._seq  # local ids only; routed requests carry the router's id

    async def _respond(
        self, job: api.Job, req: _Req, first: int, table: list[int], request: Request, t0: float
    ) -> Response:
        """Generate from ``first`` on, reading and writing KV through ``table``; stream or not.

        Ownership: takes over ``req``: whatever happens, ``_finish(req)`` runs exactly once.
        """
        created = api.now_s()

        async def tokens() -> AsyncIterator[int]:
            yield first
            tok = first
            for step in range(1, job.max_tokens):
                logits = await self._forward(req, [tok], len(job.prompt_ids) + step - 1, table)
                tok = sample(logits, temperature=job.temperature, top_p=job.top_p, seed=job.seed, step=step)
                yield tok

        self.inflight += 1
        if job.stream:
            return self._stream(job, req, tokens, t0, created)
        return await self._whole(job, req, tokens, request, t0, created)

    def _stream(
        self, job: api.Job, req: _Req, tokens: Callable[[], AsyncIterator[int]], t0: float, created: int
    ) -> Response:
        """The streamed answer of ``_respond``: settles the request once, from the body or on close."""
        n_prompt, model_name = len(job.prompt_ids), self.config.model_name
        settled = False

        def settle(outcome: str) -> None:  # once per request, from the body or from on_close
            nonlocal settled
            if not settled:
                settled = True
                self.requests.labels(outcome).inc()
                self.inflight -= 1
            self._finish(req)

        async def body() -> AsyncIterator[bytes]:
            outcome = "cancelled"
            try:
                stop, count, finish = api.StopMatcher(job.stop), 0, "length"
                async for tok in tokens():
                    count += 1
                    text = stop.feed(chr(tok))
                    if count == 1:
                        self.ttft.observe(time.perf_counter() - t0)
                    if text:
                        yield api.chunk(req.request_id, model_name, text, None, created)
                    if stop.stopped:
                        finish = "stop"
                        break
                req.completed = True
                self._finish(req)  # the blocks are free before the last bytes go out
                self.generated.inc(count)
                yield api.chunk(req.request_id, model_name, stop.flush(), finish, created)
                if job.include_usage:
                    yield api.usage_chunk(req.request_id, model_name, created, n_prompt, count)
                yield b"data: [DONE]\n\n"
                outcome = "completed"
            except (KvownError, RuntimeError) as error:  # a model failure mid-stream
                outcome = "failed"
                yield api.error_chunk(
                    api.ApiError(500, f"generation failed: {error}", kind="server_error")
                )
            finally:
                settle(outcome)

        return ClosingStream(body(), on_close=lambda: settle("cancelled"), media_type="text/event-stream")

    async def _whole(
        self, job: api.Job, req: _Req, tokens: Callable[[], AsyncIterator[int]], request: Request, t0: float,
        created: int,
    ) -> Response:
        """The non-streamed answer of ``_respond``: one JSON body, the request settled in ``finally``."""
        outcome = "cancelled"
        try:
            stop, count, finish = api.StopMatcher(job.stop), 0, "length"
            async for tok in tokens():
                count += 1
                stop.feed(chr(tok))
                if stop.stopped:
                    finish = "stop"
                    break
                if await request.is_disconnected():
                    raise ClientGone
            stop.flush()
            req.completed = True
            self.generated.inc(count)
            self.ttft.observe(time.perf_counter() - t0)
            outcome = "completed"
            return JSONResponse(api.completion(
                req.request_id, self.config.model_name, stop.text, finish, len(job.prompt_ids), count, created
            ))
        except (KvownError, RuntimeError) as error:
            outcome = "failed"
            raise api.ApiError(500, f"generation failed: {error}", kind="server_error") from None
        finally:
            self.inflight -= 1
            if outcome != "failed":  # _guard counts the failure
                self.requests.labels(outcome).inc()
            self._finish(req)

    # ---------------------------------------------------------------------------------- flows
    async def local_completion(self, job: api.Job, request: Request, t0: float) -> Response:
        """Prefill and decode here, in the same blocks: no transfer."""
        req = _Req(self._next_id())
        req.own = self._allocate(self.config.model.blocks_for(len(job.prompt_ids) + job.max_tokens - 1))
        try:
            logits = await self._forward(req, list(job.prompt_ids), 0, req.own)
        except BaseException:
            self._finish(req)
            raise
        first = sample(logits, temperature=job.temperature, top_p=job.top_p, seed=job.seed, step=0)
        return await self._respond(job, req, first, req.own, request, t0)

    async def prefill(self, job: api.Job, request_id: int) -> dict[str, Any]:
        """Prefill into own blocks, lend them to the link, return the first token (also sent as aux)."""
        assert self.link is not None
        req = _Req(request_id)
        req.own = self._allocate(self.config.model.blocks_for(len(job.prompt_ids)))
        try:
            logits = await self._forward(req, list(job.prompt_ids), 0, req.own)
        except BaseException:
            self._finish(req)
            raise
        first = sample(logits, temperature=job.temperature, top_p=job.top_p, seed=job.seed, step=0)
        blocks, req.own = req.own, []
        self.alloc.lend(blocks)
        try:
            self.link.send(request_id, blocks, aux=json.dumps({"first_token": first}).encode())
        except KvownError:
            self.alloc.give_back(blocks)
            raise api.ApiError(409, "request id already in use", param="request_id") from None
        self.requests.labels("prefilled").inc()
        return {
            "request_id": request_id,
            "first_token": first,
            "prompt_tokens": len(job.prompt_ids),
            "prefill": self.config.name,
        }

    def _open(self, req: _Req, dest: list[int], writer: str) -> RecvHandle:
        """Worker thread: publish the destination; if the client left meanwhile, cancel at once."""
        assert self.link is not None
        try:
            handle = self.link.receive(req.request_id, dest, writer)
        except BaseException:
            self.alloc.give_back(dest)  # nothing was published: the blocks are still ours
            raise
        with req.lock:
            req.handle = handle
            gone = req.finished
        if gone:
            self.link.cancel(req.request_id)
        return handle

    async def decode(
        self, job: api.Job, request_id: int, writer: str, request: Request, t0: float
    ) -> Response:
        """Receive the prompt's KV from ``writer`` into own blocks, then decode from them."""
        c = self.config.model
        req = _Req(request_id)
        blocks = self._allocate(c.blocks_for(len(job.prompt_ids) + job.max_tokens - 1))
        n_dest = c.blocks_for(len(job.prompt_ids))
        dest, req.own = blocks[:n_dest], blocks[n_dest:]
        self.alloc.lend(dest)
        try:
            handle = await asyncio.to_thread(self._open, req, dest, writer)
            landed: asyncio.Future[Any] = asyncio.wrap_future(handle.landed)
            gone: asyncio.Future[Any] = asyncio.ensure_future(api.disconnected(request))
            try:
                await asyncio.wait(
                    {landed, gone}, timeout=self.config.landing_timeout_s, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                gone.cancel()  # from here on the response listens for the disconnect
            if not landed.done():
                if gone.done() and not gone.cancelled():
                    raise ClientGone  # cancel now, mid-transfer if need be (rule 2)
                raise api.ApiError(
                    504,
                    f"KV did not land within {self.config.landing_timeout_s} s",
                    kind="server_error",
                    code="kv_timeout",
                )
            aux = landed.result()
        except TransferFailed as error:
            self._finish(req)
            raise api.ApiError(
                502,
                f"KV transfer from {writer} failed: {error.reason}",
                kind="server_error",
                code="kv_transfer_failed",
            ) from None
        except PeerProtocolError as error:
            self._finish(req)
            raise api.ApiError(
                502, f"KV link refused {writer}: {error}", kind="server_error", code="kv_link_refused"
            ) from None
        except BaseException:
            self._finish(req)
            raise
        first = _parse_aux(aux)
        return await self._respond(job, req, first, dest + req.own, request, t0)

    # ------------------------------------------------------------------------------------ app
    def _build_app(self) -> FastAPI:
        app = FastAPI(title=f"kvown serve {self.config.role}", docs_url=None, redoc_url=None)
        role = self.config.role

        add_status_routes(app, self.health, self.registry)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            t0 = time.perf_counter()
            return await self._guard(lambda: self._local(request, t0))

        if role == "prefill":

            @app.post("/internal/prefill")
            async def internal_prefill(request: Request) -> Response:
                async def go() -> Response:
                    body = api.parse_body(await request.body())
                    rid = _request_id(body.pop("request_id", None))
                    return JSONResponse(await self.prefill(api.validate(body, self.limits), rid))

                return await self._guard(go)

            @app.post("/internal/abort")
            async def internal_abort(request: Request) -> Response:
                async def go() -> Response:
                    body = api.parse_body(await request.body())
                    assert self.link is not None
                    self.link.abort_send(_request_id(body.get("request_id")))
                    return JSONResponse({"aborted": True})

                return await self._guard(go)

        if role == "decode":

            @app.post("/internal/decode")
            async def internal_decode(request: Request) -> Response:
                t0 = time.perf_counter()

                async def go() -> Response:
                    body = api.parse_body(await request.body())
                    kv = body.pop("kv_transfer", None)
                    if not isinstance(kv, dict) or not isinstance(kv.get("prefill"), str):
                        raise api.ApiError(
                            400, "kv_transfer must name the prefill server", param="kv_transfer"
                        )
                    job = api.validate(body, self.limits)
                    return await self.decode(
                        job, _request_id(kv.get("request_id")), kv["prefill"], request, t0
                    )

                return await self._guard(go)

        return app

    async def _local(self, request: Request, t0: float) -> Response:
        job = api.validate(api.parse_body(await request.body()), self.limits)
        return await self.local_completion(job, request, t0)

    async def _guard(self, handler: Callable[[], Any]) -> Response:
        """Rule 3: every failure of a request becomes an error response; the server keeps serving."""
        try:
            response: Response = await handler()
            return response
        except api.ApiError as error:
            self.requests.labels("rejected" if error.status < 500 else "failed").inc()
            return error_response(error)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the request was cancelled and counted
        except asyncio.CancelledError:
            self.requests.labels("cancelled").inc()
            raise


def _request_id(value: Any) -> int:
    if type(value) is not int or not (0 <= value < 1 << 63):
        raise api.ApiError(400, "request_id must be a non-negative 64-bit integer", param="request_id")
    return value


def _parse_aux(aux: bytes) -> int:
    """The writer's aux is untrusted bytes: a JSON object with one ASCII token."""
    from kvown.apps.serve.model import OUTPUT_IDS

    try:
        first = json.loads(aux)["first_token"]
    except (ValueError, KeyError, TypeError):
        raise api.ApiError(502, "the prefill server sent a malformed aux", kind="server_error") from None
    if type(first) is not int or first not in OUTPUT_IDS:
        raise api.ApiError(502, "the prefill server sent an impossible first token", kind="server_error")
    return first


def serve(config: ServeConfig, *, announce: Callable[[str], None] | None = None) -> int:
    """Run one server until SIGINT/SIGTERM. Prints ``READY http://host:port`` once it serves.

    Called: once per process, from the main thread. After error: startup errors propagate (nothing
    is left registered); shutdown revokes the etcd lease, closes the link and the model thread.
    """
    server = Server(config)
    sock = api.listen(config.host, config.port)
    http = f"{config.host}:{sock.getsockname()[1]}"

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        await asyncio.to_thread(server.start, http)
        (announce or _print_ready)(f"http://{http}")
        yield

    server.app.router.lifespan_context = lifespan
    return serve_app(server.app, sock, server.close)


def _print_ready(url: str) -> None:
    print(f"READY {url}", flush=True)
    sys.stdout.flush()
