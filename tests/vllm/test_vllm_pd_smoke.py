"""The short P/D smoke of ``make test``: real vLLM prefill + decode pairs behind kvown's proxy - kvown's
connector, and NixlConnector (pull, fp32, kvown's baseline fix) as the reference - answer token for token
like the single instance, for a prompt shorter than a block and one of several blocks, whole and
streamed; and the KV really crossed (the transfer counters moved). The edge cases, NixlPushConnector and
disconnects are in test_vllm_pd.py (make test-vllm)."""

from __future__ import annotations

import httpx
import pytest
from vllmkit import complete, running, token_prompt

from kvown.apps.serve.vllm.stack import free_port

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", params=["kvown", "nixl"])
def pd_stack(request, tiny_model, tmp_path_factory):
    extra = {"metrics_port": free_port()} if request.param == "kvown" else {}
    with running(request.param, tiny_model, tmp_path_factory.mktemp(f"vllm-{request.param}-smoke"),
                 connector_extra=extra) as stack:
        yield stack


@pytest.mark.parametrize(("n_tokens", "stream"), [(11, False), (700, True), (700, False)])
def test_pd_equals_single(pd_stack, single_stack, n_tokens, stream):
    prompt = token_prompt(n_tokens, seed=n_tokens)
    ids, _, usage = complete(pd_stack.url, prompt, 24, stream=stream)
    want, _, _ = complete(single_stack.url, prompt, 24)
    assert usage["prompt_tokens"] == n_tokens
    assert ids == want and len(ids) == 24


def _moved(text: str, *names: str) -> bool:
    lines = [line for line in text.splitlines() if not line.startswith("#") and any(n in line for n in names)]
    return bool(lines) and any(float(line.split()[-1]) > 0 for line in lines)


def test_the_transfer_happened(pd_stack):
    """The decode instance got its KV from the prefill instance (not a local recompute, which would pass
    the token check too): NIXL's transfer counter on D, or kvown's bytes written on P's rank."""
    if pd_stack.options.connector == "kvown":
        port = pd_stack.options.connector_extra["metrics_port"]  # the prefill is kvown rank 0
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert _moved(text, 'name="bytes_written"'), text[-2000:]
        return
    text = httpx.get(f"{pd_stack.instances['decode-0'].instance.url}/metrics", timeout=10).text
    assert _moved(text, "vllm:nixl_num_kv_transfers", "nixl_xfer_time_seconds_count"), text[-2000:]
