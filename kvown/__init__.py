"""kvown: the KV-transfer ownership runtime for disaggregated LLM inference.

Context (prefill) ranks write a request's KV blocks into generation (decode) ranks' memory over NIXL;
kvown retires destination blocks only with proof that every published writer is quiescent, and
fail-stops the MPI world when that proof is missing at the deadline. See docs/embedding.md.

Names are imported lazily: ``import kvown`` starts no thread and loads neither torch, NIXL nor MPI,
so entry points can set signal masks and environment first (see docs/operations.md).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "WriteTracker": "kvown.adapters.cuda",
    "Receiver": "kvown.api",
    "Sender": "kvown.api",
    "KVLayout": "kvown.cache.layout",
    "KVPool": "kvown.cache.pool",
    "PoolExhausted": "kvown.cache.pool",
    "Outcome": "kvown.core.actions",
    "AdapterError": "kvown.core.errors",
    "ConfigError": "kvown.core.errors",
    "InvariantViolation": "kvown.core.errors",
    "KvownError": "kvown.core.errors",
    "LocalProtocolError": "kvown.core.errors",
    "PeerProtocolError": "kvown.core.errors",
    "ProtocolError": "kvown.core.errors",
    "make_request_id": "kvown.core.ids",
    "split_request_id": "kvown.core.ids",
    "RankRuntime": "kvown.rank",
    "connect_mpi": "kvown.rank",
    "connect_rendezvous": "kvown.rank",
    "TransferConfig": "kvown.runtime.config",
    "connect_local": "kvown.rank",
    "connect_registry": "kvown.rank",
    "AdmissionError": "kvown.runtime.commands",
    "CloseResult": "kvown.runtime.commands",
    "CloseStatus": "kvown.runtime.commands",
    "ReceiveHandle": "kvown.runtime.commands",
    "ReceivePhase": "kvown.runtime.commands",
    "ReceiveStatus": "kvown.runtime.commands",
    "SendHandle": "kvown.runtime.commands",
    "SendPhase": "kvown.runtime.commands",
    "SendStatus": "kvown.runtime.commands",
    "Audit": "kvown.runtime.statistics",
    "PoolCounts": "kvown.runtime.statistics",
    "Statistics": "kvown.runtime.statistics",
    "PeerView": "kvown.runtime.view",
    "RankView": "kvown.runtime.view",
    "BlockSpace": "kvown.cache.space",
    "Region": "kvown.cache.space",
    "Role": "kvown.adapters.transport",
    "build_info": "kvown.runtime.build",
    "interpreter_info": "kvown.runtime.build",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvown' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
