"""The connector's worker half: one kvown rank per vLLM worker, acting on the scheduler's plan.

Owns: this worker's kvown runtime (``connect_registry``: etcd discovery with leases, vLLM's own KV
tensors lent as bring-your-own memory), the receive and send handles of live requests, and what the
worker reports to vLLM each step (finished sending, finished receiving, failed receiving). It uses
kvown's public API only and imports nothing of vLLM.

Rules:
  1. A receive is reported finished exactly once, when kvown retired its blocks: with proof that every
     published writer is quiescent. Delivered -> reported finished (the request decodes); cancelled,
     failed or timed out -> reported finished AND failed (vLLM's ``kv_load_failure_policy`` fails or
     recomputes it; garbage is never served). A delivered receive is released at once (nobody has
     read the blocks yet); its retirement follows in the same engine step.
  2. A send opens with a ready token recorded right after the forward that wrote its KV, so no WRITE
     reads the blocks before they are written; it is reported released only when kvown released it
     (no WRITE can read the source blocks any more) and vLLM has finished the request.
  3. A send no decoder published to within ``publish_timeout_s`` is cancelled: nothing was posted, so
     nothing can be reading its blocks (kvown's fence answers a late publication FAILED).
  4. Nothing here blocks a step for long: receives are submitted without waiting, a receive whose
     writer kvown has not loaded yet waits (bounded by ``connect_timeout_s``) across steps.
  5. A kvown fail-stop kills this worker (its flight recorder written first): vLLM's engine then exits.
     That is the only way a destination whose writer cannot be proven quiescent is ever let go.
  6. A delivered receive whose prompt digest (the writer's aux payload) differs from the decode
     side's is reported failed: the KV is another prompt's, and is never decoded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvown import (
    BlockSpace,
    CloseStatus,
    KvownError,
    Outcome,
    Region,
    SendPhase,
    TransferConfig,
    WriteTracker,
    connect_registry,
)
from kvown.core.errors import ConfigError
from kvown.integrations.vllm.plan import Cancel, Receive, Send, StepPlan


# How the engine polls beside vLLM's own Python (docs/operations.md): latency against the GIL it takes.
CADENCE = ("spin_s", "idle_sleep_s", "idle_sleep_max_s")


@dataclass(frozen=True)
class WorkerSettings:
    """``kv_connector_extra_config``, checked (every field named in its error)."""

    etcd: str
    cluster: str
    rank: int  # this worker's kvown rank (the instance's base rank + its tensor-parallel rank)
    transfer_timeout_s: float = 30.0
    grace_s: float = 10.0
    publish_timeout_s: float = 120.0
    connect_timeout_s: float = 30.0
    lease_ttl_s: int = 5
    metrics_port: int = 0
    cadence: tuple[tuple[str, float], ...] = ()  # the engine's CADENCE knobs given (else kvown's defaults)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any], tp_rank: int = 0) -> WorkerSettings:
        if not isinstance(extra.get("etcd"), str) or not isinstance(extra.get("cluster"), str):
            raise ConfigError("kv_connector_extra_config needs 'etcd' (an endpoint) and 'cluster' (a job name)",
                              field="kv_connector_extra_config", keys=sorted(extra))
        base = extra.get("rank")
        if type(base) is not int or base < 0:
            raise ConfigError("kv_connector_extra_config 'rank' must be an int >= 0", field="rank", value=base)
        numbers = {}
        for name in ("transfer_timeout_s", "grace_s", "publish_timeout_s", "connect_timeout_s"):
            value = extra.get(name, getattr(cls, name))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be a number > 0", field=name, value=value)
            numbers[name] = float(value)
        for name in ("lease_ttl_s", "metrics_port"):
            value = extra.get(name, getattr(cls, name))
            if type(value) is not int or value < 0:
                raise ConfigError(f"{name} must be an int >= 0", field=name, value=value)
            numbers[name] = value
        cadence = tuple((name, extra[name]) for name in CADENCE if name in extra)
        TransferConfig(**dict(cadence))  # its own checks: a ConfigError naming the field
        return cls(extra["etcd"], extra["cluster"], base + tp_rank, **numbers, cadence=cadence)


def kv_space(kv_caches: Mapping[str, Any], num_blocks: int) -> BlockSpace:
    """vLLM's per-layer KV tensors as one block space, layers in name order. A tensor whose first
    dimension is the block index is one region (vLLM CPU: ``[blocks, kv_heads, block_size, 2*head]``;
    a multiple of ``num_blocks`` rows when kernel blocks are smaller); one shaped ``[2, blocks, ...]``
    is two (its K and V halves, flash-attention style)."""
    regions, tensors = [], []
    for name in sorted(kv_caches):
        t = kv_caches[name]
        if t.shape[0] != num_blocks and t.shape[0] % num_blocks == 0 and t.shape[0] > 2:
            t = t.unflatten(0, (num_blocks, -1))  # kernel blocks: a manager block is several rows
        if t.shape[0] == num_blocks:
            halves = [t]
        elif t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks:
            halves = [t[0], t[1]]
        else:
            raise ConfigError("a KV cache tensor whose block dimension is neither 0 nor 1 (after K/V)",
                              field="kv_caches", layer=name, shape=tuple(t.shape), num_blocks=num_blocks)
        for half in halves:  # whole blocks only: P and D run the same tensor-parallel size
            regions.append(Region.from_tensor(half))
            tensors.append(half)
    return BlockSpace.of_tensors(regions, tensors)


@dataclass
class _Recv:
    req_id: str
    request_id: int
    writer: int
    blocks: tuple[int, ...]
    since_s: float
    digest: bytes = b""
    ticket: Any = None  # kvown's receive ticket, once submitted
    handle: Any = None
    mismatch: bool = False  # rule 6


@dataclass
class _Send:
    request_id: int
    handle: Any  # kvown's SendHandle, or None when the send was refused
    opened_s: float


@dataclass
class Reports:
    """What the worker tells vLLM after a step (``KVConnectorTransferResults``)."""

    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)


class WorkerSide:
    """The worker half of ``KvownConnector`` (module rules)."""

    def __init__(self, settings: WorkerSettings, *, roles: set[str], device: str = "cpu",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.roles = roles
        self.tracker = WriteTracker(device)
        self.clock = clock
        self.rt: Any = None
        self._recvs: dict[str, _Recv] = {}
        self._sends: dict[str, _Send] = {}
        self._finished: set[str] = set()  # finished in vLLM, with a send of ours not yet reported
        self._now: Reports = Reports()  # reported at the next step without waiting for kvown
        self.prompt_mismatches = 0

    def start(self, kv_caches: Mapping[str, Any], num_blocks: int) -> None:
        """Join the kvown world with vLLM's KV tensors (``register_kv_caches``). Once per worker."""
        s = self.settings
        config = TransferConfig(transfer_timeout_s=s.transfer_timeout_s, grace_s=s.grace_s,
                                metrics_port=s.metrics_port, canary=False, **dict(s.cadence))
        self.attach(connect_registry(s.etcd, job=s.cluster, rank=s.rank, memory=kv_space(kv_caches, num_blocks),
                                     on_returned=lambda request_id, blocks: None, config=config,
                                     roles=self.roles, ttl_s=s.lease_ttl_s))

    def attach(self, rt: Any) -> None:
        """Use an already started kvown runtime (``start`` does this; tests pass ``connect_local``'s)."""
        self.rt = rt

    # ---- each step ------------------------------------------------------------------------------

    def act(self, plan: StepPlan) -> None:
        """Receives and cancels (``start_load_kv``): none of it waits for the engine (rule 4)."""
        for r in plan.receives:
            self._recvs[r.req_id] = _Recv(r.req_id, r.request_id, r.writer, r.blocks, self.clock(), r.digest)
        for c in plan.cancels:
            self._cancel_receive(c)
        for c in plan.send_cancels:
            self._guarded(lambda c=c: self.rt.sender.cancel(c.request_id))
        self._submit_receives()

    def save(self, plan: StepPlan) -> None:
        """Open the step's sends (``wait_for_save``: after the forward, so the token covers it, rule 2)."""
        if not plan.sends:
            return
        token = self.tracker.record()
        for s in plan.sends:
            self._open_send(s, token)

    def report(self, finished_req_ids: set[str]) -> Reports:
        """``get_transfer_results``: what finished since the last step (each id once)."""
        out, self._now = self._now, Reports()
        self._submit_receives()
        for req_id, r in list(self._recvs.items()):
            if self._settled(r, out):
                del self._recvs[req_id]
        self._finished |= finished_req_ids & self._sends.keys()
        now = self.clock()
        for req_id, s in list(self._sends.items()):
            if s.handle is None or s.handle.released.is_set():
                if req_id in self._finished:
                    out.sending.add(req_id)
                    self._finished.discard(req_id)
                    del self._sends[req_id]
            elif now - s.opened_s > self.settings.publish_timeout_s and s.handle.phase is SendPhase.OPEN:
                self._guarded(lambda s=s: self.rt.sender.cancel(s.request_id))  # rule 3
        return out

    # ---- decode side ----------------------------------------------------------------------------

    def _submit_receives(self) -> None:
        """Publish every planned receive whose writer kvown has loaded (rule 4)."""
        peers = self.rt.view.peers
        for r in self._recvs.values():
            if r.ticket is not None or r.handle is not None:
                continue
            if r.writer not in peers:
                if self.clock() - r.since_s > self.settings.connect_timeout_s:
                    r.handle = False  # never published: reported failed below
                continue
            try:
                r.ticket = self.rt.receiver.submit_receive(r.request_id, None, (r.writer,), blocks=r.blocks,
                                                           aux=bool(r.digest))
            except KvownError:
                r.handle = False

    def _settled(self, r: _Recv, out: Reports) -> bool:
        """Rule 1 for one receive; True once it has been reported."""
        if r.handle is None and r.ticket is not None and r.ticket.future.done():
            r.handle = r.ticket.future.result() if r.ticket.future.exception() is None else False
        if r.handle is False:  # never published: nothing of ours touches the blocks
            out.recving.add(r.req_id)
            out.failed.add(r.req_id)
            return True
        h = r.handle
        if h is None:
            return False
        if h.retired.is_set():
            out.recving.add(r.req_id)
            if h.result() is not Outcome.COMPLETED or r.mismatch:
                out.failed.add(r.req_id)
            return True
        if h.landed.is_set() and not h.closing:
            if r.digest and self.rt.receiver.read_aux(h)[: len(r.digest)] != r.digest:  # rule 6
                r.mismatch = True
                self.prompt_mismatches += 1
            self._guarded(lambda: self.rt.receiver.release(r.request_id))
        return False

    def _cancel_receive(self, c: Cancel) -> None:
        r = self._recvs.get(c.req_id)
        if r is not None and (r.ticket is not None or r.handle):
            self._guarded(lambda: self.rt.receiver.cancel(c.request_id))  # its retirement is the report
            return
        if r is not None:  # planned, never published
            del self._recvs[c.req_id]
        notify = tuple(w for w in c.notify if w in self.rt.view.peers)
        self._guarded(lambda: self.rt.receiver.cancel(c.request_id, writers=notify))
        if c.report or r is not None:
            self._now.recving.add(c.req_id)
            self._now.failed.add(c.req_id)

    # ---- prefill side ---------------------------------------------------------------------------

    def _open_send(self, s: Send, token: Any) -> None:
        try:
            handle = self.rt.sender.send(s.request_id, s.blocks, ready=token, dst_suffix=True, aux=s.digest or None)
        except KvownError:
            handle = None  # refused: nothing was posted; the source blocks go back when vLLM is done
        self._sends[s.req_id] = _Send(s.request_id, handle, self.clock())

    def _guarded(self, call: Callable[[], Any]) -> Any:
        """A late close is a no-op in kvown (``CloseResult``); a bad one must not kill vLLM's step."""
        try:
            result = call()
        except KvownError:
            return None
        return None if getattr(result, "status", None) is CloseStatus.REFUSED else result

    def statistics(self) -> dict[str, int]:
        return {"receives": len(self._recvs), "sends": len(self._sends), "prompt_mismatches": self.prompt_mismatches}

    def close(self) -> None:
        if self.rt is not None:
            self.rt.close()


__all__ = ["Reports", "WorkerSettings", "WorkerSide", "kv_space"]
