"""kvown: the KV-transfer ownership runtime for disaggregated LLM inference.

Context (prefill) ranks write a request's KV blocks into generation (decode) ranks' memory over NIXL;
kvown retires destination blocks only with proof that every published writer is quiescent, and
fail-stops the MPI world when that proof is missing at the deadline. See docs/embedding.md.
"""

from kvown.adapters.cuda import WriteTracker
from kvown.api import Receiver, Sender
from kvown.cache.layout import KVLayout
from kvown.cache.pool import KVPool, PoolExhausted
from kvown.core.actions import Outcome
from kvown.core.errors import (
    AdapterError,
    ConfigError,
    InvariantViolation,
    KvownError,
    LocalProtocolError,
    PeerProtocolError,
    ProtocolError,
)
from kvown.core.ids import make_request_id, split_request_id
from kvown.runtime.bootstrap import RankRuntime, connect_mpi, connect_rendezvous
from kvown.runtime.config import TransferConfig
from kvown.runtime.engine import AdmissionError, ReceiveHandle, SendHandle

__version__ = "0.1.0"

__all__ = [
    "AdapterError",
    "AdmissionError",
    "ConfigError",
    "InvariantViolation",
    "KVLayout",
    "KVPool",
    "KvownError",
    "LocalProtocolError",
    "Outcome",
    "PeerProtocolError",
    "PoolExhausted",
    "ProtocolError",
    "RankRuntime",
    "ReceiveHandle",
    "Receiver",
    "SendHandle",
    "Sender",
    "TransferConfig",
    "WriteTracker",
    "connect_mpi",
    "connect_rendezvous",
    "make_request_id",
    "split_request_id",
]
