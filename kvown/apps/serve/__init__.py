"""``kvown serve``: a reference disaggregated inference server that embeds a KV link.

Modules: ``model`` (tiny transformer, byte tokenizer, the server's paged KV cache and its block
allocator), ``link`` (the protocol of the one object that moves KV between servers), ``kvownlink``
(it, over kvown), ``kvlink`` (it, over loopback TCP), ``protocol`` (OpenAI request validation and
errors), ``server`` (prefill / decode / single HTTP servers), ``router``, ``etcd`` (start a private
etcd), ``cli`` (``kvown serve prefill|decode|router|local``). docs/embedding.md walks through it.
"""
