"""The OpenAI ``/v1/completions`` contract of the reference server: request validation, errors, chunks.

Owns: parsing a request body (untrusted bytes) into a ``Job``; OpenAI-style error bodies; the JSON of a
completion and of a streamed chunk; stop-string matching; the byte tokenizer; ``ClosingStream`` (a
streamed response whose cleanup always runs). Torch-free, so the router imports it cheaply.

Rules:
  1. Every request body is size-capped, parsed as JSON and validated with strict types before any
     work: unknown fields, wrong types and out-of-range values raise ``ApiError`` (HTTP 4xx with an
     OpenAI error body naming ``param``). A bad request never reaches the model or the KV link.
  2. One choice per request (``n == 1``) and one prompt per request: the reference server does not
     batch (model.py rule 3).
  3. Stop strings: text that could still become a stop string is held back from the stream, so the
     streamed text always equals the non-streamed text.
"""

from __future__ import annotations

import itertools
import json
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)
from starlette.responses import StreamingResponse

from kvown.core.errors import ConfigError
from kvown.core.ids import MAX_EPOCH, MAX_SEQ, make_request_id

MAX_BODY_NBYTES = 1 << 20
MAX_STOP_STRINGS, MAX_STOP_LEN = 4, 64


class ApiError(Exception):
    """An error the client caused or may retry: becomes an OpenAI error body with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class RequestIds:
    """Mints kvown request ids for a router or proxy: the epoch is the start time in seconds (it grows
    across restarts), seq counts from 1; an id is never reused (a retry is a new request)."""

    def __init__(self, epoch: int | None = None) -> None:
        self.epoch = (int(time.time()) if epoch is None else epoch) & MAX_EPOCH
        self._seq = itertools.count(1)
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            seq = next(self._seq)
            if seq > MAX_SEQ:  # 4 billion requests in one epoch: start a new one
                self.epoch, self._seq = self.epoch + 1, itertools.count(2)
                seq = 1
            return make_request_id(self.epoch, seq)


class ByteTokenizer:
    """UTF-8 bytes in, bytes out (generated ids are ASCII, see model.py rule 4)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


Number = StrictInt | StrictFloat


class CompletionRequest(BaseModel):
    """The accepted subset of OpenAI's completions request. Anything else is refused (rule 1)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    prompt: (
        StrictStr
        | Annotated[list[StrictStr], Field(min_length=1)]
        | Annotated[list[StrictInt], Field(min_length=1)]
    )
    max_tokens: StrictInt = 16
    temperature: Number = 1.0
    top_p: Number = 1.0
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: dict[StrictStr, StrictBool] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    user: StrictStr | None = None


@dataclass(frozen=True)
class Limits:
    model_name: str
    max_model_len: int
    max_prompt_tokens: int


@dataclass(frozen=True)
class Job:
    """A validated request, in the form every server acts on (the router forwards ``to_json``)."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": list(self.prompt_ids),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stream": self.stream,
            "stop": list(self.stop),
        }
        if self.stream:
            body["stream_options"] = {"include_usage": self.include_usage}
        return body


def parse_body(raw: bytes) -> dict[str, Any]:
    if len(raw) > MAX_BODY_NBYTES:
        raise ApiError(413, f"request body over {MAX_BODY_NBYTES} bytes", code="request_too_large")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "request body is not valid JSON", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    return data


def validate(data: dict[str, Any], limits: Limits) -> Job:
    """Turn a parsed body into a ``Job``. After error: ``ApiError`` naming ``param``; nothing changed."""
    req = _parsed(data)
    if req.model is not None and req.model != limits.model_name:
        raise ApiError(404, f"The model '{req.model}' does not exist", param="model", code="model_not_found")
    ids = _prompt_ids(req, limits)
    stop = _checked_sampling(req, len(ids), limits)
    seed = req.seed if req.seed is not None else secrets.randbits(62)  # fixed here, so every server agrees
    return Job(
        tuple(ids),
        req.max_tokens,
        float(req.temperature),
        float(req.top_p),
        seed,
        req.stream,
        bool((req.stream_options or {}).get("include_usage")),
        stop,
    )


def _parsed(data: dict[str, Any]) -> CompletionRequest:
    """The body as a ``CompletionRequest``; pydantic's first complaint as an ``ApiError``."""
    try:
        req = CompletionRequest.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else None
        if first["type"] == "extra_forbidden":
            raise ApiError(
                400,
                f"Unrecognized request argument supplied: {param}",
                param=param,
                code="unrecognized_argument",
            ) from None
        raise ApiError(
            400, f"Invalid value for '{param}': {first['msg']}", param=param, code="invalid_type"
        ) from None
    return req


def _prompt_ids(req: CompletionRequest, limits: Limits) -> list[int]:
    """The prompt's token ids (one prompt: text through the byte tokenizer, or ids 0..255)."""
    if isinstance(req.prompt, list) and isinstance(req.prompt[0], str):
        if len(req.prompt) != 1:
            raise ApiError(
                400, "only one prompt per request is supported", param="prompt", code="unsupported"
            )
        req.prompt = req.prompt[0]
    if isinstance(req.prompt, str):
        ids = ByteTokenizer().encode(req.prompt)
    else:
        ids = list(req.prompt)
        if any(not (0 <= t < 256) for t in ids):
            raise ApiError(
                400, "token ids must be 0..255 (byte tokenizer)", param="prompt", code="invalid_value"
            )
    if not ids:
        raise ApiError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    if len(ids) > limits.max_prompt_tokens:
        raise ApiError(
            400,
            f"prompt is {len(ids)} tokens; the maximum is {limits.max_prompt_tokens}",
            param="prompt",
            code="context_length_exceeded",
        )
    return ids


def _checked_sampling(req: CompletionRequest, num_ids: int, limits: Limits) -> tuple[str, ...]:
    """Length, sampling and stream options within their ranges; the stop strings as a tuple."""
    if req.max_tokens <= 0:
        raise ApiError(400, "max_tokens must be at least 1", param="max_tokens", code="invalid_value")
    if num_ids + req.max_tokens > limits.max_model_len:
        raise ApiError(
            400,
            f"prompt ({num_ids}) + max_tokens ({req.max_tokens}) exceeds the context of "
            f"{limits.max_model_len} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    if not (0.0 <= req.temperature <= 2.0):
        raise ApiError(400, "temperature must be between 0 and 2", param="temperature", code="invalid_value")
    if not (0.0 < req.top_p <= 1.0):
        raise ApiError(400, "top_p must be in (0, 1]", param="top_p", code="invalid_value")
    if req.n != 1:
        raise ApiError(400, "only n=1 is supported", param="n", code="unsupported")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > MAX_STOP_STRINGS or any(not (0 < len(s) <= MAX_STOP_LEN) for s in stop):
        raise ApiError(
            400,
            f"stop takes up to {MAX_STOP_STRINGS} strings of 1..{MAX_STOP_LEN} characters",
            param="stop",
            code="invalid_value",
        )
    if req.seed is not None and not (0 <= req.seed < 1 << 63):
        raise ApiError(400, "seed must be a non-negative 64-bit integer", param="seed", code="invalid_value")
    if req.stream_options is not None and (not req.stream or set(req.stream_options) - {"include_usage"}):
        raise ApiError(
            400,
            "stream_options needs stream=true and takes only include_usage",
            param="stream_options",
            code="invalid_value",
        )
    return stop


class StopMatcher:
    """Feeds generated text and says what may be emitted now (rule 3)."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop, self.pending, self.text, self.stopped = stop, "", "", False

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        self.pending += piece
        for s in self.stop:
            at = self.pending.find(s)
            if at >= 0:
                out, self.pending, self.stopped = self.pending[:at], "", True
                self.text += out
                return out
        hold = max(
            (k for s in self.stop for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0
        )
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        self.text += out
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        self.text += out
        return out


def completion_id(request_id: int) -> str:
    return f"cmpl-{request_id:016x}"


def chunk(request_id: int, model: str, text: str, finish_reason: str | None, created: int) -> bytes:
    body = {
        "id": completion_id(request_id),
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def usage_chunk(
    request_id: int, model: str, created: int, prompt_tokens: int, completion_tokens: int
) -> bytes:
    body = {
        "id": completion_id(request_id),
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens),
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def error_chunk(error: ApiError) -> bytes:
    """A mid-stream failure: the official client raises ``APIError`` on a data line with ``error``."""
    return b"data: " + json.dumps(error.body()).encode() + b"\n\n"


def completion(
    request_id: int,
    model: str,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    created: int,
) -> dict[str, Any]:
    return {
        "id": completion_id(request_id),
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def now_s() -> int:
    return int(time.time())


async def disconnected(request: Any) -> None:
    """Return when the HTTP client disconnects. Only after the body was read (then that is the only
    message left), and only until a response starts (which listens for it itself)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def check_port(port: int) -> None:
    """``ConfigError(field="port")`` unless ``port`` is a TCP port number (0: any free one)."""
    if type(port) is not int or not 0 <= port <= 65535:
        raise ConfigError("port must be 0-65535 (0: any free port)", field="port", value=port)


def listen(host: str, port: int) -> socket.socket:
    """The HTTP listening socket. Created with ``IPPROTO_TCP`` (not 0, as ``socket.create_server`` does)
    because asyncio disables Nagle only on sockets whose proto says TCP: without it, a keep-alive
    client's streamed tokens stall behind its delayed ACKs (up to 40 ms) and arrive in bunches."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets on Linux
    sock.bind((host, port))
    sock.listen(1024)
    return sock


def serve_app(app: Any, sock: socket.socket, close: Callable[[], None]) -> int:
    """Run ``app`` with uvicorn on the ``listen`` socket until it is told to stop; then ``close()``
    the server behind it and the socket, whatever ended the run. Returns the process exit status."""
    import uvicorn

    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, access_log=False))
    try:
        uv.run(sockets=[sock])
    finally:
        close()
        sock.close()
    return 0


def cluster_prefix(cluster: str) -> str:
    """The etcd prefix every server of one cluster registers under."""
    return f"/kvown/serve/{cluster}/"


def model_list(names: Iterable[str], owner: str = "kvown") -> dict[str, Any]:
    """The body of OpenAI's ``GET /v1/models``."""
    created = now_s()
    return {"object": "list",
            "data": [{"id": n, "object": "model", "created": created, "owned_by": owner} for n in names]}


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


class ClosingStream(StreamingResponse):
    """A StreamingResponse that always closes its body generator and then calls ``on_close``, so the
    request's cleanup runs when the client leaves, whichever way Starlette noticed, even when the
    body never started (closing an unstarted generator skips its ``finally``)."""

    def __init__(self, content: AsyncIterator[bytes], *, on_close: Callable[[], None], **kw: Any) -> None:
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                self.on_close()


def add_status_routes(app: Any, health: Callable[[], dict[str, Any]], registry: Any) -> None:
    """``GET /health`` (the server's own JSON; HTTP 503 unless its ``status`` is ``ok``, so a load
    balancer's probe says ready only when a completion can be served) and ``GET /metrics``
    (Prometheus text) on ``app``."""
    from fastapi.responses import Response
    from prometheus_client import generate_latest

    @app.get("/health")
    async def _health() -> JSONResponse:
        h = health()
        return JSONResponse(h, status_code=200 if h.get("status") == "ok" else 503)

    @app.get("/metrics")
    async def _metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")
