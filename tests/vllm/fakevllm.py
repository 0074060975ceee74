"""A fake vLLM OpenAI server at the proxy's adapter seam, and an in-thread runner for apps.

The contract it keeps (the real-vLLM tests check the same things on real vLLM: test_vllm_pd_smoke.py,
test_vllm_pd.py): a request with ``kv_transfer_params.do_remote_decode`` answers one token, not
streamed, with ``kv_transfer_params`` for D; a client that closes the connection aborts the request
(streamed: the generator is closed; whole: vLLM's ``with_cancellation``); ``/health``; ``/v1/models``.
Each request is recorded (path, headers, body, arrival and end times, aborted or not)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

PARAMS_FOR_D = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2],
                "remote_engine_id": "kvown-prefill-0", "remote_host": "127.0.0.1", "remote_port": 5601,
                "tp_size": 1}


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    t_in: float
    t_out: float | None = None
    aborted: bool = False


@dataclass
class FakeVllm:
    name: str
    delay_s: float = 0.0  # before the (first) answer
    token_delay_s: float = 0.02
    fail_status: int | None = None  # answer every completion with this HTTP status
    healthy: bool = True
    seen: list[Seen] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.healthy else 503)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "vllm"}]}

        async def complete(request: Request) -> Response:
            body = json.loads(await request.body())
            seen = Seen(request.url.path, dict(request.headers), body, time.monotonic())
            self.seen.append(seen)
            if body.get("stream"):
                return StreamingResponse(self._stream(seen, int(body.get("max_tokens", 16))),
                                         media_type="text/event-stream")
            return await self._whole(request, seen, body)

        for path in ("/v1/completions", "/v1/chat/completions"):
            app.add_api_route(path, complete, methods=["POST"])
        return app

    async def _whole(self, request: Request, seen: Seen, body: dict[str, Any]) -> Response:
        n = int(body.get("max_tokens", 16))
        end = time.monotonic() + self.delay_s + n * self.token_delay_s
        while time.monotonic() < end:  # vLLM's with_cancellation: a disconnect aborts the request
            if await request.is_disconnected():
                seen.aborted, seen.t_out = True, time.monotonic()
                return Response(status_code=499)
            await asyncio.sleep(0.01)
        seen.t_out = time.monotonic()
        if self.fail_status is not None:
            return JSONResponse({"error": {"message": f"{self.name} failed", "type": "server_error",
                                           "param": None, "code": self.fail_status}}, status_code=self.fail_status)
        params = PARAMS_FOR_D if (body.get("kv_transfer_params") or {}).get("do_remote_decode") else None
        return JSONResponse({"id": "cmpl-x", "object": "text_completion", "kv_transfer_params": params,
                             "choices": [{"index": 0, "text": "t" * n, "finish_reason": "length"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}})

    async def _stream(self, seen: Seen, n: int):
        try:
            await asyncio.sleep(self.delay_s)
            for i in range(n):
                chunk = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                await asyncio.sleep(self.token_delay_s)
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            seen.aborted = True
            raise
        finally:
            seen.t_out = time.monotonic()


class AppThread:
    """Run an ASGI app with uvicorn in a daemon thread on ``sock`` (or a new loopback socket)."""

    def __init__(self, app: Any, sock: socket.socket | None = None) -> None:
        if sock is None:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
        self.sock = sock
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)

    def __enter__(self) -> AppThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.server.started, "app did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
