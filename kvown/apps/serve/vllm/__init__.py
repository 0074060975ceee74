"""``kvown serve vllm``: real vLLM prefill and decode instances behind one OpenAI proxy.

Modules: ``model`` (the offline tiny model: tokenizer, config, seeded safetensors), ``connectors``
(connector name -> kv-transfer config + leg plan + environment), ``legs`` (the proxy's request flow
per connector), ``proxy`` (the OpenAI front), ``stack`` (starts and stops every process), ``faults``
(the fault matrix), ``cli``. The vLLM processes run from the vLLM venv (``.venv-vllm``); this package
runs in kvown's own venv and never imports vLLM.
"""
