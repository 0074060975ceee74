"""Which KV connector a vLLM pair runs, as data: connector name -> kv-transfer config + leg plan.

Owns: ``CONNECTORS`` (the table ``kvown serve vllm --connector`` reads), each entry's
``--kv-transfer-config`` builder, its proxy leg plan (``legs.py``), the environment its vLLM processes
need, and whether it needs etcd. Adding a connector is one entry here.

Rules:
  1. A builder is pure: (role, this instance, the stack) -> the JSON vLLM gets; nothing else decides a
     connector's configuration.
  2. ``engine_id`` is fixed per instance (not vLLM's random uuid), so logs and the proxy can name it.
  3. vLLM's own NIXL connectors run with the baseline fix (``BASELINE_FIX_ENV``, see
     kvown/integrations/vllm/plugin.py); kvown's connector runs its own NIXL agent and needs none.
     Every figure of a connector says which (``Connector.baseline_fix``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvown.apps.serve.vllm import legs
from kvown.core.errors import ConfigError

# the plugin reads this variable (kvown/integrations/vllm/plugin.py BASELINE_FIX_ENV; a test checks both
# spell it the same: this package must not import the integration, which lives in the vLLM venv)
BASELINE_FIX_ENV = "KVOWN_VLLM_BASELINE_FIX"


@dataclass(frozen=True)
class Instance:
    """One vLLM server of the stack, as the builders and leg plans see it."""

    name: str  # "prefill-0", "decode-0", "single-0": unique in the cluster, the kvown rank's name
    role: str  # "prefill" | "decode" | "single"
    http_port: int
    side_channel_port: int  # VLLM_NIXL_SIDE_CHANNEL_PORT: distinct per instance

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def engine_id(self) -> str:
        return f"kvown-{self.name}"

    @property
    def kvown_rank(self) -> int:
        """This instance's kvown rank (one worker per instance: tensor-parallel size 1)."""
        return KVOWN_RANKS[self.role]


KVOWN_RANKS = {"prefill": 0, "decode": 1, "single": 0}


@dataclass(frozen=True)
class StackInfo:
    cluster: str
    etcd: str | None  # the endpoint, when the connector needs etcd
    prefill: Instance
    decode: Instance
    connector_extra: Mapping[str, Any] = field(default_factory=dict)  # knobs for kv_connector_extra_config


KvConfigBuilder = Callable[[Instance, StackInfo], dict[str, Any]]


@dataclass(frozen=True)
class Connector:
    name: str
    kv_config: KvConfigBuilder
    legs: legs.LegPlan
    needs_etcd: bool = False
    baseline_fix: bool = False  # rule 3
    env: Mapping[str, str] = field(default_factory=dict)
    requires: str | None = None  # "module:attribute" the vLLM venv must import (checked before start)
    job_key: bool = False  # the stack hands every instance one fresh KVOWN_JOB_KEY (kvown's HMAC key)

    def instance_env(self) -> dict[str, str]:
        return {**self.env, **({BASELINE_FIX_ENV: "1"} if self.baseline_fix else {})}


def _role(instance: Instance) -> str:
    roles = {"prefill": "kv_producer", "decode": "kv_consumer"}
    if instance.role not in roles:
        raise ConfigError(f"a connector serves prefill or decode, not {instance.role!r}", field="role")
    return roles[instance.role]


def nixl_config(class_name: str) -> KvConfigBuilder:
    def build(instance: Instance, stack: StackInfo) -> dict[str, Any]:
        return {
            "kv_connector": class_name,
            "kv_role": _role(instance),
            "kv_buffer_device": "cpu",
            "engine_id": instance.engine_id,  # rule 2
            "kv_connector_extra_config": {"num_threads": 1},
        }

    return build


def kvown_config(instance: Instance, stack: StackInfo) -> dict[str, Any]:
    """kvown's connector (``kvown.integrations.vllm.KvownConnector``): one kvown rank per vLLM worker,
    found through etcd under the stack's cluster; the stack's knobs (deadlines, metrics port) ride along."""
    return {
        "kv_connector": "KvownConnector",
        "kv_connector_module_path": "kvown.integrations.vllm",
        "kv_role": _role(instance),
        "engine_id": instance.engine_id,
        "kv_connector_extra_config": {**stack.connector_extra, "etcd": stack.etcd, "cluster": stack.cluster,
                                      "rank": instance.kvown_rank},
    }


CONNECTORS: dict[str, Connector] = {
    "kvown": Connector("kvown", kvown_config, legs.kvown_legs, needs_etcd=True,
                       requires="kvown.integrations.vllm:KvownConnector", job_key=True),
    "nixl": Connector("nixl", nixl_config("NixlConnector"), legs.pull_legs, baseline_fix=True),
    "nixl-push": Connector("nixl-push", nixl_config("NixlPushConnector"), legs.push_legs, baseline_fix=True),
}


def connector(name: str) -> Connector:
    if name not in CONNECTORS:
        raise ConfigError(f"unknown connector {name!r}; one of {', '.join(CONNECTORS)}", field="connector")
    return CONNECTORS[name]
