"""The proxy's request flow per connector ("leg plan"): what the prefill (P) and decode (D) instances
are asked, in which order, and with which ``kv_transfer_params``.

A leg plan is ``async plan(legs, request) -> Answer``: it posts to P and D through ``Legs`` and returns
D's open response (streamed back to the client by the proxy) plus any leg still running
(``Answer.companions``). The proxy cancels the plan's task when the client leaves (both legs' HTTP
connections close, so vLLM aborts both requests) and aborts D when a companion fails.

Rules:
  1. Both legs carry the same ``X-Request-Id`` (``Request.header_id``): vLLM derives its request ids
     from it, and NIXL's push mode matches D's registration to P's blocks by it.
  2. P is asked for one token, not streamed: ``max_tokens=1``, ``stream=False``, no ``stream_options``.
  3. Upstream bytes are untrusted: P's answer is checked before D sees any of it; a failed leg becomes a
     ``LegError`` with an OpenAI error body.
  4. kvown (``kvown_legs``): one kvown request id per client request (``Request.request_id``, minted by
     the proxy, never reused), and both legs at once: D does not wait for P's answer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from kvown.apps.serve.vllm.connectors import Instance


class LegError(Exception):
    """A leg failed: ``status`` and an OpenAI error ``body`` for the client."""

    def __init__(self, status: int, message: str, *, leg: str, upstream: bytes = b"") -> None:
        super().__init__(message)
        self.status, self.leg = status, leg
        self.body = _upstream_error(upstream) or {
            "error": {"message": message, "type": "server_error", "param": None, "code": "upstream_failed"}
        }


@dataclass(frozen=True)
class Request:
    path: str  # "/v1/completions" or "/v1/chat/completions"
    body: dict[str, Any]  # the client's JSON object
    request_id: int  # kvown request id (kvown.make_request_id), one per client request
    header_id: str  # X-Request-Id of both legs (rule 1)

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True


@dataclass
class Answer:
    response: httpx.Response  # D's open response
    companions: list[asyncio.Task[Any]] = field(default_factory=list)  # legs still running


class Legs:
    """HTTP to one P/D pair for one request."""

    def __init__(self, client: httpx.AsyncClient, prefill: Instance | None, decode: Instance) -> None:
        self.client, self.decode_instance = client, decode
        self._prefill = prefill

    @property
    def prefill_instance(self) -> Instance:
        if self._prefill is None:
            raise LegError(500, "this stack has no prefill instance (--single)", leg="prefill")
        return self._prefill

    def _headers(self, req: Request) -> dict[str, str]:
        return {"X-Request-Id": req.header_id}

    async def prefill(self, req: Request, kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
        """P's leg (rule 2); returns P's answer, checked (rule 3)."""
        body = {k: v for k, v in req.body.items() if k not in ("stream_options", "min_tokens")}
        body |= {"max_tokens": 1, "stream": False, "kv_transfer_params": kv_transfer_params}
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        url = self.prefill_instance.url + req.path
        try:
            r = await self.client.post(url, json=body, headers=self._headers(req))
        except httpx.HTTPError as error:
            raise LegError(502, f"prefill {self.prefill_instance.name} failed: {type(error).__name__}",
                           leg="prefill") from None
        if r.status_code != 200:
            raise LegError(r.status_code, f"prefill {self.prefill_instance.name} answered HTTP {r.status_code}",
                           leg="prefill", upstream=r.content)
        try:
            answer = json.loads(r.content)
            if not isinstance(answer, dict):
                raise ValueError
        except ValueError:
            raise LegError(502, f"prefill {self.prefill_instance.name} answered nonsense", leg="prefill") from None
        return answer

    async def decode(self, req: Request, kv_transfer_params: dict[str, Any] | None) -> httpx.Response:
        """D's leg: the client's body plus ``kv_transfer_params`` (None: the body as it is, for a single
        instance); the response is left open."""
        body = req.body if kv_transfer_params is None else {**req.body, "kv_transfer_params": kv_transfer_params}
        upstream = self.client.build_request("POST", self.decode_instance.url + req.path, json=body,
                                             headers=self._headers(req))
        try:
            response = await self.client.send(upstream, stream=True)
        except httpx.HTTPError as error:
            raise LegError(502, f"decode {self.decode_instance.name} failed: {type(error).__name__}",
                           leg="decode") from None
        if response.status_code != 200:
            raw = await response.aread()
            await response.aclose()
            raise LegError(response.status_code, f"decode {self.decode_instance.name} answered HTTP "
                           f"{response.status_code}", leg="decode", upstream=raw)
        return response


LegPlan = Callable[[Legs, Request], Awaitable[Answer]]


def _params_of(answer: dict[str, Any], leg: str) -> dict[str, Any]:
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise LegError(502, "prefill answered without kv_transfer_params", leg=leg)
    return params


async def single_legs(legs: Legs, req: Request) -> Answer:
    """One plain instance (``--single``): the client's body, unchanged, to it."""
    return Answer(await legs.decode(req, None))


async def pull_legs(legs: Legs, req: Request) -> Answer:
    """NixlConnector (pull): P first; D gets P's ``kv_transfer_params`` (block ids and all) and READs."""
    p = await legs.prefill(req, {"do_remote_decode": True})
    return Answer(await legs.decode(req, _params_of(p, "prefill")))


async def push_legs(legs: Legs, req: Request) -> Answer:
    """NixlPushConnector: P first; D gets P's coordinates only (no block ids), registers its own blocks
    with P, and P WRITEs into them."""
    params = _params_of(await legs.prefill(req, {"do_remote_decode": True}), "prefill")
    coords = {k: v for k, v in params.items() if k != "remote_block_ids"}
    return Answer(await legs.decode(req, {**coords, "do_remote_prefill": True}))


async def kvown_legs(legs: Legs, req: Request) -> Answer:
    """kvown (rule 4): P and D at once. P gets ``do_remote_decode`` and the kvown request id; D gets the
    client's body with ``do_remote_prefill``, the id and the writer's (P's) kvown rank, and its stream
    goes back to the client. If P fails, the proxy aborts D (``Answer.companions``)."""
    rid = req.request_id
    p_task = asyncio.create_task(legs.prefill(req, {"do_remote_decode": True, "kvown_request_id": rid}))
    try:
        d = await legs.decode(req, {"do_remote_prefill": True, "kvown_request_id": rid,
                                    "kvown_writer": legs.prefill_instance.kvown_rank})
    except BaseException:
        p_task.cancel()
        raise
    return Answer(d, [p_task])


def _upstream_error(raw: bytes) -> dict[str, Any] | None:
    """An upstream's OpenAI error body, kept only when well formed (rule 3)."""
    try:
        err = json.loads(raw)["error"] if raw else None
        if not isinstance(err, dict) or not isinstance(err.get("message"), str):
            return None
    except (ValueError, KeyError, TypeError):
        return None
    return {"error": {"message": err["message"][:500], "type": str(err.get("type", "server_error"))[:64],
                      "param": err.get("param") if isinstance(err.get("param"), str) else None,
                      "code": err.get("code") if isinstance(err.get("code"), (str, int)) else None}}
